"""The dashboard's doors (issue 41) over HTTP, against private Redis, Redis Cluster and NATS
servers: with a token no page or live fragment shows job data before the login; without
one every page says its data is open, and a non-loopback address is refused; a job is named
only by a pid of the producers' shape and no owner token is shown; a queue page view costs
the broker a few bounded commands and no SCAN, even among 300,000 other keys; and every
action posted twice (a double click) acts once."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any
from urllib.parse import quote

import orjson
import pytest

from broker import envelope
from broker.failure import NATS_HEADER, Failure
from broker.redis.keys import QueueKeys
from supervisor.dashboard import pids
from support import envelopes
from support.dashboard import Dashboard, poll
from support.supervision import QUEUE, keys, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

#: What a payload must never show to a client that did not log in.
EMAIL, NATIONAL_ID = "maria.lopez@example.org", "756.1234.5678.97"
SECRET_PAYLOAD = {"to": EMAIL, "ahv": NATIONAL_ID}
PID_A, PID_B = "6b0eee7d691c00.98204487", "6b0eee7d691c11.11111111"






async def fail_job(client: Any, k: QueueKeys, payload: dict[str, Any], pid: str,
                   source: str = "failed") -> bytes:
    """A job as a supervisor leaves it when it stops retrying; returns its record."""
    [(_, raw)] = envelopes.of(QUEUE, [payload])
    record = orjson.dumps({**orjson.loads(raw), "pid": pid, "attempts": 3})
    await client.set(k.job(pid), record)
    await client.lpush(k.failed if source == "failed" else k.dead, pid)
    await client.set(k.error(pid), Failure("ValueError", f"no mail to {EMAIL}").encode())
    return record


async def register(client: Any, k: QueueKeys, consumer: str, where: str) -> None:
    """A supervisor's record and its entry in the token registry."""
    now = int((await client.time())[0])
    await client.set(k.supervisor(consumer), where, ex=600)
    await client.hset(k.supervisor_tokens, consumer.encode().hex()[:16].ljust(16, "0"),
                      f"{now + 600} {consumer}")


# -- 1. job data only after the login --------------------------------------------------------

#: Every page and live fragment that shows job data, by what it answers without a session.
JOB_PAGES = ["/", "/q/0", "/q/0/list/failed", "/q/0/list/dead", "/q/0/list/poison",
             f"/q/0/job?pid={PID_A}", f"/q/0/list/failed?pid={PID_A}"]
LIVE = ["/live/overview", "/live/q/0"]


def assert_closed(dashboard: Dashboard) -> None:
    client = type(dashboard.client)(dashboard.url)  # a client that never logged in
    for path in JOB_PAGES:
        status, body = client.get(path)
        assert status == 303, (path, status, body[-500:])
        assert client.headers["location"] == f"/login?next={quote(path, safe='')}", path
        assert EMAIL not in body and NATIONAL_ID not in body, path
    for path in LIVE:
        status, body = client.get(path)
        assert status == 401 and "log in again" in body, (path, status)
    for path in ("/healthz", "/static/live.js", "/static/style.css", "/login"):
        assert client.get(path)[0] == 200, path


@pytest.mark.slow
async def test_with_a_token_no_page_shows_job_data_before_the_login_and_the_login_leads_back(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await fail_job(redis_client, k, SECRET_PAYLOAD, PID_A)
    await fail_job(redis_client, k, SECRET_PAYLOAD, PID_B, source="dead")
    await redis_client.lpush(k.poison, orjson.dumps(SECRET_PAYLOAD))
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="s3cret")
    assert_closed(dashboard)
    client = dashboard.client
    target = f"/q/0/job?pid={PID_A}"
    _, form = client.get(f"/login?next={quote(target, safe='')}")
    assert f'name="next" value="{target}"' in form.replace("&amp;", "&")
    assert client.login("wrong", target=target) == 403
    assert client.login("s3cret", target=target) == 303
    assert client.headers["location"] == target  # back where the login was asked for
    for path in [*JOB_PAGES, *LIVE]:
        status, body = client.get(path)
        assert status == 200, (path, body[-1000:])
    for path, shows in ((target, EMAIL), ("/q/0/list/failed", EMAIL),
                        ("/q/0/list/poison", NATIONAL_ID)):
        assert shows in client.get(path)[1], path
    # Another site is never where a login leads.
    for elsewhere in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "q/0"):
        other = type(client)(dashboard.url)
        assert other.login("s3cret", target=elsewhere) == 303
        assert other.headers["location"] == "/", elsewhere
    # Logged out, the same client is shut out again.
    csrf = client.csrf("/q/0/list/failed")
    assert client.post("/logout", {"csrf": "forged"})[0] == 303  # another site's form
    assert client.get("/live/q/0")[0] == 200  # still logged in
    assert client.post("/logout", {"csrf": csrf})[0] == 303
    assert client.get("/live/q/0")[0] == 401 and client.get("/q/0/list/failed")[0] == 303


