"""The dashboard over HTTP (``python -m supervisor dashboard`` as a process) against private
Redis, Redis Cluster and NATS servers: counts, escaping of hostile values, the refusal of
actions without the token or without the CSRF token, and the actions themselves. The
browser tests (tests/test_dashboard_browser.py) cover what a person sees."""

from __future__ import annotations

import html
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from broker.failure import NATS_HEADER, Failure
from broker.redis.keys import QueueKeys
from supervisor.dashboard import history, plots, scrape
from supervisor.dashboard.sources import Counts
from support import envelopes
from support.dashboard import Dashboard, FailingRedis, poll
from support.supervision import QUEUE, keys, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

#: A pid and an error an attacker could choose: markup, a bidi override, a script.
HOSTILE_PID = '<script>alert("pid")</script>\u202e'
HOSTILE_MESSAGE = '<img src=x onerror=alert(1)> \u202egnp.exe <script>alert("msg")</script>'
#: Pids of the shape every producer makes (PHP's uniqid('', true)): what a job page and an
#: action take.
CLUSTER_PID, BIG_PID, JOB_1, JOB_2, QUIET_PID = (
    "6b0eee7d691c00.98204487", "6b0eee7d691c12.00000001", "6b0eee7d691c25.12345678",
    "6b0eee7d691c36.87654321", "6b0eee7d691c47.55555555")




def row(body: str, index: int = 0) -> dict[str, str]:
    """The overview row of queue ``index``: each cell's class -> its text."""
    found = re.search(rf'<tr id="queue-{index}".*?</tr>', body, re.S)
    assert found, body
    cells = re.findall(r'<td class="(\w+)">(.*?)</td>', found.group(), re.S)
    return {name: html.unescape(re.sub(r"<[^>]+>", "", text)).strip() for name, text in cells}




def overview_shows(dashboard: Dashboard, expected: dict[str, str], index: int = 0) -> None:
    def matches() -> bool:
        cells = row(dashboard.client.get("/live/overview")[1], index)
        return all(cells.get(name) == value for name, value in expected.items())

    try:
        poll(matches, f"the overview to show {expected}")
    except AssertionError:
        raise AssertionError(f"{row(dashboard.client.get('/live/overview')[1], index)}\n"
                             f"{dashboard.output()}") from None


async def fail_job(client: Any, k: QueueKeys, payload: dict[str, Any], pid: str,
                   failure: Failure | None, source: str = "failed") -> None:
    """A job as a supervisor leaves it when it stops retrying: pid in the list, its record
    in jobs.{q}.{pid}, the failure record beside it (issue 25's layout)."""
    [(_, raw)] = envelopes.of(QUEUE, [payload])
    record = orjson.loads(raw)
    record["pid"] = pid
    record["attempts"] = 3
    await client.set(k.job(pid), orjson.dumps(record))
    await client.lpush(k.failed if source == "failed" else k.dead, pid)
    if failure is not None:
        await client.set(k.error(pid), failure.encode())


async def register(client: Any, k: QueueKeys, consumer: str, where: str) -> None:
    """A supervisor as one registers itself: its record, and its entry in the token registry
    (where the sampler and the queue page find it)."""
    now = int((await client.time())[0])
    await client.set(k.supervisor(consumer), where, ex=600)
    prefix = "%016x" % (hash(consumer) & (2**64 - 1))
    await client.hset(k.supervisor_tokens, prefix, f"{now + 600} {consumer}")


# -- counts ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_overview_counts_every_list_of_a_redis_queue(tmp_path, redis_url, redis_client,
                                                           dashboards):
    k = keys()
    await envelopes.lpush_each(redis_client, k.ready, envelopes.of(QUEUE, [{"n": 1}] * 7))
    await redis_client.lpush(k.processing, "p1", "p2")
    await redis_client.lpush(k.failed, "f1", "f2", "f3")
    await redis_client.lpush(k.dead, "d1")
    await redis_client.lpush(k.poison, b"{not json", b"\xff")
    await redis_client.zadd(k.delayed, {b"e1": 1, b"e2": 2})
    await redis_client.config_resetstat()
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    overview_shows(dashboard, {"ready": "7", "processing": "2", "delayed": "2", "failed": "3",
                               "dead": "1", "poison": "2", "supervisors": "0"})
    assert re.search(r"oldest\">\d+ s<", dashboard.client.get("/live/overview")[1])
    # Sampling never walks the keyspace (the cost docs/dashboard.md states): no SCAN, no KEYS.
    commands = await redis_client.info("commandstats")
    assert "cmdstat_scan" not in commands and "cmdstat_keys" not in commands, commands


