"""Retries with backoff on Redis, and failure records of what stopped retrying (issue 25,
items 1 and 2, the Redis side).

A failed run below max_attempts waits in ``supervisor-delayed.{q}`` (scored by when it is
due, whole seconds of the server clock) instead of going back to the ready list at once;
``promote.lua`` (every maintenance pass) moves it back when due. Delays are checked on the
scores, never by waiting for them: a test makes a retry due by rewriting its score.
"""

from __future__ import annotations

import asyncio
import math
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import envelope
from broker.base import Action, Outcome, Settlement
from broker.failure import RECORD_TTL_WITHOUT_JOB_TTL, Failure
from broker.redis import RedisBroker, recovery
from broker.redis.admin.retry import retry
from broker.redis.keys import QueueKeys
from broker.redis.scripts import Scripts
from broker.retry import RetryPolicy
from tests.queue5 import REAP_AFTER, Queue5Consumer

QUEUE = "backoff"
KEYS = QueueKeys("utopia-queue", QUEUE)


async def server_now(client) -> int:
    return int((await client.time())[0])


async def make_due(client) -> None:
    """Every delayed retry due now (its score in the past), as if its backoff had passed."""
    for member in await client.zrange(KEYS.delayed, 0, -1):
        await client.zadd(KEYS.delayed, {member: 1})


async def backoff_passes(client, seconds: int) -> None:
    """``seconds`` pass for every delayed retry: it is due, and the time written in its
    envelope is that much further in the past (as when it was parked stamped with the time
    of its failure, as versions before issue 39 parked it)."""
    for member in await client.zrange(KEYS.delayed, 0, -1):
        parked = envelope.decode(member)
        older = envelope.requeued(parked, parked["attempts"], parked["timestamp"] - seconds)
        await client.zrem(KEYS.delayed, member)
        await client.zadd(KEYS.delayed, {older: 1})


async def one(broker: RedisBroker):
    [delivery] = (await broker.receive(10, 0)).deliveries
    return delivery


async def reject(broker: RedisBroker, delivery, error: str = "ValueError: boom", **extra):
    [result] = await broker.settle([Settlement(Action.REJECT, delivery, error, **extra)])
    return result


def test_equal_jitter_keeps_half_the_delay_and_the_cap_bounds_it():
    policy = RetryPolicy(9, backoff=2, cap=10)
    assert [policy.delay(n) for n in range(5)] == [2, 4, 8, 10, 10]
    assert [policy.jittered(n, lambda: 0.0) for n in range(5)] == [1, 2, 4, 5, 5]
    assert [policy.jittered(n, lambda: 1.0) for n in range(5)] == [2, 4, 8, 10, 10]
    assert policy.whole_seconds(0, lambda: 0.01) == 2  # rounded up, never shorter
    assert RetryPolicy(3).whole_seconds(1) == 0  # no backoff: at once
    assert RetryPolicy(3, 1).delay(2**63 - 1) == 3600  # a huge count still ends (the cap)
    assert RetryPolicy(3, 1).delay(-5) == 1  # a negative count is no earlier run


