"""Issue 41.7: a job keeps its last failures, and a poison entry its reason (this project's
keys beside queue 5's, whose formats stay as they are).

- ``supervisor-failures.{q}.{pid}``: a list of the failure records of a job's failed attempts,
  newest first: the first failure (for when the job was first published: queue 5 keeps that
  nowhere) and the last 5. ``supervisor-errors.{q}.{pid}`` still holds the last record as a
  string, as an older supervisor reads it with GET.
- ``supervisor-poison-reasons.{q}`` / ``supervisor-poison-times.{q}``: why and when our
  supervisor poisoned an entry, by the SHA1 of its bytes; the poison list keeps exactly the
  bytes. At most 1,000 reasons; each addition evicts at most as many of the oldest.

Made by the real RedisBroker, read by the operator commands in this process and by the
dashboard as a process.
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

import pytest

from broker import envelope
from broker.base import Action, Settlement
from broker.failure import RECORD_TTL_WITHOUT_JOB_TTL, Failure
from broker.redis.keys import FAILURES_KEPT, POISON_REASONS_KEPT
from support.dashboard import Dashboard
from support.supervision import NAMESPACE, QUEUE, keys, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")

ATTEMPTS = 7


async def one(broker):
    [delivery] = (await broker.receive(10, 0)).deliveries
    return delivery


async def fail(broker, delivery, n: int) -> None:
    failure = Failure("ValueError", f"boom {n}", "jobs.py:12 in handle", "Traceback ...")
    [result] = await broker.settle([Settlement(Action.REJECT, delivery, f"ValueError: boom {n}",
                                               failure)])
    assert result.ok


async def fail_seven_times(redis_client, redis_brokers) -> tuple[str, int]:
    """A job rejected on each of its 7 attempts (max_attempts 7): retried 6 times, then
    failed. Returns its pid and first publish time."""
    pid, raw = envelope.build(QUEUE, {"n": 1})
    published = envelope.decode(raw)["timestamp"]
    await redis_client.lpush(keys().ready, raw)
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE, max_attempts=ATTEMPTS,
                                 consumer_id="sup-1")
    for n in range(1, ATTEMPTS + 1):
        delivery = await one(broker)
        assert delivery.attempts == n - 1
        await fail(broker, delivery, n)
    assert await redis_client.lrange(keys().failed, 0, -1) == [pid.encode()]
    return pid, published


async def test_a_job_failing_7_times_keeps_its_first_and_last_5_failures(
        redis_client, redis_brokers):
    pid, published = await fail_seven_times(redis_client, redis_brokers)
    stored = await redis_client.lrange(keys().failures(pid), 0, -1)
    history = [Failure.decode(record) for record in stored]  # newest first
    assert len(history) == FAILURES_KEPT + 1
    assert [f.attempt for f in history] == [7, 6, 5, 4, 3, 1]
    assert [f.message for f in history] == [f"boom {n}" for n in (7, 6, 5, 4, 3, 1)]
    assert [f.outcome for f in history] == ["failed"] + ["retrying"] * 5
    assert {f.consumer for f in history} == {"sup-1"}
    assert history[-1].published == published  # attempt 1: the first publish time
    assert all(f.published >= published for f in history)
    # The history expires as the error record does (job_ttl 0: a week).
    assert 0 < await redis_client.ttl(keys().failures(pid)) <= RECORD_TTL_WITHOUT_JOB_TTL
    # An older supervisor's reader: GET of supervisor-errors, a string, the last record.
    assert await redis_client.type(keys().error(pid)) == b"string"
    last = await redis_client.get(keys().error(pid))
    assert last == stored[0]
    assert Failure.decode(last).attempt == ATTEMPTS


async def test_a_retried_jobs_commit_forgets_its_history_and_delete_and_retry_drop_it(
        redis_client, redis_brokers, conf, run):
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE, max_attempts=3)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(keys().ready, raw)
    await fail(broker, await one(broker), 1)
    assert await redis_client.llen(keys().failures(pid)) == 1
    assert not await redis_client.exists(keys().error(pid))  # retrying: not failed
    await broker.commit([await one(broker)])
    assert not await redis_client.exists(keys().failures(pid), keys().job(pid))
    # A failed job's delete and retry (the operator's) take the history with the records.
    pids = []
    for n in range(2):
        pid, raw = envelope.build(QUEUE, {"n": n})
        await redis_client.lpush(keys().ready, raw)
        pids.append(pid)
        for attempt in range(1, 4):
            await fail(broker, await one(broker), attempt)
        assert await redis_client.llen(keys().failures(pid)) == 3
    code, _ = await run("failed", conf, "delete", pids[0])
    assert code == 0 and not await redis_client.exists(keys().failures(pids[0]))
    code, _ = await run("failed", conf, "retry", pids[1])
    assert code == 0 and not await redis_client.exists(keys().failures(pids[1]))


async def test_recovery_records_a_lapsed_attempt_in_the_history(redis_client, redis_brokers):
    """A delivery abandoned at exit (the supervisor's own, requeued): its attempt goes in the
    history too, as a failure of that attempt."""
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE, max_attempts=3)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(keys().ready, raw)
    await broker.abandon([await one(broker)])
    [record] = await redis_client.lrange(keys().failures(pid), 0, -1)
    lost = Failure.decode(record)
    assert (lost.attempt, lost.outcome) == (1, "retrying")
    assert lost.published == envelope.decode(raw)["timestamp"]
    assert envelope.decode((await redis_client.lrange(keys().ready, 0, -1))[0])["attempts"] == 1


async def test_failed_show_prints_the_history_and_both_publish_times(
        redis_client, redis_brokers, conf, run):
    pid, published = await fail_seven_times(redis_client, redis_brokers)
    code, out = await run("failed", conf, "show", pid)
    assert code == 0
    assert "attempt      7 (the last; envelope attempts 6)" in out
    stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(published))
    assert f"published    {stamp}" in out and "(first)" in out
    assert "retried " in out
    rows = [line.strip() for line in out.splitlines() if line.startswith("    attempt ")]
    assert [row.split()[1] for row in rows] == ["1", "3", "4", "5", "6", "7"]  # oldest first
    code, out = await run("failed", conf, "show", pid, "--json")
    assert code == 0 and '"first_published_at":' + str(published) in out.replace(" ", "")


# -- poison -----------------------------------------------------------------------------------


async def test_a_poisoned_envelopes_reason_is_kept_beside_the_raw_bytes(
        redis_client, redis_brokers, conf, run):
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE, max_envelope_bytes=1000)
    bad, big = b'{"pid": 1, not json', b'{"pid":"' + b"x" * 2000 + b'"}'
    good_pid, good = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(keys().ready, bad, good, big)
    received = await broker.receive(10, 0)
    assert [d.pid for d in received.deliveries] == [good_pid]
    assert len(received.poisoned) == 2
    # The poison list holds exactly the raw bytes, as queue 5 has it.
    assert sorted(await redis_client.lrange(keys().poison, 0, -1)) == sorted([bad, big])
    reasons = await redis_client.hgetall(keys().poison_reasons)
    digest = {raw: hashlib.sha1(raw).hexdigest().encode() for raw in (bad, big)}
    assert set(reasons) == set(digest.values())
    assert set(await redis_client.zrange(keys().poison_times, 0, -1)) == set(digest.values())
    when, _, why = reasons[digest[big]].decode().partition(" ")
    assert abs(int(when) - time.time()) < 60
    assert why == "envelope of 2010 bytes exceeds 1000: moved to poison unread"
    assert reasons[digest[bad]].decode().partition(" ")[2] == str(
        next(p for p in received.poisoned if p.raw == bad).reason)
    # poison list / show (oldest first: the oversized one was poisoned first by reserve).
    position = (await redis_client.lrange(keys().poison, 0, -1))[::-1].index(bad)
    code, out = await run("poison", conf, "show", str(position))
    assert code == 0 and "reason       invalid JSON: " in out
    code, out = await run("poison", conf, "show", str(1 - position))
    assert code == 0 and "reason       envelope of 2010 bytes exceeds 1000" in out
    code, out = await run("poison", conf, "list")
    assert code == 0 and out.count("  reason ") == 2
    # One pushed by a PHP worker has no reason: said so.
    await redis_client.lpush(keys().poison, b"php")
    code, out = await run("poison", conf, "show", "2")
    assert code == 0 and "(none kept: poisoned by a PHP worker" in out
    # poison delete trims the list; the reasons stay until evicted by the bound.
    code, _ = await run("poison", conf, "delete", "--all")
    assert code == 0 and not await redis_client.exists(keys().poison)
    assert await redis_client.hlen(keys().poison_reasons) == 2


async def test_the_reason_store_keeps_the_newest_1000_evicting_at_most_what_it_adds(
        redis_client, redis_brokers):
    k = keys()
    old = {f"{n:040x}": n for n in range(1, POISON_REASONS_KEPT + 1)}  # very old times
    await redis_client.zadd(k.poison_times, old)
    await redis_client.hset(k.poison_reasons, mapping={d: f"{n} old" for d, n in old.items()})
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE)
    raws = [b"bad %d" % n for n in range(3)]
    await redis_client.lpush(k.ready, *raws)
    assert len((await broker.receive(10, 0)).poisoned) == 3
    assert await redis_client.zcard(k.poison_times) == POISON_REASONS_KEPT
    assert await redis_client.hlen(k.poison_reasons) == POISON_REASONS_KEPT
    gone = [f"{n:040x}" for n in (1, 2, 3)]  # the three oldest
    assert await redis_client.hmget(k.poison_reasons, gone) == [None] * 3
    assert await redis_client.zscore(k.poison_times, f"{4:040x}") == 4
    # Over the bound already (say written by hand): one addition evicts one, not the excess.
    extra = {f"{n:040x}": n for n in range(2000, 2010)}
    await redis_client.zadd(k.poison_times, extra)
    await redis_client.hset(k.poison_reasons, mapping={d: "1 x" for d in extra})
    await redis_client.lpush(k.ready, b"bad again")
    assert len((await broker.receive(10, 0)).poisoned) == 1
    assert await redis_client.zcard(k.poison_times) == POISON_REASONS_KEPT + 10


# -- the dashboard ----------------------------------------------------------------------------


@pytest.fixture
def dashboard(tmp_path: Path, redis_url: str):
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    started = Dashboard([write_config(tmp_path, redis_url, handler="examples.noop:handle")],
                        tmp_path)
    yield started
    started.stop()


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


async def test_the_dashboard_shows_the_history_publish_times_and_poison_reasons(
        redis_client, redis_brokers, dashboard):
    pid, published = await fail_seven_times(redis_client, redis_brokers)
    await redis_client.lpush(keys().ready, b"{not json")
    await (await redis_brokers(QUEUE, namespace=NAMESPACE)).receive(10, 0)
    status, body = dashboard.client.get(f"/q/0/job?pid={pid}")
    assert status == 200, body[-2000:]
    page = _text(body)
    first = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(published))
    assert "first published" in page and first in page
    assert "last retry published" in page
    history = page.split("History, as far as it is known", 1)[1]
    failed = re.findall(r"attempt (\d+) failed \(\w+\) on sup-1: ValueError: boom (\d)", history)
    assert failed == [(n, n) for n in ("1", "3", "4", "5", "6", "7")]  # in order
    assert history.index("first published") < history.index("attempt 1 failed")
    assert history.index("attempt 6 failed") < history.index("last retry published") < (
        history.index("attempt 7 failed"))
    status, body = dashboard.client.get("/q/0/list/poison")
    assert status == 200
    assert re.search(r"0 — \d{4}-\d\d-\d\d [\d:]+ UTC poison: invalid JSON: ", _text(body))


async def test_a_history_key_of_another_type_is_replaced_not_a_failed_settlement(
        redis_client, redis_brokers):
    """Per-message keys are only replaced, never written halfway: a history key holding a
    string (written by hand, say) does not make the batch's settle call fail."""
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE, max_attempts=3)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(keys().ready, raw)
    await redis_client.set(keys().failures(pid), b"not a list")
    await fail(broker, await one(broker), 1)
    [record] = await redis_client.lrange(keys().failures(pid), 0, -1)
    assert Failure.decode(record).message == "boom 1"