@pytest.mark.slow
async def test_the_state_column_names_delayed_retries_that_wait_unattended(
        tmp_path, redis_url, redis_client, dashboards):
    """Issue 39.3, sampled by the dashboard itself (it outlives the supervisors): retries
    overdue with no supervisor alive, then overdue beside a live one that does not promote
    them (maintenance_interval 1 s: more than 3 s overdue), then nothing to say."""
    k = keys()
    now = int((await redis_client.time())[0])
    await redis_client.zadd(k.delayed, {b"e1": now - 100, b"e2": now + 3600})
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))

    def state() -> str:
        return row(dashboard.client.get("/live/overview")[1]).get("state", "")

    poll(lambda: "no supervisor is alive" in state(), "the unattended retries")
    assert re.search(r"^2 delayed retries wait, the oldest due 1\d\d s ago and no "
                     r"supervisor is alive", state()), state()
    assert "no supervisor is alive" in dashboard.client.get("/live/q/0")[1]
    await redis_client.set(k.supervisor("alive-1"), "elsewhere 42", ex=600)
    await redis_client.hset(k.supervisor_tokens, "ab" * 8, f"{now + 600} alive-1")
    poll(lambda: "no supervisor's maintenance moves them" in state(), "the overdue retries")
    await redis_client.zrem(k.delayed, b"e1")
    poll(lambda: state() == "ok", "the state to be ok again")


@pytest.mark.slow
async def test_it_keeps_sampling_the_other_queues_while_a_broker_is_down_and_resumes(
        tmp_path, redis_url, redis_client, own_redis_server, dashboards):
    (tmp_path / "up").mkdir()
    (tmp_path / "down").mkdir()
    up = write_config(tmp_path / "up", redis_url, handler="examples.noop:handle")
    down = write_config(tmp_path / "down", own_redis_server.url, handler="examples.noop:handle")
    dashboard = dashboards(up, down)
    overview_shows(dashboard, {"ready": "0"}, index=1)
    own_redis_server.stop()
    poll(lambda: "broker unreachable" in row(dashboard.client.get("/live/overview")[1], 1)
         .get("state", ""), "the unreachable broker to be shown")
    # Its last figures stay, marked stale with their age (issue 41.8); the other's are not.
    body = dashboard.client.get("/live/overview")[1]
    assert re.search(r"figures stale: last good sample \d+ s ago",
                     row(body, 1)["state"]), row(body, 1)
    assert row(body, 1)["ready"] == "0" and 'data-queue="e2e" class="stale"' in body
    assert body.count('class="stale"') == 1 and body.count("stale-tag") == 2  # its 2 charts
    page = dashboard.client.get("/live/q/1")[1]
    assert '<dl class="stale">' in page and "figures stale: last good sample" in page
    await redis_client.lpush(keys().ready, "x", "y")  # the other queue still moves
    overview_shows(dashboard, {"ready": "2"}, index=0)
    own_redis_server.start()
    import redis

    with redis.Redis.from_url(own_redis_server.url) as restarted:
        restarted.lpush(keys().failed, "f")
    overview_shows(dashboard, {"failed": "1", "state": "ok"}, index=1)
    assert "stale" not in dashboard.client.get("/live/overview")[1]


async def test_a_broker_error_of_any_length_is_cut_in_place_and_whole_in_details(
        tmp_path, dashboards):
    """Issue 41.8: a 5,000-character error without a space shows its start where the
    error is shown (the overview's state, the queue page), the whole of it one click away."""
    broker = FailingRedis("<b>" + "x" * 5000 + "</b>")
    try:
        dashboard = dashboards(write_config(tmp_path, broker.url,
                                            handler="examples.noop:handle"))
        state = poll(lambda: row(dashboard.client.get("/live/overview")[1]).get("state"),
                     "the error")
        assert state.startswith("broker unreachable since") and "[cut: " in state
        for path in ("/live/overview", "/live/q/0"):
            body = dashboard.client.get(path)[1]
            whole = re.search(r'<details class="error-whole"><summary>the whole error'
                              r"</summary><pre>(.*?)</pre></details>", body, re.S)
            assert whole and "&lt;b&gt;" + "x" * 5000 + "&lt;/b&gt;" in whole.group(1), path
            assert "<b>" not in body, path
    finally:
        broker.close()


