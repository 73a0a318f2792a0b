"""The dashboard's search and bulk actions (issue 41.4 and 41.5) over HTTP, against private
Redis and NATS servers: failed, dead and poison jobs (and NATS dead letters) found by error
class, message text and payload text, the search bounded to the newest 10,000 entries and
saying how far it read; a bulk retry or delete confirmed first (its count and first pids)
and doing exactly the confirmed jobs, once, even when more match by the time it is posted;
a single delete confirmed first too."""

from __future__ import annotations

import html
import re
from typing import Any

import orjson
import pytest

from broker.failure import NATS_HEADER, Failure
from broker.nats.dead import REASON_HEADER
from broker.redis.keys import QueueKeys
from support import envelopes
from support.dashboard import Client
from support.supervision import QUEUE, keys, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

MAIL, TIMEOUT, ORDER, SLASHED = (
    "6b0eee7d691c00.11111111", "6b0eee7d691c11.22222222", "6b0eee7d691c22.33333333",
    "6b0eee7d691c33.44444444")




def pid_of(n: int) -> str:
    """The ``n``th pid of a test, in the producers' shape."""
    return f"{n:013x}5.{n:08d}"


async def fail_job(client: Any, k: QueueKeys, payload: dict[str, Any] | bytes, pid: str,
                   failure: Failure | None, source: str = "failed") -> None:
    """A job as a supervisor leaves it when it stops retrying (``payload`` as bytes: the
    envelope's payload JSON as a PHP producer writes it)."""
    [(_, raw)] = envelopes.of(QUEUE, [{"x": 1}])
    record = orjson.loads(raw) | {"pid": pid, "attempts": 3}
    if isinstance(payload, bytes):
        encoded = orjson.dumps(record | {"payload": "PAYLOAD"}).replace(b'"PAYLOAD"', payload)
    else:
        encoded = orjson.dumps(record | {"payload": payload})
    await client.set(k.job(pid), encoded)
    await client.lpush(k.failed if source == "failed" else k.dead, pid)
    if failure is not None:
        await client.set(k.error(pid), failure.encode())


def note(body: str) -> str:
    found = re.search(r'<p class="total" id="search-note">(.*?)</p>', body, re.S)
    assert found, body[-3000:]
    return html.unescape(re.sub(r"<[^>]+>", "", found.group(1)))


def listed(body: str) -> list[str]:
    """The pids (NATS: sequences) of the rows of a page, in order."""
    return [html.unescape(re.sub(r"<[^>]+>", " ", cell)).split()[0]
            for cell in re.findall(r'<td class="pid">(.*?)</td>', body, re.S)]