async def test_delays_grow_and_are_capped_then_the_job_fails_with_its_record(
    redis_brokers, redis_client
):
    broker = await redis_brokers(QUEUE, consumer_id="sup-1", max_attempts=6, retry_backoff=2,
                                 retry_backoff_max=10, job_ttl=0)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(KEYS.ready, raw)
    for attempts in range(5):
        delivery = await one(broker)
        assert (delivery.pid, delivery.attempts) == (pid, attempts)
        before, here = await server_now(redis_client), int(time.time())
        result = await reject(broker, delivery)
        after, later = await server_now(redis_client), int(time.time())
        ceiling = min(10, 2 * 2**attempts)
        waited = int(result.detail.removeprefix("retrying in ").removesuffix(" s"))
        assert result.outcome is Outcome.OK and result.detail == f"retrying in {waited} s"
        assert math.ceil(ceiling / 2) <= waited <= ceiling
        [(member, score)] = await redis_client.zrange(KEYS.delayed, 0, -1, withscores=True)
        assert before + waited <= score <= after + waited  # due: server clock + the delay
        assert orjson.loads(member)["attempts"] == attempts + 1
        # Parked, it carries when it is due (this host's clock): an older promote.lua that
        # moves it as it is (a rolling upgrade) still pushes it about as young.
        assert here + waited <= orjson.loads(member)["timestamp"] <= later + waited
        # Nothing is ready or processing while it waits: no handler is held by it.
        assert await redis_client.llen(KEYS.ready) == 0
        assert await redis_client.llen(KEYS.processing) == 0
        assert not await redis_client.exists(KEYS.job(pid), KEYS.error(pid))
        assert (await broker.receive(10, 0)).deliveries == []  # not before it is due
        assert (await broker.maintain()).promoted == 0
        await make_due(redis_client)
        assert (await broker.maintain()).promoted == 1
        assert await redis_client.zcard(KEYS.delayed) == 0
    delivery = await one(broker)
    assert delivery.attempts == 5
    result = await reject(broker, delivery)
    assert (result.outcome, result.detail) == (Outcome.OK, "failed")
    assert await redis_client.lrange(KEYS.failed, 0, -1) == [pid.encode()]
    assert await redis_client.zcard(KEYS.delayed) == 0
    record = Failure.decode(await redis_client.get(KEYS.error(pid)))
    assert (record.error, record.message, record.outcome) == ("ValueError", "boom", "failed")
    assert (record.attempt, record.consumer) == (6, "sup-1")
    assert record.at > 0
    # job_ttl 0: the job record is kept for ever, the failure record for a while (39.4)
    assert 0 < await redis_client.ttl(KEYS.error(pid)) <= RECORD_TTL_WITHOUT_JOB_TTL
    assert int(await redis_client.get(KEYS.stat("failed"))) == 6


async def test_zero_backoff_requeues_at_once_as_queue_5_does(redis_brokers, redis_client):
    from support.lua_calls import Recorded

    broker = await redis_brokers(QUEUE, max_attempts=3)
    _pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(KEYS.ready, raw)
    delivery = await one(broker)
    recorded = Recorded(broker.scripts)
    result = await reject(broker, delivery)
    assert (result.outcome, result.detail) == (Outcome.OK, "retrying in 0 s")
    _, args = recorded.last("settle")
    assert args[2] == "r" and len(args) == 5 + 1 + 2  # the 'r' op: token, envelope, record
    [requeued] = await redis_client.lrange(KEYS.ready, 0, -1)
    assert envelope.decode(requeued)["attempts"] == 1
    assert not await redis_client.exists(KEYS.delayed)
    assert (await one(broker)).attempts == 1  # straight back, no promotion needed


async def test_the_structured_failure_is_kept_and_the_record_expires_with_the_job(
    redis_brokers, redis_client
):
    broker = await redis_brokers(QUEUE, consumer_id="sup-2", max_attempts=1, job_ttl=100)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    published = envelope.decode(raw)["timestamp"]
    await redis_client.lpush(KEYS.ready, raw)
    failure = Failure("mymod.Timeout", "upstream took 30 s", "jobs.py:12 in handle",
                      "Traceback ...", attempt=1, at=1_700_000_000.5)
    result = await reject(broker, await one(broker), "mymod.Timeout: upstream", failure=failure)
    assert result.detail == "failed"
    record = Failure.decode(await redis_client.get(KEYS.error(pid)))
    assert record == failure.replace(outcome="failed", consumer="sup-2", published=published)
    # The history holds the same record (its only failed attempt).
    assert await redis_client.lrange(KEYS.failures(pid), 0, -1) == [
        await redis_client.get(KEYS.error(pid))]
    assert 0 < await redis_client.ttl(KEYS.error(pid)) <= 100
    assert 0 < await redis_client.ttl(KEYS.job(pid)) <= 100
    # An operator's retry takes the pid out of failed, and its record with it.
    report = await retry(redis_client, broker.scripts, KEYS)
    assert report.moved == 1
    assert not await redis_client.exists(KEYS.error(pid), KEYS.failures(pid))
    assert await redis_client.llen(KEYS.failed) == 0


