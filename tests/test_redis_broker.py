"""The Redis broker against a real redis-server: reserve, claim, settle, extend.

Messages are published with a raw LPUSH of envelope bytes, the way PHP producers do it.
Every test checks the keys and counters the contract names, not just return values.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import warnings
from typing import Any

import orjson
import pytest
import redis.exceptions

from broker import envelope
from broker.base import (
    APPLIED,
    Action,
    BrokerError,
    Delivery,
    Outcome,
    Settlement,
    WrongTypeError,
)
from broker.redis import RedisBroker, has_hash_tag
from support import envelopes
from support.brokers import count_script_calls
from support.waiting import until

QUEUE = "stats-usage"
NS = "utopia-queue"


# -- helpers ----------------------------------------------------------------------------


async def new_broker(url: str, **options: Any) -> RedisBroker:
    broker = RedisBroker(url, QUEUE, consumer_id=options.pop("consumer_id", "tester"), **options)
    await broker.connect()
    return broker


@pytest.fixture
async def broker(redis_brokers):
    return await redis_brokers(QUEUE, consumer_id="tester")


async def publish(client, *raws: bytes, queue: str = QUEUE) -> None:
    for raw in raws:
        await client.lpush(f"{NS}.queue.{queue}", raw)


async def publish_new(client, count: int, **fields: Any) -> list[str]:
    """``count`` fresh envelopes (oldest first); returns their pids in publish order."""
    ready = f"{NS}.queue.{QUEUE}"
    return await envelopes.lpush_each(client, ready, envelopes.fresh(QUEUE, count, **fields))


async def snapshot(client) -> dict[bytes, tuple[bytes, Any]]:
    """Every key of the namespace with its type and value."""
    state: dict[bytes, tuple[bytes, Any]] = {}
    async for key in client.scan_iter(match=f"{NS}.*"):
        kind = await client.type(key)
        if kind == b"string":
            value: Any = await client.get(key)
        elif kind == b"list":
            value = await client.lrange(key, 0, -1)
        elif kind == b"zset":
            value = await client.zrange(key, 0, -1, withscores=True)
        elif kind == b"hash":
            value = await client.hgetall(key)
        else:
            value = None
        state[key] = (kind, value)
    return state


async def counters(client) -> dict[str, int]:
    names = ("total", "processing", "success", "failed")
    values = await client.mget([f"{NS}.stats.{QUEUE}.{name}" for name in names])
    return {name: int(value or 0) for name, value in zip(names, values, strict=True)}


async def lengths(client) -> dict[str, int]:
    kinds = ("queue", "processing", "failed", "poison")
    return {kind: await client.llen(f"{NS}.{kind}.{QUEUE}") for kind in kinds}


def owner_key(pid: str) -> str:
    return f"{NS}.owners.{QUEUE}.{pid}"


def job_key(pid: str) -> str:
    return f"{NS}.jobs.{QUEUE}.{pid}"


def claim_key(pid: str) -> str:
    return f"{NS}.claims.{QUEUE}.{pid}"


RECORD = f"{NS}.supervisors.{QUEUE}.tester".encode()  # informational; extend writes it
TOKENS = f"{NS}.supervisor-tokens.{QUEUE}".encode()  # extend registers the token prefix


# -- envelopes ----------------------------------------------------------------------------

PHP_ENVELOPES = [
    # As PHP json_encode writes them: escaped slashes, [] for an empty payload.
    b'{"pid":"65f1c2a3b4c5d6.12345678","queue":"stats-usage","timestamp":1710000000,'
    b'"payload":{"url":"https:\\/\\/cloud.example.com\\/v1","value":3}}',
    b'{"pid":"65f1c2a3b4c5d7.22345678","queue":"stats-usage","timestamp":1710000001,'
    b'"payload":[]}',
    b'{"pid":"65f1c2a3b4c5d8.32345678","queue":"stats-usage","timestamp":1710000002,'
    b'"payload":{"a":[1,2]},"attempts":2}',
    b'{"pid":"65f1c2a3b4c5d9.42345678","queue":"stats-usage","timestamp":1710000003,'
    b'"payload":{},"attempts":0,"priority":false,"trace":{"id":"x"}}',
]

MALFORMED = [
    b"{not json",
    b'[{"pid":"a","queue":"q","timestamp":1,"payload":{}}]',
    b'"just a string"',
    b'{"queue":"stats-usage","timestamp":1,"payload":{}}',
    b'{"pid":"p1","timestamp":1,"payload":{}}',
    b'{"pid":"p2","queue":"stats-usage","payload":{}}',
    b'{"pid":[7],"queue":"stats-usage","timestamp":1,"payload":{}}',
    b'{"pid":"p3","queue":["x"],"timestamp":1,"payload":{}}',
    b'{"pid":"p4","queue":"stats-usage","timestamp":null,"payload":{}}',
    b"",
    b"\x00\xff\xfe\x80binary\x9c",
    b'{"pid":"p5","queue":"stats-usage","timestamp":1,"payload":{"blob":"'
    + b"x" * (1024 * 1024) + b'"}}',
]


async def test_php_envelopes_are_accepted(broker, redis_client):
    await publish(redis_client, *PHP_ENVELOPES)
    received = await broker.receive(10, 0)
    assert received.poisoned == []
    assert [d.raw for d in received.deliveries] == PHP_ENVELOPES
    first, empty, retried, extra = received.deliveries
    assert first.payload == {"url": "https://cloud.example.com/v1", "value": 3}
    assert first.attempts == 0 and first.timestamp == 1710000000 and first.queue == QUEUE
    assert empty.payload == {}
    assert retried.attempts == 2
    assert extra.envelope["trace"] == {"id": "x"}
    for delivery in received.deliveries:
        assert await redis_client.get(job_key(delivery.pid)) == delivery.raw
        assert await redis_client.get(owner_key(delivery.pid)) == delivery.receipt.encode()
        assert await redis_client.ttl(job_key(delivery.pid)) == -1
    assert await counters(redis_client) == {
        "total": 4, "processing": 4, "success": 0, "failed": 0,
    }


async def test_keys_built_at_the_claim_settle_it_and_a_delivery_without_them_too(
    broker, redis_client
):
    """Each delivery carries its claims, jobs and owners key from the claim on; settle and
    extend use them, and build them for a delivery made elsewhere (without keys)."""
    await publish_new(redis_client, 2)
    built, bare = (await broker.receive(10, 0)).deliveries
    assert built.keys == (claim_key(built.pid), job_key(built.pid), owner_key(built.pid))
    bare = Delivery(bare.pid, bare.queue, bare.timestamp, bare.attempts, bare.payload,
                    bare.raw, bare.receipt, bare.envelope)
    assert bare.keys == ()
    assert await broker.extend([built, bare]) == [True, True]
    assert await redis_client.ttl(built.keys[0]) > 0
    results = await broker.settle([Settlement(Action.COMMIT, built),
                                   Settlement(Action.COMMIT, bare)])
    assert [result.outcome for result in results] == [Outcome.OK, Outcome.OK]
    assert await redis_client.exists(job_key(built.pid), job_key(bare.pid)) == 0


async def test_malformed_envelopes_go_to_poison(broker, redis_client):
    broker.max_envelope_bytes = 512 * 1024  # a configured limit (by default none, as in PHP)
    good = await publish_new(redis_client, 1)
    await publish(redis_client, *MALFORMED)
    received = await broker.receive(100, 0)
    assert [d.pid for d in received.deliveries] == good
    # The oversized one (the last) went to poison inside reserve.lua: never read (issue 28 M1)
    assert [p.raw for p in received.poisoned] == [*MALFORMED[:-1], b""]
    assert all(p.reason for p in received.poisoned)
    assert "exceeds" in received.poisoned[-1].reason
    poison = await redis_client.lrange(f"{NS}.poison.{QUEUE}", 0, -1)
    assert sorted(poison) == sorted(MALFORMED)
    # Poison counts in no counter (queue 5).
    assert await counters(redis_client) == {
        "total": 1, "processing": 1, "success": 0, "failed": 0,
    }
    assert await lengths(redis_client) == {
        "queue": 0, "processing": 1, "failed": 0, "poison": len(MALFORMED),
    }
    assert await redis_client.zcard(f"{NS}.reservations.{QUEUE}") == 0
    # Nothing malformed comes back later either.
    assert (await broker.receive(100, 0)).deliveries == []


# -- reserving: sparse and blocking ---------------------------------------------------


async def test_sparse_queue_returns_at_once(broker, redis_client):
    [pid] = await publish_new(redis_client, 1)
    started = time.monotonic()
    received = await broker.receive(100, block_timeout=30)
    elapsed = time.monotonic() - started
    assert [d.pid for d in received.deliveries] == [pid]
    assert elapsed < 10  # it did not wait (30 s) for the batch to fill


async def test_blocking_receive_gets_a_message_published_later(broker, redis_client):
    registry = f"{NS}.reservations.{QUEUE}"
    task = asyncio.create_task(broker.receive(10, 3))

    async def registered() -> bool:
        return await redis_client.zcard(registry) == 1

    await until(registered)  # registered before it blocks
    [pid] = await publish_new(redis_client, 1)
    received = await task
    assert [d.pid for d in received.deliveries] == [pid]
    assert await redis_client.zcard(registry) == 0
    assert await counters(redis_client) == {
        "total": 1, "processing": 1, "success": 0, "failed": 0,
    }


async def test_blocking_receive_times_out_cleanly(broker, redis_client):
    received = await broker.receive(10, 0.2)
    assert received.deliveries == [] and received.poisoned == []
    assert await snapshot(redis_client) == {}


async def test_blocking_read_does_not_hold_up_settlement(broker, redis_client):
    await publish_new(redis_client, 1)
    [delivery] = (await broker.receive(10, 0)).deliveries
    task = asyncio.create_task(broker.receive(10, 3))
    await until(lambda: _zcard(redis_client, f"{NS}.reservations.{QUEUE}", 1))
    assert [r.outcome for r in await broker.commit([delivery])] == [Outcome.OK]
    assert await broker.extend([]) == []
    assert not task.done()
    await publish_new(redis_client, 1)
    assert len((await task).deliveries) == 1


async def _zcard(client, key: str, expected: int) -> bool:
    return await client.zcard(key) == expected


async def test_reserve_clamps_the_batch_size(broker, redis_client):
    await publish_new(redis_client, 3)
    calls = count_script_calls(broker)
    reservation = await broker.reserve(0, 0)
    assert len(reservation.payloads) == 1
    reservation = await broker.reserve(5000, 0)
    assert len(reservation.payloads) == 2
    assert [size for _, size in calls] == [1, 1000]


# -- claiming -------------------------------------------------------------------------


@pytest.mark.parametrize("unregistered", [False, True])
async def test_expired_reservation_goes_back_instead_of_being_claimed(
    broker, redis_client, caplog, unregistered
):
    await publish_new(redis_client, 2)
    ready_before = await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1)
    reservation = await broker.reserve(10, 0)
    registry = f"{NS}.reservations.{QUEUE}"
    if unregistered:  # recovered already as an empty blocking reservation, say
        await redis_client.zrem(registry, reservation.key)
    else:
        await redis_client.zadd(registry, {reservation.key: 1})
    with caplog.at_level(logging.WARNING, logger="broker.redis"):
        received = await broker.claim(reservation)
    assert received.deliveries == [] and received.poisoned == []
    assert "2 payloads went back" in caplog.text
    after = await snapshot(redis_client)
    after.pop(RECORD, None)
    after.pop(TOKENS, None)
    # Back in the ready list in their order; no list is left that no registry names.
    assert after == {f"{NS}.queue.{QUEUE}".encode(): (b"list", ready_before)}


async def test_reservation_changed_under_us_is_left_for_maintenance(broker, redis_client):
    await publish_new(redis_client, 2)
    reservation = await broker.reserve(10, 0)
    await redis_client.lpop(reservation.key)
    before = await snapshot(redis_client)
    received = await broker.claim(reservation)
    assert received.deliveries == []
    assert await snapshot(redis_client) == before


async def test_duplicate_pid_in_one_batch_is_deferred(broker, redis_client):
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await publish(redis_client, raw, raw)
    received = await broker.receive(10, 0)
    assert [d.pid for d in received.deliveries] == [pid]
    assert await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1) == [raw]
    assert await redis_client.lrange(f"{NS}.processing.{QUEUE}", 0, -1) == [pid.encode()]
    assert await redis_client.get(owner_key(pid)) == received.deliveries[0].receipt.encode()
    assert await counters(redis_client) == {
        "total": 1, "processing": 1, "success": 0, "failed": 0,
    }


async def test_already_owned_pid_is_deferred(broker, redis_client):
    pid, raw = envelope.build(QUEUE, {"n": 1})
    other_pid, other = envelope.build(QUEUE, {"n": 2})
    await publish(redis_client, raw)
    [first] = (await broker.receive(10, 0)).deliveries
    await publish(redis_client, raw, other)  # the copy is taken first
    # The copy waits at the producer end, behind what arrives meanwhile.
    [taken] = (await broker.receive(1, 0)).deliveries or (await broker.receive(1, 0)).deliveries
    assert taken.pid == other_pid
    assert await redis_client.get(owner_key(pid)) == first.receipt.encode()
    assert await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1) == [raw]
    # Once the first delivery is settled, the duplicate is delivered (at least once).
    await broker.commit([first])
    [second] = (await broker.receive(10, 0)).deliveries
    assert second.pid == pid and second.receipt != first.receipt


@pytest.mark.slow
async def test_a_waiting_duplicate_does_not_spin_the_receive_loop(broker, redis_client):
    """Hole 4: a copy of a pid being processed (a retried publish can store one) used to make
    every receive return at once, thousands of script calls a second, while the first ran."""
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await publish(redis_client, raw)
    [first] = (await broker.receive(10, 0)).deliveries
    await publish(redis_client, raw)
    calls = count_script_calls(broker)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert (await broker.receive(10, 1.0)).deliveries == []
    assert len(calls) <= 20  # ~4 receives a second, each a reserve and a claim
    assert await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1) == [raw]
    await broker.commit([first])
    assert [d.pid for d in (await broker.receive(10, 0)).deliveries] == [pid]


async def test_lost_claim_reply_is_resolved_without_losing_work(broker, redis_client):
    pids = await publish_new(redis_client, 3)
    original = broker.scripts.call

    async def reply_lost(name, keys, args=()):
        result = await original(name, keys, args)
        if name == "claim":
            raise redis.exceptions.ConnectionError("connection reset after the claim ran")
        return result

    broker.scripts.call = reply_lost  # type: ignore[method-assign]
    with pytest.raises(BrokerError):
        await broker.receive(10, 0)
    broker.scripts.call = original  # type: ignore[method-assign]
    received = await broker.receive(10, 0)
    assert sorted(d.pid for d in received.deliveries) == sorted(pids)
    assert await broker.extend(received.deliveries) == [True] * 3
    assert await counters(redis_client) == {
        "total": 3, "processing": 3, "success": 0, "failed": 0,
    }


async def test_lost_claim_reply_then_a_failed_ownership_check_is_resolved_later(
    broker, redis_client
):
    """Hole 5: a lost claim reply, then a failed extend while resolving it, used to leave the
    deliveries owned (and renewed) by a live consumer but tracked nowhere."""
    pids = await publish_new(redis_client, 3)
    original = broker.scripts.call
    failures = {"claim": 1, "extend": 1}

    async def flaky(name, keys, args=()):
        if name == "extend" and failures["extend"]:
            failures["extend"] -= 1
            raise redis.exceptions.ConnectionError("connection reset before extend")
        result = await original(name, keys, args)
        if name == "claim" and failures["claim"]:
            failures["claim"] -= 1
            raise redis.exceptions.ConnectionError("connection reset after the claim ran")
        return result

    broker.scripts.call = flaky  # type: ignore[method-assign]
    for _ in range(2):  # the lost reply, then the failed ownership check
        with pytest.raises(BrokerError):
            await broker.receive(10, 0)
    received = await broker.receive(10, 0)
    assert sorted(d.pid for d in received.deliveries) == sorted(pids)
    assert await broker.extend(received.deliveries) == [True] * 3
    assert [r.ok for r in await broker.commit(received.deliveries)] == [True] * 3
    assert await counters(redis_client) == {
        "total": 3, "processing": 0, "success": 3, "failed": 0,
    }


# -- settling -------------------------------------------------------------------------


async def test_stale_owner_changes_nothing(broker, redis_client):
    await publish_new(redis_client, 1)
    [delivery] = (await broker.receive(10, 0)).deliveries
    # Another consumer recovered the delivery and owns it now.
    await redis_client.set(owner_key(delivery.pid), b"0123456789abcdef0123456789abcdef")
    before = await snapshot(redis_client)
    before.pop(RECORD, None)
    before.pop(TOKENS, None)
    for settle in (broker.commit, broker.reject, broker.release):
        assert [r.outcome for r in await settle([delivery])] == [Outcome.STALE]
        after = await snapshot(redis_client)
        after.pop(RECORD, None)
        after.pop(TOKENS, None)
        assert after == before
    assert await broker.extend([delivery]) == [False]
    after = await snapshot(redis_client)
    after.pop(RECORD, None)
    after.pop(TOKENS, None)
    assert after == before
    # Owner key gone altogether (recovered and settled): still stale.
    await redis_client.delete(owner_key(delivery.pid))
    assert [r.outcome for r in await broker.commit([delivery])] == [Outcome.STALE]


async def test_each_item_of_a_grouped_settle_gets_its_own_result(redis_url, redis_client):
    broker = await new_broker(redis_url, max_attempts=3)
    try:
        await publish_new(redis_client, 5)
        await publish_new(redis_client, 1, attempts=2)  # its next reject is the last
        deliveries = (await broker.receive(10, 0)).deliveries
        commit, retry, release, stale, missing, last = deliveries
        await redis_client.set(owner_key(stale.pid), b"someone-else:9")
        await redis_client.delete(job_key(missing.pid))
        results = await broker.settle([
            Settlement(Action.COMMIT, commit),
            Settlement(Action.REJECT, retry, "boom"),
            Settlement(Action.RELEASE, release),
            Settlement(Action.COMMIT, stale),
            Settlement(Action.RELEASE, missing),
            Settlement(Action.REJECT, last, "boom"),
            Settlement(Action.COMMIT, commit),  # the same delivery again: no longer ours
        ])
        assert [r.outcome for r in results] == [
            Outcome.OK, Outcome.OK, Outcome.OK, Outcome.STALE, Outcome.MISSING, Outcome.OK,
            Outcome.STALE,
        ]
        # failed counts failed runs: the retry and the last reject.
        assert await counters(redis_client) == {
            "total": 6, "processing": 2, "success": 1, "failed": 2,
        }
        processing = await redis_client.lrange(f"{NS}.processing.{QUEUE}", 0, -1)
        assert sorted(processing) == sorted([stale.pid.encode(), missing.pid.encode()])
        # The missing release kept its ownership; the stale one is someone else's.
        assert await redis_client.get(owner_key(missing.pid)) == missing.receipt.encode()
        assert await redis_client.get(owner_key(stale.pid)) == b"someone-else:9"
        ready = await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1)
        assert ready[-1] == release.raw  # consumer end
        requeued = orjson.loads(ready[0])
        assert requeued["pid"] == retry.pid and requeued["attempts"] == 1
        assert await redis_client.lrange(f"{NS}.failed.{QUEUE}", 0, -1) == [last.pid.encode()]
        # Rejected as queue 5 rejects: the record kept as it was stored.
        assert await redis_client.get(job_key(last.pid)) == last.raw
        for gone in (commit, retry, release, last):
            assert await redis_client.exists(owner_key(gone.pid), claim_key(gone.pid)) == 0
        for gone in (commit, retry, release):
            assert await redis_client.exists(job_key(gone.pid)) == 0
    finally:
        await broker.close()


async def test_a_batch_of_commits_gets_the_shared_result_and_a_stale_one_its_own(
    redis_url, redis_client,
):
    broker = await new_broker(redis_url)
    try:
        await publish_new(redis_client, 3)
        first, stale, last = (await broker.receive(10, 0)).deliveries
        await redis_client.set(owner_key(stale.pid), b"someone-else:9")
        results = await broker.commit([first, stale, last])
        assert [r.outcome for r in results] == [Outcome.OK, Outcome.STALE, Outcome.OK]
        assert results[0] is APPLIED and results[2] is APPLIED
        results = await broker.commit([last, first])  # no longer ours: stale, each
        assert [r.outcome for r in results] == [Outcome.STALE, Outcome.STALE]
        await publish_new(redis_client, 2)
        both = (await broker.receive(10, 0)).deliveries
        assert await broker.commit(both) == [APPLIED, APPLIED]
        assert (await counters(redis_client))["success"] == 4
    finally:
        await broker.close()


@pytest.mark.parametrize("job_ttl", [0, 3600])
async def test_retry_policy_until_failed(redis_url, redis_client, job_ttl):
    broker = await new_broker(redis_url, max_attempts=3, job_ttl=job_ttl)
    try:
        [pid] = await publish_new(redis_client, 1)
        for expected_attempts in (0, 1, 2):
            [delivery] = (await broker.receive(10, 0)).deliveries
            assert delivery.pid == pid and delivery.attempts == expected_attempts
            assert await redis_client.ttl(job_key(pid)) == -1  # no TTL while processing
            assert [r.outcome for r in await broker.reject([delivery], ["boom"])] == [Outcome.OK]
        assert await lengths(redis_client) == {
            "queue": 0, "processing": 0, "failed": 1, "poison": 0,
        }
        assert await redis_client.lrange(f"{NS}.failed.{QUEUE}", 0, -1) == [pid.encode()]
        record = await redis_client.get(job_key(pid))
        assert orjson.loads(record)["attempts"] == 2  # as stored: queue 5's retry() adds 1
        ttl = await redis_client.ttl(job_key(pid))
        assert ttl == -1 if job_ttl == 0 else 0 < ttl <= job_ttl
        assert await redis_client.exists(owner_key(pid), claim_key(pid)) == 0
        assert await counters(redis_client) == {
            "total": 3, "processing": 0, "success": 0, "failed": 3,
        }
    finally:
        await broker.close()


async def test_release_returns_the_raw_envelope_to_the_consumer_end(broker, redis_client):
    pids = await publish_new(redis_client, 3, attempts=1)
    [first] = (await broker.receive(1, 0)).deliveries
    assert first.pid == pids[0]
    assert [r.outcome for r in await broker.release([first])] == [Outcome.OK]
    reservation = await broker.reserve(1, 0)
    assert reservation.payloads == [first.raw]  # first again, byte for byte
    [again] = (await broker.claim(reservation)).deliveries
    assert again.attempts == 1
    assert await counters(redis_client) == {
        "total": 2, "processing": 1, "success": 0, "failed": 0,
    }


async def test_release_of_several_keeps_their_order(broker, redis_client):
    pids = await publish_new(redis_client, 4)
    deliveries = (await broker.receive(3, 0)).deliveries
    await broker.release(deliveries)
    received = await broker.receive(10, 0)
    assert [d.pid for d in received.deliveries] == pids


async def test_settle_of_nothing(broker):
    assert await broker.settle([]) == []


# -- script-cache loss ----------------------------------------------------------------


async def test_script_cache_loss_loses_nothing(broker, redis_client):
    await publish_new(redis_client, 4)
    reservation = await broker.reserve(10, 0)
    await redis_client.script_flush()
    received = await broker.claim(reservation)
    assert len(received.deliveries) == 4
    await redis_client.script_flush()
    results = await broker.commit(received.deliveries[:2])
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.OK]
    await redis_client.script_flush()
    assert await broker.extend(received.deliveries) == [False, False, True, True]
    await redis_client.script_flush()
    assert (await broker.receive(10, 0)).deliveries == []
    assert await counters(redis_client) == {
        "total": 4, "processing": 2, "success": 2, "failed": 0,
    }
    assert await lengths(redis_client) == {
        "queue": 0, "processing": 2, "failed": 0, "poison": 0,
    }


# -- wrong types ----------------------------------------------------------------------


async def test_ready_list_as_hash_is_refused(broker, redis_client):
    await redis_client.hset(f"{NS}.queue.{QUEUE}", "field", "value")
    before = await snapshot(redis_client)
    with pytest.raises(WrongTypeError, match=r"queue\.stats-usage is hash"):
        await broker.receive(10, 0)
    with pytest.raises(WrongTypeError):
        await broker.receive(10, 0.1)
    assert await snapshot(redis_client) == before


async def test_processing_as_string_is_refused_by_claim_and_settle(broker, redis_client):
    await publish_new(redis_client, 3)
    [delivery] = (await broker.receive(1, 0)).deliveries
    reservation = await broker.reserve(10, 0)
    await redis_client.delete(f"{NS}.processing.{QUEUE}")
    await redis_client.set(f"{NS}.processing.{QUEUE}", "oops")
    before = await snapshot(redis_client)
    with pytest.raises(WrongTypeError, match=r"processing\.stats-usage is string, expected list"):
        await broker.claim(reservation)
    with pytest.raises(WrongTypeError):
        await broker.commit([delivery])
    assert await snapshot(redis_client) == before


@pytest.mark.parametrize("counter", ["total", "processing"])
async def test_non_integer_counter_is_refused_by_claim(broker, redis_client, counter):
    await publish_new(redis_client, 2)
    await publish(redis_client, b"garbage")
    reservation = await broker.reserve(10, 0)
    await redis_client.set(f"{NS}.stats.{QUEUE}.{counter}", "abc")
    before = await snapshot(redis_client)
    with pytest.raises(WrongTypeError, match='is "abc", expected an integer'):
        await broker.claim(reservation)
    assert await snapshot(redis_client) == before


@pytest.mark.parametrize("counter", ["processing", "success", "failed"])
async def test_non_integer_counter_is_refused_by_settle(broker, redis_client, counter):
    await publish_new(redis_client, 2)
    deliveries = (await broker.receive(10, 0)).deliveries
    await redis_client.set(f"{NS}.stats.{QUEUE}.{counter}", "abc")
    before = await snapshot(redis_client)
    with pytest.raises(WrongTypeError):
        await broker.settle([
            Settlement(Action.COMMIT, deliveries[0]), Settlement(Action.REJECT, deliveries[1]),
        ])
    assert await snapshot(redis_client) == before


async def test_a_wrong_typed_job_record_is_missing_for_its_item_alone(broker, redis_client):
    """A record of another type reads as absent (never a half-applied script): its release
    is refused as 'missing' with ownership kept, and the rest of the group applies."""
    await publish_new(redis_client, 2)
    first, second = (await broker.receive(10, 0)).deliveries
    await redis_client.delete(job_key(second.pid))
    await redis_client.rpush(job_key(second.pid), "not a record")
    results = await broker.settle([
        Settlement(Action.COMMIT, first), Settlement(Action.RELEASE, second),
    ])
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.MISSING]
    assert await redis_client.get(owner_key(second.pid)) == second.receipt.encode()
    assert await redis_client.lrange(job_key(second.pid), 0, -1) == [b"not a record"]
    assert await counters(redis_client) == {
        "total": 2, "processing": 1, "success": 1, "failed": 0,
    }


# -- bounded batches --------------------------------------------------------------------


@pytest.mark.slow
async def test_five_thousand_messages_in_bounded_calls(broker, redis_client):
    ready = f"{NS}.queue.{QUEUE}"
    published = []
    for start in range(0, 5000, 500):
        batch = [envelope.build(QUEUE, {"n": n}) for n in range(start, start + 500)]
        await redis_client.lpush(ready, *(raw for _, raw in batch))
        published += [pid for pid, _ in batch]
    calls = count_script_calls(broker)
    deliveries: list[Delivery] = []
    for max_messages in (1000, 1000, 700, 1000, 1000, 1000, 300):  # the interface's limit
        deliveries += (await broker.receive(max_messages, 0)).deliveries
    assert sorted(d.pid for d in deliveries) == sorted(published)
    # One token per reservation: the receipt (owner) of every delivery claimed from it.
    tokens = {d.receipt for d in deliveries}
    assert 5 <= len(tokens) <= 10
    assert all(len(t) == 32 and int(t, 16) >= 0 and t == t.lower() for t in tokens)
    assert await broker.extend(deliveries) == [True] * 5000
    results = await broker.commit(deliveries)
    assert [r.outcome for r in results] == [Outcome.OK] * 5000
    assert all(0 < size <= 1000 for name, size in calls)
    assert sum(size for name, size in calls if name == "claim") == 5000
    assert [size for name, size in calls if name == "settle"] == [1000] * 5
    assert [size for name, size in calls if name == "extend"] == [1000] * 5
    assert await counters(redis_client) == {
        "total": 5000, "processing": 0, "success": 5000, "failed": 0,
    }
    assert await lengths(redis_client) == {
        "queue": 0, "processing": 0, "failed": 0, "poison": 0,
    }


async def test_extend_with_nothing_outstanding_keeps_the_record(broker, redis_client):
    assert await broker.extend([]) == []
    assert (await redis_client.get(RECORD)).endswith(f" {__import__('os').getpid()}".encode())
    assert 0 < await redis_client.ttl(RECORD) <= 30
    await broker.abandon([])
    assert await redis_client.exists(RECORD) == 0


# -- connections ------------------------------------------------------------------------


async def test_connection_lost_during_settle_is_uncertain(own_redis_server):
    broker = await new_broker(own_redis_server.url)
    try:
        await publish_new(broker.client, 3)
        deliveries = (await broker.receive(10, 0)).deliveries
        own_redis_server.stop()
        results = await broker.settle([
            Settlement(Action.COMMIT, deliveries[0]),
            Settlement(Action.REJECT, deliveries[1], "boom"),
            Settlement(Action.RELEASE, deliveries[2]),
        ])
        assert [r.outcome for r in results] == [Outcome.UNCERTAIN] * 3
        assert all(r.detail for r in results)
        with pytest.raises(BrokerError):
            await broker.extend(deliveries)
        with pytest.raises(BrokerError):
            await broker.receive(10, 0)
    finally:
        await broker.close()


async def test_connect_failure_names_the_url_without_its_password(own_redis_server):
    port = own_redis_server.port
    own_redis_server.stop()
    broker = RedisBroker(f"redis://user:secret@127.0.0.1:{port}/0", QUEUE)
    with pytest.raises(BrokerError, match=f"127.0.0.1:{port}") as raised:
        await broker.connect()
    assert "secret" not in str(raised.value)
    await broker.close()


async def test_cluster_namespace_without_hash_tag_is_refused():
    broker = RedisBroker("redis://127.0.0.1:1/0", QUEUE, cluster=True)
    with pytest.raises(BrokerError, match="hash tag"):
        await broker.connect()


def test_helpers():
    assert has_hash_tag("{utopia-queue}") and has_hash_tag("app-{q}")
    assert not has_hash_tag("utopia-queue") and not has_hash_tag("{}x") and not has_hash_tag("}{")


async def test_cancelled_blocking_receive_loses_nothing(broker, redis_client):
    registry = f"{NS}.reservations.{QUEUE}"
    task = asyncio.create_task(broker.receive(10, 5))
    await until(lambda: _zcard(redis_client, registry, 1))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [pid] = await publish_new(redis_client, 1)
    # The message is either still ready or in the registered reservation (for maintenance).
    ready = await redis_client.llen(f"{NS}.queue.{QUEUE}")
    [(reservation, _)] = await redis_client.zrange(registry, 0, -1, withscores=True)
    assert ready + await redis_client.llen(reservation) == 1
    if ready:
        assert [d.pid for d in (await broker.receive(10, 1)).deliveries] == [pid]


@pytest.mark.slow
async def test_a_blocking_receive_cancelled_before_its_move_started_leaves_nothing_behind(
        broker, redis_client, monkeypatch):
    """Cancelled in the turn between making the blocking move's task and its first step:
    no move is sent, the reservation stays registered for maintenance, and no coroutine is
    left never awaited (a RuntimeWarning at garbage collection, seen in a CI run)."""
    loop = asyncio.get_running_loop()
    receiving = [asyncio.create_task(broker.receive(10, 5))]
    real = asyncio.ensure_future

    def cancel_first(awaitable, **kwargs):
        loop.call_soon(receiving[0].cancel)  # runs before the new task's first step
        monkeypatch.setattr(asyncio, "ensure_future", real)
        return real(awaitable, **kwargs)

    monkeypatch.setattr(asyncio, "ensure_future", cancel_first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            await receiving[0]
        except asyncio.CancelledError:
            pass
        else:
            pytest.fail("the receive was not cancelled")
        receiving.clear()  # the task, its traceback and its frames go, then are collected
        for _ in range(3):
            await asyncio.sleep(0)  # (what the loop still had to run for them)
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
    registry = f"{NS}.reservations.{QUEUE}"
    assert await redis_client.zcard(registry) == 1
    [pid] = await publish_new(redis_client, 1)
    assert [d.pid for d in (await broker.receive(10, 1)).deliveries] == [pid]


async def test_publish_and_maintain_are_delegated(broker, redis_client):
    first = await broker.publish(QUEUE, {"a": "b/c"})
    rest = await broker.publish_many(QUEUE, [{"n": 1}, {"n": 2}])
    received = await broker.receive(10, 0)
    assert [d.pid for d in received.deliveries] == [first, *rest]
    assert received.deliveries[0].payload == {"a": "b/c"}
    report = await broker.maintain()
    assert report.total == 0 and not report.skipped


async def test_settling_keeps_the_order_of_what_stays_in_processing(broker, redis_client):
    """Settled pids found near the tail are taken out by rewriting the tail: the rest keeps
    its order (the shared sweep cursor counts positions from the tail), duplicates included."""
    await publish_new(redis_client, 40)
    deliveries = (await broker.receive(40, 0)).deliveries
    processing = f"{NS}.processing.{QUEUE}"
    await redis_client.lpush(processing, deliveries[5].pid)  # a stray copy near the head
    await redis_client.rpush(processing, "foreign-1", deliveries[7].pid)  # and at the tail
    before = await redis_client.lrange(processing, 0, -1)
    chosen = [deliveries[i] for i in (0, 1, 7, 20, 39)]  # the oldest, a middle one, the newest
    assert [r.ok for r in await broker.commit(chosen)] == [True] * 5
    after = await redis_client.lrange(processing, 0, -1)
    expected = list(before)
    for delivery in chosen:  # one occurrence each, the one nearest the tail
        index = len(expected) - 1 - expected[::-1].index(delivery.pid.encode())
        del expected[index]
    assert after == expected


# -- a stop while a receive blocks on an idle queue -----------------------------------------


@pytest.mark.slow
async def test_stop_waiting_ends_a_blocked_receive_and_strands_nothing(redis_url, redis_client):
    """Whichever wins, the blocking move or the stop, the message ends received or back in
    the ready list; a move the server completes late is recovered by maintenance."""
    for attempt in range(30):
        broker = await new_broker(redis_url, consumer_id=f"stopper-{attempt}", lease=30)
        waiting = asyncio.ensure_future(broker.receive(10, 30))
        await asyncio.sleep(0.05)  # blocked in BLMOVE now
        [pid] = await publish_new(redis_client, 1)
        if attempt % 2:
            await asyncio.sleep(0.001 * (attempt % 5))  # sometimes the move wins
        began = time.monotonic()
        broker.stop_waiting()
        received = await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - began < 10  # not the 30 s the move would block
        ready = await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1)
        got = [d.pid for d in received.deliveries]
        if got:
            assert got == [pid] and ready == []
            await broker.settle([Settlement(Action.COMMIT, received.deliveries[0])])
        else:
            await broker.maintain(force=True)  # a late move into the expired reservation
            ready = await redis_client.lrange(f"{NS}.queue.{QUEUE}", 0, -1)
            assert [orjson.loads(raw)["pid"] for raw in ready] == [pid]
            await redis_client.delete(f"{NS}.queue.{QUEUE}")
        # Nothing is left registered or reserved: not even the abandoned reservation.
        await broker.maintain(force=True)
        assert await redis_client.zcard(f"{NS}.reservations.{QUEUE}") == 0
        assert (await broker.receive(10, 5)).deliveries == []  # no longer blocks
        await broker.close()