@pytest.mark.slow
async def test_overview_counts_a_redis_cluster_queue(tmp_path, redis_cluster, dashboards):
    from redis.asyncio.cluster import RedisCluster

    namespace = "{utopia-queue}"
    k = QueueKeys(namespace, QUEUE)
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        await envelopes.lpush_each(client, k.ready, envelopes.of(QUEUE, [{"n": 1}] * 4))
        await client.lpush(k.failed, "f1", "f2")
        await fail_job(client, k, {"n": 2}, CLUSTER_PID, Failure("KeyError", "'x'"))
    finally:
        await client.aclose()
    config = write_config(tmp_path, redis_cluster.url, handler="examples.noop:handle",
                          broker={"cluster": True, "namespace": namespace})
    dashboard = dashboards(config)
    overview_shows(dashboard, {"ready": "4", "failed": "3"})
    status, body = dashboard.client.get(f"/q/0/list/failed?pid={CLUSTER_PID}")
    assert status == 200 and "KeyError: &#39;x&#39;" in body
    status, body = dashboard.client.get("/q/0")  # SCANs every master for the records
    assert status == 200 and "no supervisor record" in body


@pytest.mark.slow
async def test_a_nats_queue_shows_its_counts_and_dead_letters_with_their_errors(
        tmp_path, nats_server, nats_brokers, dashboards):
    broker = await nats_brokers(QUEUE)  # creates the streams and the consumer
    for n in range(5):
        await broker.publish(QUEUE, {"n": n})
    failure = Failure("TimeoutError", HOSTILE_MESSAGE, attempt=3, outcome="dead")
    import nats

    connection = await nats.connect(nats_server.url)
    try:
        from broker.nats.setup import QueueNames

        names = QueueNames.of(QUEUE)
        [(_, raw)] = envelopes.of(QUEUE, [{"dead": True}])
        await connection.jetstream().publish(
            names.dead_subject, raw, headers={NATS_HEADER: failure.encode().decode(),
                                              "Queue-Attempts": "3"})
        await connection.jetstream().publish(names.dead_subject, raw,
                                             headers={"Queue-Reason": "worker lost"})
    finally:
        await connection.close()
    dashboard = dashboards(write_config(tmp_path, nats_server.url,
                                        handler="examples.noop:handle"))
    overview_shows(dashboard, {"ready": "5", "processing": "0", "dead": "2", "failed": "n/a"})
    status, body = dashboard.client.get("/q/0/list/dead")
    assert status == 200, body
    main = body[body.index("<main>"):]
    assert "TimeoutError" in body, main
    assert "TimeoutError: &lt;img src=x onerror=alert(1)&gt; \\u202egnp.exe" in body
    assert "<img src=x" not in body and "\u202e" not in body
    assert "(no record) Queue-Reason: worker lost" in body
    status, body = dashboard.client.get("/q/0/job?pid=seq:1")
    assert status == 200 and "outcome</dt><dd>dead" in body
    status, body = dashboard.client.get("/q/0")
    assert status == 200 and "waiting pulls" in body and "JetStream" in body


# -- escaping -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_hostile_pids_errors_and_100_kb_values_are_shown_escaped_and_bounded(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    big = "<script>alert('big')</script>" + "\u202e" * 10 + "x" * 100_000
    traceback = "Traceback (most recent call last):\n  <script>alert('tb')</script>\n"
    await fail_job(redis_client, k, {"text": big}, BIG_PID,
                   Failure("ValueError", HOSTILE_MESSAGE, where="<b>h.py</b>:1",
                           traceback=traceback, attempt=3, outcome="failed"))
    await fail_job(redis_client, k, {"text": big}, HOSTILE_PID, None)  # pushed by hand
    await fail_job(redis_client, k, {"n": 1}, JOB_1, None)
    await redis_client.lpush(k.poison, big.encode())
    await register(redis_client, k, "<script>alert('consumer')</script>", "<i>host</i> 1")
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    quoted = "%3Cscript%3Ealert%28%22pid%22%29%3C/script%3E%E2%80%AE"
    pages = {"/": 200, "/live/overview": 200, "/q/0": 200, "/live/q/0": 200,
             "/q/0/list/failed": 200, "/q/0/list/poison": 200, f"/q/0/job?pid={BIG_PID}": 200,
             f"/q/0/list/failed?pid={BIG_PID}": 200,
             # not a pid a producer makes: refused, and the refusal shows it escaped
             f"/q/0/job?pid={quoted}": 400, f"/q/0/list/failed?pid={quoted}": 400}
    for path, expected in pages.items():
        status, body = dashboard.client.get(path)
        assert status == expected, (path, body[-2000:])
        assert "<script>alert" not in body and "<img src=x" not in body, path
        assert "<b>h.py" not in body and "<i>host" not in body, path
        assert "\u202e" not in body, path  # bidi overrides shown as \u202e, never acted on
        assert len(body) < 200_000, (path, len(body))  # 100 KB values are cut in lists
    _, listing = dashboard.client.get("/q/0/list/failed")
    assert "ValueError: &lt;img src=x onerror=alert(1)&gt; \\u202egnp.exe" in listing
    assert "&lt;script&gt;alert(&#34;pid&#34;)&lt;/script&gt;\\u202e" in listing
    assert "(no record)" in listing  # the job without a failure record
    assert "(not a pid a producer makes" in listing  # the hand-pushed one: no link
    assert f'href="/q/0/job?pid={quoted}"' not in listing
    _, job = dashboard.client.get(f"/q/0/job?pid={BIG_PID}")
    assert "&lt;script&gt;alert(&#39;tb&#39;)&lt;/script&gt;" in job  # the traceback
    assert "the first 65,536 shown" in job  # a 100 KB record is cut, and says so
    _, queue = dashboard.client.get("/live/q/0")
    assert "&lt;script&gt;alert(&#39;consumer&#39;)&lt;/script&gt;" in queue