async def test_an_expired_job_takes_its_record_out_of_failed_too(redis_brokers, redis_client):
    broker = await redis_brokers(QUEUE, max_attempts=1)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(KEYS.ready, raw)
    await reject(broker, await one(broker))
    await redis_client.delete(KEYS.job(pid))  # its job_ttl ran out, the record's did not
    report = await retry(redis_client, broker.scripts, KEYS)
    assert report.expired == 1
    assert not await redis_client.exists(KEYS.error(pid))


async def test_a_keyed_message_keeps_its_marker_while_its_retry_waits(
    redis_brokers, redis_client
):
    broker = await redis_brokers(QUEUE, max_attempts=3, retry_backoff=60)
    pid = "keyed-1"
    raw = envelope.encode({"pid": pid, "queue": QUEUE, "timestamp": 1_700_000_000,
                           "payload": {}, "attempts": 0, "key": "user-7"})
    marker = KEYS.pending("user-7")
    await redis_client.set(marker, pid)
    await redis_client.lpush(KEYS.ready, raw)
    result = await reject(broker, await one(broker))
    assert result.detail.startswith("retrying in ")
    assert await redis_client.zcard(KEYS.delayed) == 1
    assert await redis_client.get(marker) == pid.encode()  # still pending: a publish coalesces
    await make_due(redis_client)
    await broker.maintain()
    [done] = await broker.commit([await one(broker)])
    assert done.ok and not await redis_client.exists(marker)


async def test_two_promoters_at_once_move_each_retry_once(redis_brokers, redis_client):
    first = await redis_brokers(QUEUE)
    second = await redis_brokers(QUEUE)
    due = {f"due-{n}".encode(): 1 for n in range(2500)}
    later = {f"later-{n}".encode(): 4_000_000_000 for n in range(10)}
    await redis_client.zadd(KEYS.delayed, {**due, **later})
    moved = await asyncio.gather(
        *(recovery.promote(broker.scripts, KEYS, rounds=0) for broker in (first, second)))
    assert sum(moved) == 2500
    ready = await redis_client.lrange(KEYS.ready, 0, -1)
    assert sorted(ready) == sorted(due) and len(set(ready)) == 2500
    assert sorted(await redis_client.zrange(KEYS.delayed, 0, -1)) == sorted(later)
    # The earliest due is consumed first (the consumer end is the list's tail).
    await redis_client.delete(KEYS.ready)
    await redis_client.zadd(KEYS.delayed, {b"b": 5, b"a": 3})
    await redis_client.zrem(KEYS.delayed, *later)
    assert await recovery.promote(first.scripts, KEYS) == 2
    assert await redis_client.lrange(KEYS.ready, 0, -1) == [b"b", b"a"]
    # everything=True (the rollback) moves what is not due yet as well.
    await redis_client.zadd(KEYS.delayed, later)
    assert await recovery.promote(first.scripts, KEYS, everything=True, rounds=0) == 10
    assert not await redis_client.exists(KEYS.delayed)


async def test_dead_letters_of_recovery_and_of_an_exit_carry_a_record(
    redis_brokers, redis_client
):
    """A sweep buries a lapsed delivery out of attempts with "LeaseLapsed"; a supervisor
    exiting with one still running buries it with "WorkerLost"."""
    broker = await redis_brokers(QUEUE, consumer_id="sup-3", max_attempts=1, job_ttl=50)
    for pid in ("lapsed", "lost"):
        await redis_client.lpush(KEYS.ready, envelope.encode(
            {"pid": pid, "queue": QUEUE, "timestamp": 1_700_000_000, "payload": {}}))
    deliveries = (await broker.receive(10, 0)).deliveries
    lapsed = next(d for d in deliveries if d.pid == "lapsed")
    lost = next(d for d in deliveries if d.pid == "lost")
    await redis_client.delete(KEYS.claim("lapsed"), KEYS.supervisor("sup-3"))
    report = await broker.maintain(force=True)
    assert report.dead_consumers == 1
    record = Failure.decode(await redis_client.get(KEYS.error("lapsed")))
    assert (record.error, record.outcome, record.attempt) == ("LeaseLapsed", "dead", 1)
    assert lapsed.receipt in record.message and "attempt 1 of 1" in record.message
    assert 0 < await redis_client.ttl(KEYS.error("lapsed")) <= 50
    await broker.abandon([lost])
    record = Failure.decode(await redis_client.get(KEYS.error("lost")))
    assert (record.error, record.outcome, record.consumer) == ("WorkerLost", "dead", "sup-3")
    assert "supervisor sup-3 exited" in record.message
    assert sorted(await redis_client.lrange(KEYS.dead, 0, -1)) == [b"lapsed", b"lost"]
    # retry --from dead takes the records with the pids.
    report = await retry(redis_client, broker.scripts, KEYS, source="dead")
    assert report.moved == 2
    assert not await redis_client.exists(KEYS.error("lapsed"), KEYS.error("lost"))