def confirm_form(body: str) -> dict[str, str]:
    """The hidden fields of a confirmation page's form: what its button sends."""
    found = re.search(r'<form method="post" action="[^"]+" id="confirm-form">(.*?)</form>',
                      body, re.S)
    assert found, body[-3000:]
    return {name: html.unescape(value) for name, value in
            re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', found.group(1))}


# -- search ------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_failed_dead_and_poison_jobs_are_found_by_error_class_message_and_payload_text(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await fail_job(redis_client, k, {"to": "maria.lopez@example.org"}, MAIL,
                   Failure("smtplib.SMTPRecipientsRefused", "no mailbox maria.lopez"))
    await fail_job(redis_client, k, {"order": 42}, TIMEOUT,
                   Failure("TimeoutError", "upstream took 30 s"))
    await fail_job(redis_client, k, {"order": 7, "city": "Zürich"}, ORDER,
                   Failure("ValueError", "bad order"))
    # as PHP writes JSON: "/" as "\/", non-ASCII as \u escapes
    await fail_job(redis_client, k, b'{"path":"a\\/b","city":"Z\\u00fcrich"}', SLASHED,
                   Failure("ValueError", "no such path"), source="dead")
    await redis_client.lpush(k.poison, b'{"half": "an envel', b"\xff\xfe city=Z\xc3\xbcrich")
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    client = dashboard.client

    def search(kind: str, query: str) -> tuple[list[str], str]:
        status, body = client.get(f"/q/0/list/{kind}?{query}")
        assert status == 200, body[-2000:]
        return listed(body), note(body)

    pids, said = search("failed", "error=valueerror")  # any case
    assert pids == [ORDER], said
    assert said == ("error contains 'valueerror': searched the newest 3 entries of 3 (at most "
                    "10,000; the first 4,096 bytes of each record); 1 match")
    assert search("failed", "error=SMTP")[0] == [MAIL]
    assert search("failed", "message=upstream+took")[0] == [TIMEOUT]
    assert search("failed", "message=ValueError")[0] == []  # the class is not the message
    assert search("failed", "payload=maria.lopez%40example")[0] == [MAIL]
    assert search("failed", "payload=%22order%22")[0] == [ORDER, TIMEOUT]  # newest first
    assert search("failed", "payload=z%C3%BCrich")[0] == [ORDER]
    assert search("failed", "payload=order&error=Timeout")[0] == [TIMEOUT]  # every field
    assert search("failed", "payload=nowhere")[0] == []
    assert search("dead", "payload=a/b")[0] == [SLASHED]  # the payload as decoded
    assert search("dead", "payload=Z%C3%BCrich&message=path")[0] == [SLASHED]
    pids, said = search("poison", "payload=z%C3%BCrich")
    assert pids == ["0"] and said.endswith("searched the newest 2 entries of 2 (at most "
                                           "10,000; the first 4,096 bytes of each record); "
                                           "1 match"), said
    _, body = client.get("/q/0/list/poison?payload=x")
    assert 'name="error"' not in body  # poison entries have no failure record
    _, body = client.get("/q/0/list/failed?payload=%3Cscript%3E")  # the query, escaped
    assert "<script>" not in body and "&#39;&lt;script&gt;&#39;" in body
    _, body = client.get("/q/0/list/failed")
    assert ("A search reads the newest 10,000 entries at most, the first 4,096 bytes of each "
            "record and 8,192 of its failure record, and stops after 32 MiB.") in body