@pytest.mark.slow
async def test_a_nats_queue_shows_its_dead_letters_only_after_the_login(
        tmp_path, nats_server, nats_brokers, js, dashboards):
    from broker.nats.setup import QueueNames

    await nats_brokers(QUEUE)
    names = QueueNames.of(QUEUE)
    [(pid, raw)] = envelopes.of(QUEUE, [SECRET_PAYLOAD])
    await js.publish(names.dead_subject, raw, headers={
        NATS_HEADER: Failure("ValueError", f"no mail to {EMAIL}").encode().decode()})
    dashboard = dashboards(write_config(tmp_path, nats_server.url,
                                        handler="examples.noop:handle"), token="t")
    closed = type(dashboard.client)(dashboard.url)
    for path in ("/q/0/list/dead", "/q/0/job?pid=seq:1", f"/q/0/job?pid={pid}", "/q/0"):
        status, body = closed.get(path)
        assert status == 303 and EMAIL not in body and NATIONAL_ID not in body, path
    assert closed.get("/live/q/0")[0] == 401
    assert dashboard.client.login("t") == 303
    for path in ("/q/0/list/dead", "/q/0/job?pid=seq:1", f"/q/0/job?pid={pid}"):
        status, body = dashboard.client.get(path)
        assert status == 200 and EMAIL in body, path
    # a dead letter is named by seq:N or a pid, nothing else
    for bad in ("seq:1.x", "seq:", "seq:0", f"x.{pid}", f"{pid}.x", "*"):
        status, body = dashboard.client.get(f"/q/0/job?pid={quote(bad)}")
        assert status == 400 and "not a job of this queue" in body and EMAIL not in body, bad


@pytest.mark.slow
async def test_without_a_token_every_page_says_its_data_is_open_and_the_log_says_so_at_start(
        tmp_path, redis_url, redis_client, dashboards):
    await fail_job(redis_client, keys(), {"n": 1}, PID_A)
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    for path in JOB_PAGES:
        status, body = dashboard.client.get(path)
        assert status == 200 and 'id="open-data"' in body, path
        assert "readable by whoever reaches this port" in body, path
    assert re.search(r"dashboard without a token: the job data its pages show .* is readable "
                     r"by whoever reaches port \d+ of 127\.0\.0\.1", dashboard.output())


def test_a_non_loopback_address_without_a_token_is_refused_with_one_line(
        tmp_path, monkeypatch, capsys):
    from supervisor import cli, exits

    config = write_config(tmp_path, "redis://127.0.0.1:1/0", handler="examples.noop:handle")
    monkeypatch.delenv("QUEUE_DASHBOARD_TOKEN", raising=False)
    assert cli.main(["dashboard", str(config), "--listen", "0.0.0.0:8370"]) == exits.USAGE
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert error.startswith("error: dashboard --listen 0.0.0.0:8370 is not a loopback address "
                            "and no token is set"), error


# -- 1. only the producers' pids; no owner token ---------------------------------------------


def test_every_pid_a_producer_makes_is_taken_and_nothing_else():
    for at in (0.0, 1.5, 1_700_000_000.999999, 4_294_967_295.5, time.time()):
        for _ in range(200):
            assert pids.is_pid(envelope.new_pid(at)), envelope.new_pid(at)
    # PHP's uniqid('', true): 13 hex digits, then lcg_value() * 10 as %.8F
    for php in ("6b0eee7d691c00.98204487", "5f1d7a0b4b2c69.99999999", "5f1d7a0b4b2c610.00000000"):
        assert pids.is_pid(php), php
    for bad in ("", "x.6b0eee7d691c00.98204487", "6b0eee7d691c00.98204487.x",
                "6b0eee7d691c00.98204487\n", "6B0EEE7D691C00.98204487", "6b0eee7d691c0.98204487",
                "6b0eee7d691c00:98204487", "6b0eee7d691c00/98204487", "6b0eee7d691c00*",
                "6b0eee7d691c00.9820448", "job-1", "seq:1", None):
        assert not pids.is_pid(bad), bad
    assert pids.is_dead_letter("seq:12") and not pids.is_dead_letter("seq:1x")