async def test_a_requeue_by_recovery_writes_no_record(redis_brokers, redis_client):
    broker = await redis_brokers(QUEUE, consumer_id="sup-4", max_attempts=3)
    await redis_client.lpush(KEYS.ready, envelope.encode(
        {"pid": "p", "queue": QUEUE, "timestamp": 1_700_000_000, "payload": {}}))
    await one(broker)
    await redis_client.delete(KEYS.claim("p"), KEYS.supervisor("sup-4"))
    assert (await broker.maintain(force=True)).dead_consumers == 1
    assert await redis_client.llen(KEYS.ready) == 1
    assert not await redis_client.exists(KEYS.error("p"))


@pytest.mark.parametrize("bad", ["0", "-1", "1.5", "x", "", "2147483648", "9300000000000000"])
async def test_settle_refuses_a_bad_delay_before_any_write(redis_brokers, redis_client, bad):
    from support.lua_calls import Recorded, restore, snapshot

    broker = await redis_brokers(QUEUE, max_attempts=3, retry_backoff=5)
    for n in range(2):
        await redis_client.lpush(KEYS.ready, envelope.build(QUEUE, {"n": n})[1])
    deliveries = (await broker.receive(10, 0)).deliveries
    before = await snapshot(redis_client)
    recorded = Recorded(broker.scripts)
    await broker.settle([Settlement(Action.REJECT, d, "boom") for d in deliveries])
    keys, args = recorded.last("settle")
    assert args[2] == "dd"
    delay_at = 5 + 2 + 1  # after job_ttl, n, ops, offset, record_ttl, 2 tokens: envelope, ...
    for at in (delay_at, delay_at + 3):  # each delay is followed by its failure record
        await restore(redis_client, before)
        changed = [*args]
        changed[at] = bad
        with pytest.raises(Exception, match="QSARG"):
            await redis_client.eval(_source("settle"), len(keys), *keys, *changed)
        assert await snapshot(redis_client) == before
    await restore(redis_client, before)
    changed = [*args]
    changed[delay_at] = changed[delay_at + 3] = "2147483647"  # the longest delay applies
    assert await redis_client.eval(_source("settle"), len(keys), *keys, *changed) == [b"ok"] * 2
    assert await redis_client.zcard(KEYS.delayed) == 2


@pytest.mark.parametrize("args", [[0, "due"], [1001, "due"], ["1.5", "due"], [10, "soon"],
                                  [10], [10, "due", "x"]])
async def test_promote_refuses_bad_arguments_before_any_write(redis_client, args):
    await redis_client.zadd(KEYS.delayed, {b"x": 1})
    with pytest.raises(Exception, match="QSARG"):
        await redis_client.eval(_source("promote"), 2, KEYS.delayed, KEYS.ready, *args)
    assert await redis_client.zcard(KEYS.delayed) == 1
    assert not await redis_client.exists(KEYS.ready)


async def test_promote_refuses_a_wrong_typed_key_before_any_write(redis_client):
    await redis_client.zadd(KEYS.delayed, {b"x": 1})
    await redis_client.set(KEYS.ready, "not a list")
    with pytest.raises(Exception, match="QSTYPE"):
        await redis_client.eval(_source("promote"), 2, KEYS.delayed, KEYS.ready, 10, "due")
    assert await redis_client.zcard(KEYS.delayed) == 1


def _source(name: str) -> str:
    from broker.redis.scripts import lua_source

    return lua_source(name)