@pytest.mark.slow
async def test_a_search_reads_the_newest_10000_entries_and_says_how_far_it_got(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    error = Failure("KeyError", "needle").encode()
    for start in range(0, 10_050, 1000):  # oldest first: the first 50 lie past the bound
        chunk = [pid_of(n) for n in range(start, min(start + 1000, 10_050))]
        await redis_client.lpush(k.failed, *chunk)
    pipe = redis_client.pipeline(transaction=False)
    for n in (*range(0, 50), 10_000, 10_020, 10_049):  # 50 too old, three within the bound
        pipe.set(k.error(pid_of(n)), error)
    await pipe.execute()
    await redis_client.lpush(k.failed, pid_of(99_999))  # arrives after: the newest
    await redis_client.set(k.error(pid_of(99_999)), error)
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    status, body = dashboard.client.get("/q/0/list/failed?error=KeyError")
    assert status == 200, body[-2000:]
    assert note(body) == ("error contains 'KeyError': searched the newest 10,000 entries of "
                          "10,051 (at most 10,000; the first 4,096 bytes of each record); "
                          "4 match")
    assert listed(body) == [pid_of(n) for n in (99_999, 10_049, 10_020, 10_000)]


# -- bulk actions ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_bulk_retry_does_exactly_the_confirmed_jobs_once(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    confirmed = [pid_of(n) for n in range(12)]
    for pid in confirmed:
        await fail_job(redis_client, k, {"n": pid}, pid, Failure("ValueError", "boom"))
    await fail_job(redis_client, k, {"n": 0}, TIMEOUT, Failure("TimeoutError", "slow"))
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.get("/q/0/bulk/failed?action=retry&error=ValueError")[0] == 303  # login
    assert client.login("t") == 303

    _, body = client.get("/q/0/list/failed?error=ValueError")  # the count first
    assert note(body).endswith("; 12 match") and "retry the 12 matched…" in body
    link = html.unescape(re.search(r'id="bulk-retry" href="([^"]+)"', body).group(1))
    assert link == "/q/0/bulk/failed?action=retry&error=ValueError"
    status, page = client.get(link)
    assert status == 200 and "Retry <strong>12</strong> jobs, the first 10 of them:" in page
    assert re.findall(r'job\?pid=([0-9a-f.]+)"', page) == list(reversed(confirmed))[:10]
    assert "and 2 more" in page and 'href="/q/0/list/failed?error=ValueError"' in page
    fields = confirm_form(page)
    assert set(fields) == {"csrf", "once", "action", "digest", "count"}
    assert await redis_client.llen(k.ready) == 0  # a confirmation page changes nothing

    late = [pid_of(n) for n in range(100, 103)]  # match too, after the confirmation
    for pid in late:
        await fail_job(redis_client, k, {"n": pid}, pid, Failure("ValueError", "boom"))
    status, body = client.post("/q/0/bulk/failed", fields)
    assert status == 200, body[-2000:]
    assert ("12 of the 12 confirmed jobs of e2e moved from failed back to the ready list"
            in body)
    assert 'id="back" href="/q/0/list/failed"' in body  # the result leads back to the list
    ready = [orjson.loads(raw)["pid"] for raw in await redis_client.lrange(k.ready, 0, -1)]
    assert sorted(ready) == sorted(confirmed)
    assert sorted(p.decode() for p in await redis_client.lrange(k.failed, 0, -1)) == sorted(
        [*late, TIMEOUT])

    # the same form again: the confirmed jobs failed again meanwhile; nothing moves
    for pid in confirmed[:3]:
        await fail_job(redis_client, k, {"n": pid}, pid, Failure("ValueError", "boom"))
    status, body = client.post("/q/0/bulk/failed", fields)
    assert status == 403 and "sent already" in body
    assert await redis_client.llen(k.ready) == 12 and await redis_client.llen(k.failed) == 7
    assert dashboard.output().count("dashboard action by tester") == 1

    # a confirmation's form with another digest, list or action does nothing (and is spent)
    for change in ({"digest": "0" * 32}, {"action": "delete"}):
        fields = confirm_form(client.get(link)[1])
        status, body = client.post("/q/0/bulk/failed", fields | change)
        assert status == 403 and "not the one shown" in body, body[-1000:]
        assert client.post("/q/0/bulk/failed", fields)[0] == 403
    fields = confirm_form(client.get(link)[1])
    assert client.post("/q/0/bulk/dead", fields)[0] == 403
    assert await redis_client.llen(k.ready) == 12 and await redis_client.llen(k.failed) == 7


@pytest.mark.slow
async def test_a_bulk_delete_of_dead_jobs_deletes_the_confirmed_ones_and_keeps_the_rest(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    confirmed = [pid_of(n) for n in range(3)]
    for pid in confirmed:
        await fail_job(redis_client, k, {"to": "gone@example.org"}, pid,
                       Failure("ValueError", "no mailbox"), source="dead")
    await fail_job(redis_client, k, {"to": "kept@example.org"}, MAIL,
                   Failure("ValueError", "no mailbox"), source="dead")
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303
    _, body = client.get("/q/0/list/dead?payload=gone%40")
    assert note(body).endswith("; 3 match") and "delete the 3 matched…" in body
    status, page = client.get("/q/0/bulk/dead?action=delete&payload=gone%40")
    assert status == 200 and "Delete <strong>3</strong> jobs:" in page
    fields = confirm_form(page)
    late = pid_of(50)
    await fail_job(redis_client, k, {"to": "gone@example.org"}, late,
                   Failure("ValueError", "no mailbox"), source="dead")
    await redis_client.lrem(k.dead, 0, confirmed[0])  # retried by someone else meanwhile
    status, body = client.post("/q/0/bulk/dead", fields)
    assert status == 200 and ("2 of the 3 confirmed jobs of e2e deleted from dead with their "
                              "job and failure records; 1 were not there any more") in body
    assert sorted(p.decode() for p in await redis_client.lrange(k.dead, 0, -1)) == [
        late, MAIL]
    assert not await redis_client.exists(*(k.job(p) for p in confirmed[1:]))
    assert await redis_client.exists(k.job(late), k.error(late)) == 2
    assert client.post("/q/0/bulk/dead", fields)[0] == 403
    assert await redis_client.llen(k.dead) == 2


@pytest.mark.slow
async def test_a_bulk_action_needs_a_session_and_names_a_list_it_takes(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await fail_job(redis_client, k, {"n": 1}, MAIL, Failure("ValueError", "boom"))
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    read_only = dashboards(config)
    status, body = read_only.client.get("/q/0/bulk/failed?action=retry&error=ValueError")
    assert status == 403 and "read-only" in body and 'name="once"' not in body
    _, body = read_only.client.get("/q/0/list/failed?error=ValueError")
    assert "bulk-retry" not in body and "1 match" in note(body)
    assert read_only.client.post("/q/0/bulk/failed", {"action": "retry"})[0] == 403

    dashboard = dashboards(config, token="t")
    client = dashboard.client
    assert client.login("t") == 303
    for path in ("/q/0/bulk/poison?action=delete&payload=x",
                 "/q/0/bulk/failed?action=drain&error=x", "/q/0/bulk/failed?action=retry"):
        status, body = client.get(path)
        assert status == 400 and "no bulk" in body, path
    status, body = client.get("/q/0/bulk/failed?action=retry&error=NoSuchError")
    assert status == 200 and "nothing matches error contains 'NoSuchError' now" in (
        html.unescape(body))
    assert 'name="once"' not in body
    other = Client(dashboard.url)  # another session cannot post this one's confirmation
    assert other.login("t") == 303
    fields = confirm_form(client.get("/q/0/bulk/failed?action=retry&error=ValueError")[1])
    assert other.post("/q/0/bulk/failed", fields)[0] == 403
    assert await redis_client.lrange(k.failed, 0, -1) == [MAIL.encode()]


@pytest.mark.slow
async def test_a_single_delete_is_confirmed_first_and_acts_once(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await fail_job(redis_client, k, {"n": 1}, MAIL, Failure("ValueError", "boom"))
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.login("t") == 303
    for path in ("/q/0/list/failed", f"/q/0/job?pid={MAIL}"):
        _, body = client.get(path)  # the delete button leads to the confirmation
        assert re.search(r'<form method="get" action="/q/0/confirm" class="inline">'
                         r'<input type="hidden" name="source" value="failed">'
                         rf'<input type="hidden" name="pid" value="{MAIL}">', body), path
        assert 'name="action" value="delete"' not in body, path
    status, page = client.get(f"/q/0/confirm?source=failed&pid={MAIL}")
    assert status == 200 and "Confirm: delete 1 job of failed" in page
    assert f"job?pid={MAIL}" in page and 'href="/q/0/list/failed"' in page
    fields = confirm_form(page)
    assert {k: v for k, v in fields.items() if k not in ("csrf", "once")} == {
        "action": "delete", "source": "failed", "pid": MAIL}
    assert await redis_client.lrange(k.failed, 0, -1) == [MAIL.encode()]  # not yet
    status, body = client.post("/q/0/action", fields)
    assert status == 200 and f"job {MAIL} of e2e deleted from failed" in body
    await fail_job(redis_client, k, {"n": 1}, MAIL, Failure("ValueError", "boom"))
    assert client.post("/q/0/action", fields)[0] == 403  # replayed: nothing more
    assert await redis_client.lrange(k.failed, 0, -1) == [MAIL.encode()]
    for bad in (f"source=failed&pid=x.{MAIL}", f"source=poison&pid={MAIL}"):
        assert client.get(f"/q/0/confirm?{bad}")[0] == 400, bad


@pytest.mark.slow
async def test_deleting_the_oldest_poison_entries_is_confirmed_first_and_acts_once(
        tmp_path, redis_url, redis_client, dashboards):
    k = keys()
    await redis_client.lpush(k.poison, *[f"old-{n}" for n in range(3)])
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t")
    client = dashboard.client
    assert client.get("/q/0/confirm?source=poison&count=3")[0] == 303  # the login first
    assert client.login("t") == 303
    _, body = client.get("/q/0/list/poison")  # the button leads to the confirmation
    assert re.search(r'<form method="get" action="/q/0/confirm" class="inline">'
                     r'<input type="hidden" name="source" value="poison">'
                     r'<input type="hidden" name="count" value="3">', body)
    assert 'name="action" value="delete"' not in body
    status, page = client.get("/q/0/confirm?source=poison&count=3")
    assert status == 200 and "Confirm: delete the 3 oldest poison entries" in page
    fields = confirm_form(page)
    assert {k: v for k, v in fields.items() if k not in ("csrf", "once")} == {
        "action": "delete", "source": "poison", "count": "3"}
    assert await redis_client.llen(k.poison) == 3  # a confirmation page changes nothing
    await redis_client.lpush(k.poison, "new-0")  # pushed after the page: kept
    status, body = client.post("/q/0/action", fields)
    assert status == 200 and "3 oldest poison entries of e2e deleted" in body, body
    assert await redis_client.lrange(k.poison, 0, -1) == [b"new-0"]
    assert client.post("/q/0/action", fields)[0] == 403  # replayed: nothing more
    assert await redis_client.lrange(k.poison, 0, -1) == [b"new-0"]
    assert client.get("/q/0/confirm?source=poison&count=0")[0] == 400


# -- NATS dead letters -------------------------------------------------------------------------


@pytest.mark.slow
async def test_nats_dead_letters_are_searched_and_bulk_retried_and_deleted_as_confirmed(
        tmp_path, nats_server, nats_brokers, js, dashboards):
    from broker.nats.setup import QueueNames

    await nats_brokers(QUEUE)
    names = QueueNames.of(QUEUE)
    letters = envelopes.of(QUEUE, [{"n": 1}, {"n": 2}, {"city": "Zürich"}, {"n": 4}])
    boom = {NATS_HEADER: Failure("ValueError", "boom").encode().decode()}
    for (_, raw), headers in zip(letters, (boom, boom, {REASON_HEADER: "max deliveries"},
                                           {NATS_HEADER: Failure("KeyError", "k").encode()
                                            .decode()}), strict=True):
        await js.publish(names.dead_subject, raw, headers=headers)
    dashboard = dashboards(write_config(tmp_path, nats_server.url,
                                        handler="examples.noop:handle"), token="t")
    client = dashboard.client
    assert client.login("t") == 303

    def search(query: str) -> tuple[list[str], str]:
        status, body = client.get(f"/q/0/list/dead?{query}")
        assert status == 200, body[-2000:]
        return listed(body), note(body)

    seqs, said = search("error=valueerror")
    assert seqs == ["2", "1"], said
    assert said == ("error contains 'valueerror': searched the newest 4 sequences of the dead "
                    "stream of 4 dead letters (at most 10,000; the first 4,096 bytes of each "
                    "record); 2 match")
    assert search("message=max+deliver")[0] == ["3"]  # the Queue-Reason header
    assert search("payload=z%C3%BCrich")[0] == ["3"]
    assert search("error=KeyError&message=k")[0] == ["4"]

    fields = confirm_form(client.get("/q/0/bulk/dead?action=retry&error=ValueError")[1])
    await js.publish(names.dead_subject, letters[0][1], headers=boom)  # failed again: seq 5
    status, body = client.post("/q/0/bulk/dead", fields)
    assert status == 200 and ("2 of the 2 confirmed dead letters of e2e published again to "
                              "q.e2e.normal and deleted from Q_E2E_DEAD") in body, body[-1000:]
    assert (await js.stream_info(names.stream)).state.messages == 2
    assert client.post("/q/0/bulk/dead", fields)[0] == 403  # replayed
    assert (await js.stream_info(names.stream)).state.messages == 2
    assert search("error=ValueError")[0] == ["5"]

    page = client.get("/q/0/bulk/dead?action=delete&payload=z%C3%BCrich")[1]
    assert "Delete <strong>1</strong> dead letter:" in page and "seq%3A3" in page
    status, body = client.post("/q/0/bulk/dead", confirm_form(page))
    assert status == 200 and "1 of the 1 confirmed dead letters of e2e deleted" in body
    assert (await js.stream_info(names.dead_stream)).state.messages == 2
    assert client.get("/q/0/bulk/failed?action=retry&error=x")[0] == 400  # no failed list

    _, body = client.get("/q/0/list/dead")  # a single delete asks first here too
    assert 'action="/q/0/confirm"' in body and 'name="action" value="delete"' not in body
    page = client.get("/q/0/confirm?source=dead&pid=seq:4")[1]
    assert "Confirm: delete 1 dead letter of dead" in page
    fields = confirm_form(page)
    assert fields["pid"] == "seq:4" and fields["source"] == "dead"
    status, body = client.post("/q/0/action", fields)
    assert status == 200 and "deleted from Q_E2E_DEAD" in body
    assert client.post("/q/0/action", fields)[0] == 403
    assert (await js.stream_info(names.dead_stream)).state.messages == 1


@pytest.mark.slow
async def test_a_redis_cluster_queue_is_searched_and_bulk_retried(
        tmp_path, redis_cluster, dashboards):
    from redis.asyncio.cluster import RedisCluster

    namespace = "{utopia-queue}"
    k = QueueKeys(namespace, QUEUE)
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        for pid in (MAIL, ORDER):
            await fail_job(client, k, {"to": pid}, pid, Failure("ValueError", "boom"))
        await fail_job(client, k, {"n": 1}, TIMEOUT, Failure("TimeoutError", "slow"))
        config = write_config(tmp_path, redis_cluster.url, handler="examples.noop:handle",
                              broker={"cluster": True, "namespace": namespace})
        dashboard = dashboards(config, token="t")
        http = dashboard.client
        assert http.login("t") == 303
        _, body = http.get("/q/0/list/failed?error=ValueError&payload=to")
        assert listed(body) == [ORDER, MAIL] and note(body).endswith("; 2 match")
        fields = confirm_form(http.get("/q/0/bulk/failed?action=retry&error=ValueError")[1])
        status, body = http.post("/q/0/bulk/failed", fields)
        assert status == 200 and "2 of the 2 confirmed jobs of e2e moved" in body
        assert await client.lrange(k.failed, 0, -1) == [TIMEOUT.encode()]
        assert await client.llen(k.ready) == 2
    finally:
        await client.aclose()


async def test_a_search_stops_at_its_byte_bound_and_says_so(redis_client, monkeypatch):
    """In process, with the bounds made small: records of 5,000 bytes are read 4,096 bytes
    each, two a window, and the search stops in the window that passes 10,000 bytes."""
    from types import SimpleNamespace

    from supervisor.dashboard import search

    monkeypatch.setattr(search, "WINDOW", 2)
    monkeypatch.setattr(search, "SEARCH_BYTES", 10_000)
    k = keys()
    for n in range(20):
        await redis_client.set(k.job(pid_of(n)), b"x" * 5000)
        await redis_client.lpush(k.failed, pid_of(n))
    found = await search.redis(SimpleNamespace(client=redis_client, keys=k), "failed",
                               search.Query(payload="xx"))
    assert (found.read, found.matches, found.bytes) == (4, 4, 4 * 4096)
    assert found.selectors == [pid_of(n) for n in (19, 18, 17, 16)]
    assert found.note == ("searched the newest 4 entries of 20 (at most 10,000; the first "
                          "4,096 bytes of each record); 4 match; stopped early: read "
                          "0.00953674 MiB, the most one search reads")