@pytest.mark.slow
async def test_the_job_page_reads_no_key_of_another_queue_and_shows_no_owner_token(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    other = QueueKeys(k.namespace, f"{QUEUE}.x")  # its job records: jobs.e2e.x.<pid>
    await redis_client.set(other.job(PID_A), orjson.dumps({"secret": EMAIL}))
    assert other.job(PID_A) == k.job(f"x.{PID_A}")
    token = "0123456789abcdef" + "fedcba9876543210"
    [(pid, raw)] = envelopes.of(QUEUE, [{"n": 1}])
    await redis_client.lpush(k.processing, pid)
    await redis_client.set(k.job(pid), raw)
    await redis_client.set(k.owner(pid), token)
    await redis_client.set(k.claim(pid), token, ex=60)
    await redis_client.zadd(k.reservations, {k.reservation(token): 2_000_000_000})
    await redis_client.lpush(k.reservation(token), raw)
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303
    for bad in (f"x.{PID_A}", f"{PID_A}.x", f"x%2E{PID_A}", "*", "%00" + PID_A):
        status, body = client.get(f"/q/0/job?pid={bad}")
        assert status == 400 and "not a job of this queue" in body, bad
        assert EMAIL not in body and "secret" not in body, bad
    status, body = client.get(f"/q/0/job?pid={pid}")
    assert status == 200 and "<dt>where</dt><dd>processing</dd>" in body, body[-2000:]
    assert "held by a consumer" in body and "claim live" in body
    status, body = client.get("/live/q/0")
    assert status == 200 and "0123456789abcdef…" in body  # the supervisor's prefix only
    for path in (f"/q/0/job?pid={pid}", "/q/0", "/live/q/0"):
        assert token not in client.get(path)[1], path
        assert token[16:] not in client.get(path)[1], path


# -- 2. what a page view costs Redis ---------------------------------------------------------


def commandstats(client: Any) -> dict[str, dict[str, int]]:
    return {name.removeprefix("cmdstat_"): figures
            for name, figures in client.info("commandstats").items()}


@pytest.mark.slow
async def test_a_queue_page_view_among_300000_other_keys_does_no_scan_and_few_commands(
        tmp_path, redis_url, redis_client, dashboards):
    import redis

    k = keys()
    plain = redis.Redis.from_url(redis_url)
    try:
        for start in range(0, 300_000, 10_000):  # unrelated keys: what a SCAN would walk
            plain.mset({f"other:{n}": "x" for n in range(start, start + 10_000)})
        for n in range(3):
            await register(redis_client, k, f"sup-{n}", f"elsewhere {100 + n}")
        await fail_job(redis_client, k, {"n": 1}, PID_A)
        # interval 3600: the sampler's one read at start, then silence while we count
        dashboard = dashboards(write_config(tmp_path, redis_url,
                                            handler="examples.noop:handle"), interval=3600)
        poll(lambda: 'class="supervisors">3<' in dashboard.client.get("/live/overview")[1],
             "the first sample")
        await asyncio.sleep(1.5)  # past DETAIL_REUSE
        plain.config_resetstat()
        status, body = dashboard.client.get("/live/q/0")
        after = commandstats(plain)
    finally:
        plain.close()
    assert status == 200 and body.count("elsewhere 10") == 3, body[-3000:]
    used = {name: figures for name, figures in after.items()
            if name not in ("info", "config|resetstat", "config")}
    calls = sum(figures["calls"] for figures in used.values())
    usec = sum(figures["usec"] for figures in used.values())
    print(f"one queue page view: {calls} commands, {usec} usec of Redis: "
          f"{ {name: figures['calls'] for name, figures in used.items()} }")
    assert "scan" not in used and "keys" not in used, used
    # 3 supervisors: GET + PTTL of each record and of each running copy; the reservations:
    # ZCARD, ZRANGE, TIME. No registry read: the last sample's supervisors are reused.
    assert calls <= 3 * 4 + 3, used
    assert usec < 5_000, used


@pytest.mark.slow
async def test_a_registry_too_big_to_look_at_per_view_is_said_not_scanned(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    now = int((await redis_client.time())[0])
    await redis_client.hset(k.supervisor_tokens, mapping={
        f"{n:016x}": f"{now + 600} sup-{n}" for n in range(1001)})
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    poll(lambda: "More than 1,000 supervisors are registered" in dashboard.client.get(
        "/live/q/0")[1], "the note")
    assert "cmdstat_scan" not in await redis_client.info("commandstats")


# -- 3. an action posted twice acts once -----------------------------------------------------


@pytest.mark.slow
async def test_the_same_poison_form_posted_twice_deletes_only_what_the_page_showed(
        tmp_path, redis_url, redis_client, dashboards):
    """The issue's case: five entries, the page read, five more pushed, one form sent
    twice (a double click)."""
    k = keys()
    await redis_client.lpush(k.poison, *[f"old-{n}".encode() for n in range(5)])
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303
    _, body = client.get("/q/0/list/poison")
    assert 'name="count" value="5"' in body
    fields = {"action": "delete", "source": "poison", "count": "5"} | client.form(
        "/q/0/confirm?source=poison&count=5")  # the list page's button asks first
    await redis_client.lpush(k.poison, *[f"new-{n}".encode() for n in range(5)])
    status, body = client.post("/q/0/action", fields)
    assert status == 200 and "5 oldest poison entries of e2e deleted" in body, body
    status, body = client.post("/q/0/action", fields)
    assert status == 403 and "sent already" in body, body
    assert await redis_client.lrange(k.poison, 0, -1) == [
        f"new-{n}".encode() for n in reversed(range(5))]


async def double_post(client: Any, path: str, fields: dict[str, str]) -> tuple[str, str]:
    """The same form of ``path`` sent twice: both answers' bodies (the second refused)."""
    fields = fields | client.form(path)
    first_status, first = client.post("/q/0/action", fields)
    second_status, second = client.post("/q/0/action", fields)
    assert first_status == 200, first
    assert second_status == 403 and "sent already" in second, second
    return first, second


@pytest.mark.slow
async def test_a_retried_or_deleted_job_posted_twice_is_not_acted_on_again(
        tmp_path, redis_url, redis_client, dashboards):
    """A supervisor's retry keeps the pid: the job can be back in failed, under the same
    pid, by the time a repeated form arrives. It stays there."""
    k = keys()
    await fail_job(redis_client, k, {"n": 1}, PID_A)
    await fail_job(redis_client, k, {"n": 2}, PID_B, source="dead")
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303

    fields = {"action": "retry", "source": "failed", "pid": PID_A} | client.form(
        f"/q/0/job?pid={PID_A}")
    status, body = client.post("/q/0/action", fields)
    assert status == 200 and "moved from failed back to the ready list" in body, body
    again = await fail_job(redis_client, k, {"n": 1}, PID_A)  # it ran and failed again
    status, body = client.post("/q/0/action", fields)
    assert status == 403 and "sent already" in body
    assert await redis_client.lrange(k.failed, 0, -1) == [PID_A.encode()]
    assert await redis_client.get(k.job(PID_A)) == again and await redis_client.llen(k.ready) == 1

    fields = {"action": "delete", "source": "dead", "pid": PID_B} | client.form(
        "/q/0/list/dead")
    status, body = client.post("/q/0/action", fields)
    assert status == 200 and "deleted from dead" in body, body
    await fail_job(redis_client, k, {"n": 2}, PID_B, source="dead")
    status, body = client.post("/q/0/action", fields)
    assert status == 403 and "sent already" in body
    assert await redis_client.lrange(k.dead, 0, -1) == [PID_B.encode()]
    assert await redis_client.exists(k.job(PID_B)) == 1

    # the other forms of a page that acted are spent with it: reload to act again
    page = client.form("/q/0/list/failed")
    retry = {"action": "retry", "source": "failed", "pid": PID_A}
    assert client.post("/q/0/action", retry | page)[0] == 200
    assert client.post("/q/0/action", {"action": "delete", "source": "dead", "pid": PID_B}
                       | page)[0] == 403
    assert "dashboard action refused (this form was sent already" in dashboard.output()


@pytest.mark.slow
async def test_a_drain_posted_twice_signals_once(tmp_path, redis_url, redis_client,
                                                 dashboards):
    k = keys()
    await register(redis_client, k, "sup-far", "elsewhere.example 4242")
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303
    poll(lambda: "sup-far" in client.get("/live/q/0")[1], "the supervisor on the page")
    first, _ = await double_post(client, "/live/q/0", {"action": "drain",
                                                       "consumer": "sup-far"})
    assert "runs on another host (elsewhere.example 4242)" in first
    assert dashboard.output().count("dashboard action by tester") == 1


@pytest.mark.slow
async def test_a_redis_cluster_queue_lists_its_supervisors_and_acts_once_per_form(
        tmp_path, redis_cluster, dashboards):
    from redis.asyncio.cluster import RedisCluster

    namespace = "{utopia-queue}"
    k = QueueKeys(namespace, QUEUE)
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        await fail_job(client, k, {"n": 1}, PID_A)
        await register(client, k, "sup-c", "elsewhere 7")
        config = write_config(tmp_path, redis_cluster.url, handler="examples.noop:handle",
                              broker={"cluster": True, "namespace": namespace})
        dashboard = dashboards(config, token="t")
        http = dashboard.client
        assert http.get("/q/0/list/failed")[0] == 303
        assert http.login("t") == 303
        poll(lambda: "elsewhere 7" in http.get("/live/q/0")[1], "the registered supervisor")
        assert http.get(f"/q/0/job?pid=x.{PID_A}")[0] == 400
        first, _ = await double_post(http, f"/q/0/job?pid={PID_A}",
                                     {"action": "retry", "source": "failed", "pid": PID_A})
        assert "moved from failed back to the ready list" in first
        assert await client.llen(k.failed) == 0 and await client.llen(k.ready) == 1
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_a_nats_dead_letter_retried_or_deleted_twice_is_acted_on_once(
        tmp_path, nats_server, nats_brokers, js, dashboards):
    from broker.nats.setup import QueueNames

    await nats_brokers(QUEUE)
    names = QueueNames.of(QUEUE)
    letters = envelopes.of(QUEUE, [{"n": 1}, {"n": 2}])
    for _, raw in letters:
        await js.publish(names.dead_subject, raw)
    dashboard = dashboards(write_config(tmp_path, nats_server.url,
                                        handler="examples.noop:handle"), token="t")
    client = dashboard.client
    assert client.login("t") == 303
    (first_pid, first_raw), (second_pid, _) = letters
    first, _ = await double_post(client, "/q/0/list/dead",
                                 {"action": "retry", "source": "dead", "pid": first_pid})
    assert f"dead letter {first_pid} of e2e published again" in first
    # the job failed again and is back in the dead stream: the repeat must not re-drive it
    await js.publish(names.dead_subject, first_raw)
    assert (await js.stream_info(names.stream)).state.messages == 1
    first, _ = await double_post(client, "/q/0/list/dead",
                                 {"action": "delete", "source": "dead", "pid": second_pid})
    assert f"dead letter {second_pid} of e2e deleted" in first
    await js.publish(names.dead_subject, first_raw)
    assert (await js.stream_info(names.dead_stream)).state.messages == 2
    assert (await js.stream_info(names.stream)).state.messages == 1


def test_one_time_action_tokens_are_spent_once_lapse_and_stay_bounded(monkeypatch):
    from supervisor.dashboard import auth

    guard = auth.Guard("t")
    session_id = guard.login("t", "ops")
    csrf = guard.session(session_id).csrf
    once = guard.issue(session_id)
    assert guard.check(session_id, csrf, once)[0] is not None
    refused = guard.check(session_id, csrf, once)
    assert refused[0] is None and "sent already" in refused[1]
    assert guard.check(session_id, csrf, "")[0] is None  # a form without one
    assert guard.issue(None) == "" and guard.issue("no-such-session") == ""
    other = guard.login("t", "other")
    assert guard.check(other, guard.session(other).csrf, guard.issue(session_id))[0] is None
    lapsed = guard.issue(session_id)
    now = time.time()
    monkeypatch.setattr(auth.time, "time", lambda: now + auth.ONCE_SECONDS + 1)
    assert guard.check(session_id, csrf, lapsed)[0] is None
    for _ in range(auth.MAX_ONCE + 10):
        guard.issue(session_id)
    assert len(guard.session(session_id).once) == auth.MAX_ONCE


def test_history_keeps_the_supervisor_ids_of_the_newest_sample_only():
    from supervisor.dashboard.history import History
    from supervisor.dashboard.sources import Counts

    history = History()
    for n in range(3):
        history.add(Counts(consumers=[f"sup-{n}"]), at=1000.0 + n)
    assert [s.counts.consumers for s in history.samples] == [None, None, ["sup-2"]]