async def test_delayed_retries_and_records_on_a_redis_cluster(redis_cluster):
    """The delayed set and the failure records share the queue's hash tag: settle,
    promote and check route to the one node serving its slot."""
    from redis.asyncio.cluster import RedisCluster
    from redis.crc import key_slot

    from broker.redis.admin import status as inspect

    keys = QueueKeys("{utopia-queue}", QUEUE)
    assert key_slot(keys.delayed.encode()) == key_slot(keys.ready.encode())
    assert key_slot(keys.error("p").encode()) == key_slot(keys.ready.encode())
    client = RedisCluster.from_url(redis_cluster.url)
    broker = RedisBroker(redis_cluster.url, QUEUE, namespace="{utopia-queue}", cluster=True,
                         max_attempts=2, retry_backoff=30)
    await broker.connect()
    try:
        pid, raw = envelope.build(QUEUE, {"n": 1})
        await client.lpush(keys.ready, raw)
        [delivery] = (await broker.receive(1, 0)).deliveries
        [result] = await broker.settle([Settlement(Action.REJECT, delivery, "boom")])
        assert result.detail.startswith("retrying in ")
        assert await client.zcard(keys.delayed) == 1
        assert (await inspect.leftovers(client, keys)).delayed == 1
        assert (await inspect.queue_status(client, keys))["delayed"]["count"] == 1
        await client.zadd(keys.delayed, {(await client.zrange(keys.delayed, 0, 0))[0]: 1})
        assert (await broker.maintain()).promoted == 1
        [delivery] = (await broker.receive(1, 0)).deliveries
        [result] = await broker.settle([Settlement(Action.REJECT, delivery, "boom")])
        assert result.detail == "failed"
        assert Failure.decode(await client.get(keys.error(pid))).attempt == 2
    finally:
        await broker.close()
        await client.aclose()


async def test_one_settle_call_mixing_every_op_puts_each_record_and_marker_right(
    redis_brokers, redis_client
):
    """Markers and failure-record keys follow the items' keys in one call: a delayed retry
    and two rejects among commits, retries and releases, keyed and not, each land where
    their own pid says."""
    broker = await redis_brokers(QUEUE, max_attempts=2, retry_backoff=10)
    specs = {  # pid: (attempts, key)
        "wait-k": (0, "ka"), "fail-k": (1, "kb"), "fail": (1, None), "done-k": (0, "kd"),
        "back": (0, None),
    }
    for pid, (attempts, key) in specs.items():
        fields = {"pid": pid, "queue": QUEUE, "timestamp": 1_700_000_000, "payload": {},
                  "attempts": attempts, **({"key": key} if key else {})}
        await redis_client.lpush(KEYS.ready, envelope.encode(fields))
        if key:
            await redis_client.set(KEYS.pending(key), pid)
    deliveries = {d.pid: d for d in (await broker.receive(10, 0)).deliveries}
    plan = [("done-k", Action.COMMIT), ("fail-k", Action.REJECT), ("wait-k", Action.REJECT),
            ("back", Action.RELEASE), ("fail", Action.REJECT)]
    results = await broker.settle([
        Settlement(action, deliveries[pid], f"KeyError: {pid}") for pid, action in plan])
    details = [r.detail for r in results]
    assert all(r.ok for r in results)
    assert details[0] is None and details[1] == details[4] == "failed" and details[3] is None
    assert details[2] in ("retrying in 5 s", "retrying in 6 s", "retrying in 7 s",
                          "retrying in 8 s", "retrying in 9 s", "retrying in 10 s")
    for pid in ("fail-k", "fail"):
        record = Failure.decode(await redis_client.get(KEYS.error(pid)))
        assert (record.error, record.message, record.attempt) == ("KeyError", pid, 2)
    assert not await redis_client.exists(KEYS.error("wait-k"), KEYS.error("done-k"))
    assert await redis_client.get(KEYS.pending("ka")) == b"wait-k"  # waiting: still pending
    assert not await redis_client.exists(KEYS.pending("kb"), KEYS.pending("kd"))
    assert sorted(await redis_client.lrange(KEYS.failed, 0, -1)) == [b"fail", b"fail-k"]
    [waiting] = await redis_client.zrange(KEYS.delayed, 0, -1)
    assert envelope.decode(waiting)["pid"] == "wait-k"
    [released] = await redis_client.lrange(KEYS.ready, 0, -1)
    assert envelope.decode(released)["pid"] == "back"