def running_rows(body: str) -> list[dict[str, str]]:
    """The queue page's running table: each row's cells (text), and "slow" when marked."""
    table = re.search(r'<table class="running">.*?</table>', body, re.S)
    assert table, body
    rows = []
    for found in re.finditer(r"<tr( class=\"slow\")?>(.*?)</tr>", table.group(), re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
                 for cell in re.findall(r"<td[^>]*>(.*?)</td>", found.group(2), re.S)]
        if len(cells) == 7:
            rows.append({"slow": bool(found.group(1)), **dict(zip(
                ("pid", "attempt", "elapsed", "since", "handler", "process", "supervisor"),
                cells, strict=True))})
    return rows


@pytest.mark.slow
async def test_a_crafted_running_copy_is_shown_escaped_and_its_slow_job_marked(
        tmp_path, redis_url, redis_client, dashboards):
    from supervisor import running

    k = keys()
    jobs = [running.Job(0, 4242, HOSTILE_PID, 3, 1_700_000_000.0, 75.0, True),
            running.Job(1, 4243, QUIET_PID, 1, 1_700_000_070.0, 5.0, False)]
    await register(redis_client, k, "sup-a", "<i>host</i> 17")
    await redis_client.set(k.running("sup-a"), running.encode(jobs, 30, 60.0), ex=30)
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    status, body = dashboard.client.get("/live/q/0")
    assert status == 200
    assert "<script>alert" not in body and "\u202e" not in body and "<i>host" not in body
    slow, quiet = running_rows(body)
    assert slow["pid"] == '<script>alert("pid")</script>\\u202e'  # shown, never acted on
    assert (slow["slow"], slow["attempt"], slow["handler"], slow["process"]) == (
        True, "3", "0", "4242")
    assert slow["elapsed"].endswith("past slow_job_after") and slow["supervisor"] == \
        "<i>host</i> 17"
    assert slow["since"] == "2023-11-14 22:13:20 UTC"
    assert (quiet["slow"], quiet["pid"]) == (False, QUIET_PID)
    assert 5 <= int(quiet["elapsed"].removesuffix(" s")) < 60  # plus the time since written
    quoted = "%3Cscript%3Ealert%28%22pid%22%29%3C/script%3E%E2%80%AE"
    assert f'href="/q/0/job?pid={quoted}"' not in body  # no producer's pid: no job page
    assert f'href="/q/0/job?pid={QUIET_PID}"' in body  # its job page, by its pid


@pytest.mark.slow
async def test_the_queue_page_lists_what_a_supervisor_runs_and_marks_a_slow_job(
        tmp_path, redis_url, redis_client, dashboards, supervisors):
    gate = tmp_path / "gate"
    config = write_config(tmp_path, redis_url, handler="tests.handlers.gated:handle",
                          job={"slow_job_after": 2})
    [(pid, raw)] = envelopes.of(QUEUE, [{"gate": str(gate)}])
    await redis_client.lpush(keys().ready, raw)
    supervisor = supervisors(config, redis_url)
    dashboard = dashboards(config)

    def slow_rows() -> list[dict[str, str]]:
        return [row for row in running_rows(dashboard.client.get("/live/q/0")[1])
                if row["slow"]]

    [row] = poll(slow_rows, "the job marked past slow_job_after")
    handler = [p for p in supervisor.family() if "handler 0" in " ".join(p.cmdline())]
    assert (row["pid"], row["attempt"], row["handler"]) == (pid, "1", "0")
    assert [row["process"]] == [str(p.pid) for p in handler]
    assert row["supervisor"].endswith(f" {supervisor.pid}")
    gate.touch()
    poll(lambda: "nothing runs now" in dashboard.client.get("/live/q/0")[1], "no job")