@pytest.mark.usefixtures("no_url_override")
async def test_status_recover_and_check_tell_of_delayed_retries(
    tmp_path, redis_url, redis_client, capsys
):
    from supervisor import cli
    from support.supervision import write_config

    conf = str(write_config(tmp_path, redis_url, handler="examples.noop:handle",
                            job={"queue": QUEUE}))

    async def run(*args: str) -> tuple[int, str]:
        code = await asyncio.to_thread(cli.main, list(args))
        return code, capsys.readouterr().out

    await redis_client.zadd(KEYS.delayed, {b"due": 1, b"later": 4_000_000_000})
    code, out = await run("status", "--json", conf)
    # Due at 1 (unix s): overdue by about now (issue 39.3's figure).
    delayed = orjson.loads(out)["delayed"]
    assert code == 0 and (delayed["count"], delayed["next_due"]) == (2, 1)
    assert delayed["overdue"] >= int(time.time()) - 60
    code, out = await run("check", conf)
    assert code == 1 and "  2 delayed retries (waiting for their backoff" in out
    code, out = await run("recover", conf)  # what maintenance does: only the due one
    assert code == 0 and "moved 1 delayed retries whose backoff was over" in out
    assert await redis_client.lrange(KEYS.ready, 0, -1) == [b"due"]
    code, out = await run("check", conf)
    assert code == 1 and "  1 delayed retries" in out


# --- issue 39.1: a retry is stamped when it becomes ready -----------------------------------


async def promoted_with_the_server_time(client, parked: list[bytes]) -> list[bytes]:
    """ZADD ``parked`` as due retries, promote them, and check that each reached the ready
    list as exactly ``requeued()`` of it with the server's time of the promotion (which
    is returned, oldest due first)."""
    await client.zadd(KEYS.delayed, {member: n + 1 for n, member in enumerate(parked)})
    before = await server_now(client)
    assert await recovery.promote(Scripts(client), KEYS) == len(parked)
    after = await server_now(client)
    ready = (await client.lrange(KEYS.ready, 0, -1))[::-1]  # the first due at the tail
    assert len(ready) == len(parked)
    for member, pushed in zip(parked, ready, strict=True):
        stamp = envelope.decode(pushed)["timestamp"]
        assert before <= stamp <= after
        was = envelope.decode(member)
        assert pushed == envelope.requeued(was, was["attempts"], stamp), (member, pushed)
    return ready


HOSTILE_PIDS = [
    'a","timestamp":1,"payload":[],"x":"',  # the field's text inside the pid: escaped there
    ',"timestamp":',
    'p\\', 'p\\"', '\\",\\"timestamp\\":', "", "café/☃ 𝄞", "0" * 40,
    '{"pid":"', "\x00\x7f\n",
]


@pytest.mark.parametrize("pid", HOSTILE_PIDS)
async def test_a_promoted_retry_is_stamped_with_the_server_time_whatever_its_pid(
    redis_client, pid
):
    """promote.lua writes the server's time into the envelope, byte for byte what
    ``json_encode`` writes with that time, without parsing it: the digits after the first
    ``,"timestamp":`` of the bytes ``requeued()`` wrote, which can only be the field itself
    (a ``"`` inside a JSON string is always escaped)."""
    payload = {"text": ',"timestamp":5,"payload":[]', "url": "a/b", "deep": [[{"k": 1.5}]]}
    for attempts, key in ((1, None), (2**63 - 1, "user-7")):
        fields = {"pid": pid, "queue": QUEUE, "timestamp": 1_700_000_000, "payload": payload,
                  "attempts": 0, **({"key": key} if key else {})}
        parked = envelope.requeued(fields, attempts, 1_700_000_000)
        await promoted_with_the_server_time(redis_client, [parked])
        await redis_client.delete(KEYS.ready)