@pytest.mark.slow
async def test_a_nats_queue_page_lists_this_hosts_running_jobs_by_their_titles(
        tmp_path, nats_server, nats_brokers, dashboards, supervisors):
    gate = tmp_path / "gate"
    broker = await nats_brokers(QUEUE)
    [pid] = [await broker.publish(QUEUE, {"gate": str(gate)})]
    config = write_config(tmp_path, nats_server.url, handler="tests.handlers.gated:handle",
                          job={"slow_job_after": 2}, nats={"ack_wait": 3.0})
    supervisor = supervisors(config)
    dashboard = dashboards(config)

    def ours() -> list[dict[str, str]]:  # other tests' supervisors of "e2e" may run here
        body = dashboard.client.get("/live/q/0")[1]
        return [row for row in running_rows(body)
                if row["slow"] and row["supervisor"].endswith(f" {supervisor.pid}")]

    [row] = poll(ours, "the job marked past slow_job_after")
    assert (row["pid"], row["attempt"], row["handler"]) == (pid, "1", "0")
    assert "JetStream keeps no records of ours" in dashboard.client.get("/live/q/0")[1]
    gate.touch()
    poll(lambda: not ours(), "no job")


# -- actions -------------------------------------------------------------------------------


async def test_without_a_token_the_dashboard_is_read_only_and_refuses_actions(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await fail_job(redis_client, k, {"n": 1}, JOB_1, Failure("ValueError", "boom"))
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    _, body = dashboard.client.get("/q/0/list/failed")
    assert "read-only: started without a token" in body and 'name="csrf"' not in body
    assert dashboard.client.login("anything") == 403
    status, body = dashboard.client.post(
        "/q/0/action", {"action": "retry", "source": "failed", "pid": JOB_1, "csrf": "x"})
    assert status == 403 and "started without --token" in body
    status, _ = dashboard.client.get("/q/0/action")  # never by GET
    assert status == 405
    # Another site's name rebound to 127.0.0.1 (DNS rebinding) reads nothing.
    rebound = urllib.request.Request(dashboard.url + "/live/overview",
                                     headers={"Host": "attacker.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(rebound, timeout=30)  # noqa: ASYNC210 - as dashboard.client does
    assert refused.value.code == 400
    assert await redis_client.lrange(k.failed, 0, -1) == [JOB_1.encode()]
    assert await redis_client.llen(k.ready) == 0
    assert "dashboard action refused" in dashboard.output()


@pytest.mark.slow
async def test_actions_need_the_login_and_the_csrf_token_and_then_retry_and_delete(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    for pid in (JOB_1, JOB_2):
        await fail_job(redis_client, k, {"pid": pid}, pid, Failure("ValueError", "boom"))
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="s3cret-token")
    retry = {"action": "retry", "source": "failed", "pid": JOB_1}
    client = dashboard.client

    status, body = client.post("/q/0/action", retry)  # not logged in
    assert status == 403 and "not logged in" in body
    assert client.login("wrong") == 403
    assert client.login("s3cret-token", who="alice <ops>") == 303
    status, body = client.post("/q/0/action", retry)  # logged in, no CSRF token
    assert status == 403 and "CSRF token is missing or wrong" in body
    status, body = client.post("/q/0/action", retry | {"csrf": "forged"})
    assert status == 403
    fields = client.form("/q/0/list/failed")
    status, body = client.post("/q/0/action", retry | fields | {"once": "guessed"})
    assert status == 403 and "sent already" in body  # a one-time token it never made
    assert await redis_client.lrange(k.failed, 0, -1) == [JOB_2.encode(), JOB_1.encode()]
    assert await redis_client.llen(k.ready) == 0

    status, body = client.post("/q/0/action", retry | fields)
    assert status == 200 and "moved from failed back to the ready list" in body, body
    assert await redis_client.lrange(k.failed, 0, -1) == [JOB_2.encode()]
    [ready] = await redis_client.lrange(k.ready, 0, -1)
    assert f'"{JOB_1}"'.encode() in ready
    status, body = client.act("/q/0/list/failed",
                              {"action": "delete", "source": "failed", "pid": JOB_2})
    assert status == 200 and "deleted from failed" in body
    assert await redis_client.llen(k.failed) == 0
    assert not await redis_client.exists(k.job(JOB_2), k.error(JOB_2))
    log = dashboard.output()
    assert "dashboard action by alice <ops>" in log and f"job {JOB_1} of e2e moved" in log
    assert f"job {JOB_2} of e2e deleted" in log

    other = type(client)(dashboard.url)  # another browser: the token is per session
    assert other.post("/q/0/action", retry | fields)[0] == 403


@pytest.mark.slow
async def test_nats_dead_letters_are_searched_by_pid_retried_and_deleted_as_dead_does(
        tmp_path, nats_server, nats_brokers, js, dashboards):
    from broker.nats.setup import QueueNames

    await nats_brokers(QUEUE)  # creates the streams and the consumer
    names = QueueNames.of(QUEUE)
    letters = envelopes.of(QUEUE, [{"n": 1}, {"n": 2}])
    for _, raw in letters:
        await js.publish(names.dead_subject, raw, headers={
            NATS_HEADER: Failure("ValueError", "boom", attempt=3).encode().decode()})
    await js.publish(names.dead_subject, b"\xff not an envelope")
    (first, _), (second, _) = letters

    async def messages(stream: str) -> int:
        return (await js.stream_info(stream)).state.messages

    dashboard = dashboards(write_config(tmp_path, nats_server.url,
                                        handler="examples.noop:handle"), token="t0ken")
    client = dashboard.client
    retry = {"action": "retry", "source": "dead", "pid": "seq:1"}
    status, body = client.post("/q/0/action", retry)  # the Redis actions' rules: login ...
    assert status == 403 and "not logged in" in body
    assert client.login("t0ken", who="bob") == 303
    status, body = client.get(f"/q/0/list/dead?pid={second}")
    assert status == 200 and f"pid {second}: found" in body, body
    assert "job?pid=seq%3A2" in body and "job?pid=seq%3A1" not in body
    _, body = client.get("/q/0/list/dead?pid=6b0eee7d691c00.98204487")
    assert "not among the oldest 10,000 dead letters" in body
    status, body = client.post("/q/0/action", retry | {"csrf": "forged"})  # ... and CSRF
    assert status == 403 and "CSRF" in body
    assert await messages(names.dead_stream) == 3 and await messages(names.stream) == 0

    fields = client.form("/q/0/list/dead")
    status, body = client.post("/q/0/action", retry | fields)
    assert status == 200 and f"dead letter {first} of e2e published again" in body, body
    assert await messages(names.dead_stream) == 2 and await messages(names.stream) == 1
    moved = await js.get_msg(names.stream, 1)
    assert orjson.loads(moved.data)["pid"] == first  # the envelope, unchanged
    status, body = client.act("/q/0/list/dead", retry)  # a fresh page's form: gone meanwhile
    assert status == 200 and "not in Q_E2E_DEAD any more: nothing done" in body
    status, body = client.act("/q/0/list/dead", retry | {"pid": "seq:3"})
    assert "it is not an envelope a handler could take" in body  # left where it is
    assert await messages(names.dead_stream) == 2
    spare = client.form("/q/0/list/dead")  # a page's form, for a drain it never offers
    for seq in ("seq:2", "seq:3"):
        status, body = client.act("/q/0/list/dead", {"action": "delete", "source": "dead",
                                                     "pid": seq})
        assert status == 200 and "deleted from Q_E2E_DEAD" in body, body
    assert await messages(names.dead_stream) == 0 and await messages(names.stream) == 1
    status, body = client.post("/q/0/action", {"action": "drain", "consumer": "x", **spare})
    assert status == 400 and "retry and delete of a dead letter" in body
    log = dashboard.output()
    assert "dashboard action by bob" in log and f"dead letter {first} of e2e published" in log
    assert "dead letter seq:3 of e2e deleted" in log


@pytest.mark.slow
async def test_poison_entries_are_deleted_oldest_first_keeping_those_pushed_since(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await redis_client.lpush(k.poison, b"old-1", b"old-2")
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303
    _, body = client.get("/q/0/list/poison")
    assert "delete the 2 oldest poison entries" in body and 'name="count" value="2"' in body
    fields = client.form("/q/0/confirm?source=poison&count=2")  # the button asks first
    await redis_client.lpush(k.poison, b"new")  # arrives after the page was read
    delete = {"action": "delete", "source": "poison", "count": "2"}
    assert client.post("/q/0/action", delete)[0] == 403  # no CSRF token
    status, body = client.post("/q/0/action", delete | fields)
    assert status == 200 and "2 oldest poison entries of e2e deleted" in body, body
    assert await redis_client.lrange(k.poison, 0, -1) == [b"new"]
    assert "dashboard action by tester" in dashboard.output()


@pytest.mark.slow
async def test_a_supervisor_of_this_host_shows_its_processes_and_drain_stops_it(
        tmp_path, redis_url, redis_client, dashboards, supervisors):
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    supervisor = supervisors(config, redis_url)
    k = keys()

    def recorded() -> list[bytes]:
        import redis

        with redis.Redis.from_url(redis_url) as plain:
            return list(plain.scan_iter(match=k.supervisor("") + "*"))

    [record] = poll(recorded, "the supervisor's record")
    consumer = record.decode()[len(k.supervisor("")):]
    dashboard = dashboards(config, token="t")
    assert dashboard.client.login("t") == 303
    overview_shows(dashboard, {"supervisors": "1"})
    # the queue page adds what this host sees of it: uptime, its and its handlers' titles
    poll(lambda: re.search(r'class="titles">running.*?<br>handler 0 ',
                           dashboard.client.get("/live/q/0")[1], re.S),
         "the supervisor's process titles on the queue page")
    status, body = dashboard.client.act("/q/0", {"action": "drain", "consumer": consumer})
    assert status == 200 and "sent SIGTERM" in body, body
    assert supervisor.wait(30) == 0
    overview_shows(dashboard, {"supervisors": "0", "state": "ok"})  # gone, and still sampled



@pytest.mark.slow
async def test_a_job_a_running_supervisor_failed_is_listed_with_what_is_known_of_its_error(
        tmp_path, redis_url, redis_client, dashboards, supervisors):
    config = write_config(tmp_path, redis_url, handler="tests.handlers.raises:handle",
                          job={"max_attempts": 1})
    [(pid, raw)] = envelopes.of(QUEUE, [{"log": str(tmp_path / "errors.log")}])
    await redis_client.lpush(keys().ready, raw)
    supervisors(config, redis_url)
    dashboard = dashboards(config)
    overview_shows(dashboard, {"failed": "1", "ready": "0"})
    status, body = dashboard.client.get("/q/0/list/failed")
    assert status == 200 and pid in body
    # The supervisor's failure record where it writes one (issue 25), else "(no record)".
    assert "ValueError: boom" in body or "(no record)" in body
    status, body = dashboard.client.get(f"/q/0/job?pid={pid}")
    assert status == 200 and "<dt>where</dt><dd>failed</dd>" in body


# -- parts ------------------------------------------------------------------------------------


def test_a_queue_with_a_backlog_and_nothing_settled_for_a_minute_is_not_draining():
    h = history.History()
    for second in range(0, 70, 5):
        h.add(Counts(ready=10, done=100), at=1000.0 + second)
    assert "not draining: 10 ready" in h.draining()
    h.add(Counts(ready=9, done=101), at=1075.0)
    assert h.draining() == ""
    idle = history.History()
    for second in range(0, 70, 5):
        idle.add(Counts(ready=0, done=5), at=1000.0 + second)
    assert idle.draining() == ""


def test_delayed_retries_nobody_promotes_are_called_unattended():
    """Issue 39.3: the state column says when delayed retries wait with no supervisor
    alive (PHP workers never read them), or overdue past a few maintenance intervals."""
    def said(**counts: Any) -> str:
        h = history.History()
        h.add(Counts(**counts), at=1000.0)
        return h.unattended(overdue_after=15)

    assert said(delayed=0, supervisors=0) == ""
    assert said(delayed=3, supervisors=2, delayed_overdue=4) == ""  # promoted soon
    assert said(delayed=3, supervisors=0) == ("3 delayed retries wait and no supervisor is "
                                              "alive to move them to the ready list")
    assert said(delayed=3, supervisors=0, delayed_overdue=61) == (
        "3 delayed retries wait, the oldest due 61 s ago and no supervisor is alive to move "
        "them to the ready list")
    assert said(delayed=1200, supervisors=2, delayed_overdue=16) == (
        "1,200 delayed retries wait, the oldest due 16 s ago: no supervisor's maintenance "
        "moves them to the ready list")
    assert said(delayed=None, supervisors=0) == ""  # NATS: no delayed set


def test_history_keeps_an_hour_and_rates_are_differences():
    h = history.History()
    for minute in range(90):
        h.add(Counts(done=minute * 600), at=60.0 * minute)
    assert h.samples[0].at >= 89 * 60 - 3600
    assert h.rate(60) == pytest.approx(10.0)
    chart = plots.chart(h.series("rate"), end=89 * 60.0)
    assert chart.count == 61 and chart.last == pytest.approx(10.0)


def test_a_chart_has_round_ticks_a_time_axis_and_its_samples_as_numbers():
    series = [(1000.0 + 5 * n, float(n * 115)) for n in range(17)]  # 0 ... 1,840
    chart = plots.chart(series, end=1085.0, span=85, width=600, height=120, ticks=5)
    assert (chart.top, chart.peak, chart.last, chart.count) == (2000, 1840, 1840, 17)
    assert chart.y_ticks == ("2k", "1.5k", "1k", "500", "0")
    assert chart.x_ticks == ("-85 s", "-64 s", "-42 s", "-21 s", "now")
    assert chart.grid == (2.0, 31.0, 60.0, 89.0, 118.0)
    assert chart.ages.split()[:2] == ["85.0", "80.0"] and chart.ages.split()[-1] == "5.0"
    assert chart.values.split()[-1] == "1840"
    assert chart.points.split()[0] == "0.0,118.0"  # 0 at the bottom, 85 s ago at the left
    rate = plots.chart([(0.0, 0.3), (5.0, 0.05)], end=5.0, span=3600, ticks=3, unit="/s",
                       whole=False)
    assert rate.y_ticks == ("0.4/s", "0.2/s", "0/s") and rate.x_ticks == ("-1 h", "-30 min",
                                                                          "now")
    empty = plots.chart([], end=5.0, span=60, ticks=3)
    assert (empty.y_ticks, empty.last, empty.points, empty.ages) == (("2", "1", "0"), None,
                                                                     "", "")


def test_tick_steps_and_labels_are_round():
    assert [plots.tick_step(peak, 4) for peak in (0, 1, 3, 9, 10, 41, 1840, 1e6)] == [
        1, 1, 1, 5, 5, 20, 500, 250_000]
    assert plots.tick_step(0.3, 2, whole=False) == 0.2
    assert plots.tick_step(0.3, 2) == 1  # a count
    assert [plots.compact(v) for v in (0, 0.25, 40, 900, 2500, 1_200_000)] == [
        "0", "0.25", "40", "900", "2.5k", "1.2M"]
    assert [plots.before(s) for s in (0, 40, 900, 3600, 5400)] == [
        "now", "-40 s", "-15 min", "-1 h", "-1.5 h"]


def test_a_queue_is_stale_while_it_fails_and_unreachable_since_its_first_failure():
    h = history.History()
    h.failed("down", at=990.0)
    assert not h.stale  # nothing was ever shown
    h.add(Counts(ready=3), at=1000.0)
    assert not h.stale
    h.failed("down", at=1005.0)
    h.failed("still down", at=1010.0)
    assert h.stale and (h.failing_since, h.error_at, h.error) == (1005.0, 1010.0, "still down")
    h.add(Counts(ready=4), at=1015.0)
    assert not h.stale and not h.error


def test_histogram_quantiles_from_the_supervisors_buckets():
    text = "\n".join([
        "# TYPE queue_supervisor_handler_seconds histogram",
        *(f'queue_supervisor_handler_seconds_bucket{{queue="q",le="{le}"}} {n}'
          for le, n in (("0.01", 50), ("0.1", 90), ("1.0", 99), ("+Inf", 100))),
        'queue_supervisor_handler_seconds_count{queue="q"} 100',
        'queue_supervisor_handler_seconds_sum{queue="q"} 5',
        "# TYPE queue_supervisor_buffer_prefetch gauge",
        'queue_supervisor_buffer_prefetch{queue="q"} 10',
        "# TYPE queue_supervisor_build_info gauge",
        'queue_supervisor_build_info{queue="q",version="0.2.0",python="3.11.7",broker="redis"}'
        " 1",
    ])
    found = scrape.figures(text)
    assert found["handler"] == {"p50": 0.01, "p90": 0.1, "p99": 1.0}
    assert found["prefetch"] == 10
    assert (found["version"], found["python"]) == ("0.2.0", "3.11.7")
    assert scrape.figures("")["version"] is None  # an older supervisor serves no build info


def test_the_docs_show_the_screenshots_the_scripts_make():
    docs = Path(__file__).resolve().parent.parent / "docs"
    shown = {path for page in docs.glob("*.md")
             for path in re.findall(r"!\[[^\]]*\]\((dashboard/[\w-]+\.png)\)", page.read_text())}
    assert {Path(p).stem for p in shown} == {"overview", "queue", "failed", "job", "canary"}
    made = (docs.parent / "scripts" / "screenshots.py").read_text()
    canary = (docs.parent / "bench" / "canary_live.py").read_text()  # the canary's, from its run
    for path in shown:
        assert (docs / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        # made by a script, not by hand
        assert f'"{Path(path).stem}' in made or f"docs/{path}" in canary, path


def test_without_the_dashboard_extra_it_says_what_to_install(tmp_path, monkeypatch, capsys):
    from supervisor import cli

    config = write_config(tmp_path, "redis://127.0.0.1:1/0", handler="examples.noop:handle")
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    assert cli.main(["dashboard", str(config)]) == 2
    error = capsys.readouterr().err
    assert "needs the extra 'dashboard' (uvicorn is not installed)" in error