async def test_retries_parked_by_an_older_version_are_stamped_too(redis_client):
    """A rolling upgrade: members an older version parked (stamped with the failure time,
    the same layout) are stamped when they become ready; an empty payload and every kind of
    timestamp length are the same bytes as json_encode's."""
    parked = [
        envelope.requeued({"pid": f"old-{n}", "queue": QUEUE, "payload": payload}, 1, stamp)
        for n, (payload, stamp) in enumerate([({}, 1_700_000_000), ({"n": 1}, 0),
                                              ([1, 2], 99), ({"a": "b"}, 2**62)])
    ]
    await promoted_with_the_server_time(redis_client, parked)


INT64 = st.integers(-(2**63), 2**63 - 1)
JSON_VALUES = st.text() | INT64 | st.floats(allow_nan=False, allow_infinity=False)


@pytest.mark.slow
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pid=st.text(), queue=st.text(), stamp=st.integers(0, 2**63 - 1), attempts=INT64,
       key=st.none() | st.text(),
       payload=st.dictionaries(st.text(), JSON_VALUES | st.lists(JSON_VALUES)))
def test_any_envelope_requeued_writes_is_stamped_exactly(
    client, pid, queue, stamp, attempts, key, payload
):
    """The same, for any pid, queue, key and payload ``requeued()`` can write."""
    from broker.redis.scripts import lua_source

    fields = {"pid": pid, "queue": queue, "payload": payload, "key": key}
    parked = envelope.requeued(fields, attempts, stamp)
    client.delete(KEYS.ready)
    client.zadd(KEYS.delayed, {parked: 1})
    before = int(client.time()[0])
    assert client.eval(lua_source("promote"), 2, KEYS.delayed, KEYS.ready, 10, "due") == 1
    [pushed] = client.lrange(KEYS.ready, 0, -1)
    now = envelope.decode(pushed)["timestamp"]
    assert before <= now <= int(client.time()[0])
    assert pushed == envelope.requeued(fields, attempts, now)


@pytest.mark.parametrize("member", [
    b"due",  # not an envelope at all
    b'{"pid":7,"queue":"backoff","timestamp":1,"payload":[],"attempts":1}',  # not our layout
    b'{"pid":"p","queue":"backoff","timestamp":"1","payload":[],"attempts":1}',
    b'{"pid":"p","queue":"backoff","timestamp":-1,"payload":[],"attempts":1}',
    b'{"pid":"p","queue":"backoff","timestamp":1,"attempts":1,"payload":[]}',
    b'{"pid":"p","queue":"backoff","timestamp":1',
    b'{"pid":"p","queue":"backoff","payload":[],"attempts":1}',
])
async def test_a_member_not_written_by_requeued_is_moved_as_it_is(redis_client, member):
    """Nothing else of ours parks retries, but a member of another shape (written by hand,
    by a tool) still moves, unchanged: the script only ever replaces what it recognises."""
    await redis_client.zadd(KEYS.delayed, {member: 1})
    assert await recovery.promote(Scripts(redis_client), KEYS) == 1
    assert await redis_client.lrange(KEYS.ready, 0, -1) == [member]


@pytest.mark.parametrize(("reap_after", "backoff"), [(REAP_AFTER, 80_000), (25, 20)])
async def test_a_promoted_retry_is_protected_from_queue_5s_sweep_for_its_whole_reap_after(
    redis_brokers, redis_client, client, reap_after, backoff
):
    """Issue 39.1, with the queue-5 model at its default ``reapAfter`` and at a short one:
    a retry that waited ``backoff`` s runs on a Workerman worker (it never renews, so its
    claim lapses while the handler runs); ``reapAfter - backoff + 5`` s into that run a
    renewing PHP worker sweeps. Stamped when parked, the retry would look ``reapAfter + 5``
    s old and be run a second time, the first run's commit refused ("no longer owned").
    Stamped when it became ready, it is younger than ``reapAfter`` and stays with its owner.
    (Time passes by the delayed retry's score and stamp, and by the sweeper's clock.)"""
    broker = await redis_brokers(QUEUE, max_attempts=3, retry_backoff=backoff,
                                 retry_backoff_max=backoff, recovery_age=reap_after)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(KEYS.ready, raw)
    result = await reject(broker, await one(broker))
    waited = int(result.detail.removeprefix("retrying in ").removesuffix(" s"))
    await backoff_passes(redis_client, waited)
    assert (await broker.maintain()).promoted == 1
    workerman = Queue5Consumer(client, QUEUE, reap_after=reap_after, adapter="workerman")
    sweeper = Queue5Consumer(client, QUEUE, reap_after=reap_after, adapter="swoole")
    [message] = workerman.receive(1, 0)
    assert (message.pid, message.attempts) == (pid, 1)
    running = reap_after - waited + 5  # the handler has run this long
    assert 0 < running < reap_after - 2
    client.delete(KEYS.claim(pid))  # its claim lapsed: Workerman never renews it
    sweeper.clock = lambda: time.time() + running
    client.delete(KEYS.reap_lock)  # the fleet's sweep interval passed since ours
    assert sweeper.maintain() == 0  # young by its stamp: left to its owner
    workerman.commit(message)  # still owned
    assert await redis_client.llen(KEYS.ready) == await redis_client.llen(KEYS.processing) == 0
    assert int(await redis_client.get(KEYS.stat("success"))) == 1
    assert int(await redis_client.get(KEYS.stat("total"))) == 2  # two runs in all, no third


# --- issue 39.4: failure records are bounded ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("job_ttl", [0, 100])
async def test_a_failure_record_expires_after_a_queue_5_retry_takes_its_pid(
    redis_brokers, redis_client, client, job_ttl
):
    """Issue 39.4: a queue-5 worker's ``retry()`` pops a failed pid and requeues the job
    under a new pid, leaving our failure record of the old one where nothing of ours looks
    again. It must still go: with the job record's expiry, or with ``job_ttl = 0`` (the
    shipped stats-usage configuration: job records kept for ever) its own."""
    broker = await redis_brokers(QUEUE, max_attempts=1, job_ttl=job_ttl)
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(KEYS.ready, raw)
    assert (await reject(broker, await one(broker))).detail == "failed"
    kept_for = job_ttl or RECORD_TTL_WITHOUT_JOB_TTL
    assert 0 < await redis_client.ttl(KEYS.error(pid)) <= kept_for
    worker = Queue5Consumer(client, QUEUE)
    worker.pop_timeout = 1
    worker.clock = lambda: time.time() + 60  # a minute later (it stops at younger jobs)
    worker.retry()
    [requeued] = await redis_client.lrange(KEYS.ready, 0, -1)
    assert envelope.decode(requeued)["pid"] != pid  # the job lives on under a new pid
    assert await redis_client.llen(KEYS.failed) == 0
    assert 0 < await redis_client.ttl(KEYS.error(pid)) <= kept_for  # and the record goes


async def test_every_failure_record_expires_without_a_job_ttl(redis_brokers, redis_client):
    """Rejected, dead-lettered by a sweep, buried at exit: with ``job_ttl = 0`` the job
    records are kept for ever (queue 5's rule) and each failure record for
    RECORD_TTL_WITHOUT_JOB_TTL."""
    broker = await redis_brokers(QUEUE, consumer_id="sup-6", max_attempts=1, job_ttl=0)
    for pid in ("rejected", "lapsed", "lost"):
        await redis_client.lpush(KEYS.ready, envelope.encode(
            {"pid": pid, "queue": QUEUE, "timestamp": 1_700_000_000, "payload": {}}))
    held = {d.pid: d for d in (await broker.receive(10, 0)).deliveries}
    await reject(broker, held["rejected"])
    await redis_client.delete(KEYS.claim("lapsed"), KEYS.supervisor("sup-6"))
    assert (await broker.maintain(force=True)).dead_consumers == 1
    await broker.abandon([held["lost"]])
    for pid in ("rejected", "lapsed", "lost"):
        assert await redis_client.ttl(KEYS.job(pid)) == -1, pid  # kept: queue 5's job_ttl
        assert 0 < await redis_client.ttl(KEYS.error(pid)) <= RECORD_TTL_WITHOUT_JOB_TTL, pid
