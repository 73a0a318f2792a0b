"""Maintenance: recovery of expired reservations and abandoned processing entries.

States are written with plain Redis commands following the contract in ``broker.keys``
(what RedisBroker writes), then ``maintain()`` runs against a real redis-server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from broker import envelope
from broker.base import WrongTypeError
from broker.keys import QueueKeys
from broker.recovery import find_candidates, maintain, recover_candidates
from broker.scripts import Scripts

KEYS = QueueKeys("utopia-queue", "v1-stats-usage")
DAY = 86_400
AGE = 90_000


class CountingScripts(Scripts):
    """Scripts that remember every call: (name, number of items)."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.calls: list[tuple[str, int]] = []

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        items = len(args) // 3 if name == "recover_processing" else len(keys) - 2
        self.calls.append((name, items))
        return await super().call(name, keys, args)


async def run(client, scripts: Scripts | None = None, **options):
    options = {"consumer_id": "sweeper", "lease_ms": 30_000, "recovery_age": AGE, **options}
    return await maintain(client, scripts or Scripts(client), KEYS, **options)


async def server_ms(client) -> int:
    seconds, micros = await client.time()
    return seconds * 1000 + micros // 1000


async def server_s(client) -> int:
    return (await client.time())[0]


async def reserve(client, token: str, payloads: list[bytes], deadline_ms: int) -> str:
    key = KEYS.reservation(token)
    if payloads:
        await client.rpush(key, *payloads)
    await client.zadd(KEYS.reservations, {key: deadline_ms})
    return key


def record(pid: str, timestamp: int, attempts: int = 0) -> bytes:
    return envelope.encode({
        "pid": pid, "queue": KEYS.queue, "timestamp": timestamp, "payload": {"pid": pid},
        "attempts": attempts,
    })


async def deliver(client, consumer: str, pids: Sequence[str], timestamp: int) -> None:
    """Claimed deliveries as RedisBroker writes them: processing + job + owner + counter."""
    pipe = client.pipeline(transaction=False)
    for pid in pids:
        pipe.lpush(KEYS.processing, pid)
        pipe.set(KEYS.job(pid), record(pid, timestamp, attempts=2))
        pipe.set(KEYS.owner(pid), f"{consumer}:nonce-{pid}")
        pipe.incr(KEYS.stat("processing"))
    await pipe.execute()


async def deliver_legacy(client, pids: Sequence[str], timestamp: int) -> None:
    """Deliveries of a PHP consumer: processing + job + counter, no owner."""
    pipe = client.pipeline(transaction=False)
    for pid in pids:
        pipe.lpush(KEYS.processing, pid)
        pipe.set(KEYS.job(pid), record(pid, timestamp))
        pipe.incr(KEYS.stat("processing"))
    await pipe.execute()


async def beat(client, consumer: str) -> None:
    await client.set(KEYS.consumer(consumer), "1", px=60_000)


async def taken_order(client) -> list[bytes]:
    """The ready list in the order consumers take it (from the right)."""
    return list(reversed(await client.lrange(KEYS.ready, 0, -1)))


def pids_of(raws: Sequence[bytes]) -> list[str]:
    return [orjson.loads(raw)["pid"] for raw in raws]


# --- expired reservations -------------------------------------------------------------


async def test_reservation_left_by_a_death_after_the_blocking_move(redis_client):
    await redis_client.lpush(KEYS.ready, b"newer")
    deadline = await server_ms(redis_client) + 2000
    key = await reserve(redis_client, "t1", [b"moved"], deadline)

    early = await run(redis_client)
    assert early.expired_reservations == 0
    assert await redis_client.zcard(KEYS.reservations) == 1

    while await server_ms(redis_client) <= deadline:
        await asyncio.sleep(0.05)
    report = await run(redis_client)
    assert report.expired_reservations == 1
    assert await taken_order(redis_client) == [b"moved", b"newer"]
    assert await redis_client.zcard(KEYS.reservations) == 0
    assert await redis_client.exists(key) == 0


async def test_payloads_return_in_the_order_they_were_taken(redis_client):
    await redis_client.lpush(KEYS.ready, b"later")
    await reserve(redis_client, "t1", [b"p1", b"p2", b"p3"], await server_ms(redis_client) - 1)
    assert (await run(redis_client)).expired_reservations == 3
    assert await taken_order(redis_client) == [b"p1", b"p2", b"p3", b"later"]


async def test_stale_candidates_are_rechecked_by_the_script(redis_client):
    past = await server_ms(redis_client) - 1000
    renewed = await reserve(redis_client, "renewed", [b"r"], past)
    claimed = await reserve(redis_client, "claimed", [b"c"], past)
    expired = await reserve(redis_client, "expired", [b"e"], past)
    found = await redis_client.zrangebyscore(KEYS.reservations, "-inf", past + 1)
    assert len(found) == 3
    unregistered = KEYS.reservation("unregistered")  # a list that is not registered (any more)
    await redis_client.rpush(unregistered, b"u")

    # Meanwhile: one consumer renews its reservation, another claims its own.
    await redis_client.zadd(KEYS.reservations, {renewed: await server_ms(redis_client) + 60_000})
    await redis_client.delete(claimed)
    await redis_client.zrem(KEYS.reservations, claimed)

    moved, done = await Scripts(redis_client).call(
        "recover_reservations", [KEYS.ready, KEYS.reservations, *found, unregistered], [1000]
    )
    assert (moved, done) == (1, 1)
    assert await taken_order(redis_client) == [b"e"]
    assert await redis_client.exists(expired) == 0
    assert await redis_client.lrange(renewed, 0, -1) == [b"r"]
    assert await redis_client.zscore(KEYS.reservations, renewed) > past
    assert await redis_client.lrange(unregistered, 0, -1) == [b"u"]
    assert await redis_client.zcard(KEYS.reservations) == 1


async def test_an_empty_expired_reservation_is_just_unregistered(redis_client):
    await reserve(redis_client, "empty", [], await server_ms(redis_client) - 1)
    report = await run(redis_client)
    assert report.expired_reservations == 0
    assert await redis_client.zcard(KEYS.reservations) == 0


async def test_one_script_call_moves_at_most_max_items(redis_client):
    past = await server_ms(redis_client) - 1
    found = [
        await reserve(redis_client, f"t{i}", [f"{i}-{j}".encode() for j in range(600)], past)
        for i in range(3)
    ]
    scripts = Scripts(redis_client)
    keys = [KEYS.ready, KEYS.reservations, *found]
    assert await scripts.call("recover_reservations", keys, [1000]) == [600, 1]
    # The first reservation always goes, even when it alone is above the bound.
    assert await scripts.call("recover_reservations", keys, [100]) == [600, 1]
    assert await redis_client.llen(KEYS.ready) == 1200


async def test_maintain_recovers_many_reservations_in_bounded_calls(redis_client):
    past = await server_ms(redis_client) - 1
    for i in range(250):
        await reserve(redis_client, f"t{i}", [f"{i}-a".encode(), f"{i}-b".encode()], past)
    scripts = CountingScripts(redis_client)
    report = await run(redis_client, scripts, batch=100)
    assert report.expired_reservations == 500
    calls = [items for name, items in scripts.calls if name == "recover_reservations"]
    assert all(items <= 100 for items in calls)
    assert await redis_client.zcard(KEYS.reservations) == 0


# --- processing entries ---------------------------------------------------------------


async def test_deliveries_of_a_dead_consumer_are_requeued(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, "dead-1", ["d1", "d2", "d3"], now)
    await deliver(redis_client, "live-1", ["l1", "l2"], now)
    await beat(redis_client, "live-1")

    report = await run(redis_client)
    assert (report.dead_consumers, report.legacy, report.expired_reservations) == (3, 0, 0)
    ready = await taken_order(redis_client)
    assert pids_of(ready) == ["d1", "d2", "d3"]  # the oldest delivery is taken first
    assert all(orjson.loads(raw)["attempts"] == 2 for raw in ready)  # unchanged
    for pid in ("d1", "d2", "d3"):
        assert await redis_client.exists(KEYS.owner(pid), KEYS.job(pid)) == 0
    assert sorted(await redis_client.lrange(KEYS.processing, 0, -1)) == [b"l1", b"l2"]
    assert await redis_client.get(KEYS.stat("processing")) == b"2"
    for pid in ("l1", "l2"):
        assert await redis_client.exists(KEYS.owner(pid), KEYS.job(pid)) == 2

    again = await run(redis_client)
    assert again.total == 0


async def test_an_owner_rewritten_or_revived_after_the_scan_is_untouched(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, "dead-1", ["redelivered", "revived", "gone"], now)
    candidates = await find_candidates(
        redis_client, KEYS, ["redelivered", "revived", "gone"], now=now, recovery_age=AGE
    )
    assert [c.pid for c in candidates] == ["redelivered", "revived", "gone"]

    # Between the scan and the script: one pid is re-delivered to someone else, and the
    # owner of another turns out alive after all (its heartbeat key is back).
    await redis_client.set(KEYS.owner("redelivered"), "other-1:nonce")
    await beat(redis_client, "other-1")
    revived = next(c for c in candidates if c.pid == "revived")
    statuses = await recover_candidates(
        Scripts(redis_client), KEYS, [c for c in candidates if c.pid != "revived"],
        placeholder="sweeper",
    )
    assert statuses == ["skip", "ok"]
    await beat(redis_client, "dead-1")
    assert await recover_candidates(
        Scripts(redis_client), KEYS, [revived], placeholder="sweeper"
    ) == ["skip"]
    assert await redis_client.get(KEYS.owner("redelivered")) == b"other-1:nonce"
    assert await redis_client.exists(KEYS.job("redelivered"), KEYS.job("revived")) == 2
    assert pids_of(await taken_order(redis_client)) == ["gone"]
    assert await redis_client.get(KEYS.stat("processing")) == b"2"


async def test_a_delivery_settled_after_the_scan_is_untouched(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, "dead-1", ["p1"], now)
    candidates = await find_candidates(redis_client, KEYS, ["p1"], now=now, recovery_age=AGE)
    # The consumer committed it just before its heartbeat expired.
    await redis_client.delete(KEYS.job("p1"), KEYS.owner("p1"))
    await redis_client.lrem(KEYS.processing, 1, "p1")
    await redis_client.decr(KEYS.stat("processing"))
    statuses = await recover_candidates(Scripts(redis_client), KEYS, candidates,
                                        placeholder="sweeper")
    assert statuses == ["skip"]
    assert await redis_client.llen(KEYS.ready) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"0"


async def test_legacy_entries_are_recovered_only_past_the_age(redis_client):
    now = await server_s(redis_client)
    await deliver_legacy(redis_client, ["old"], now - AGE - 10)
    await deliver_legacy(redis_client, ["young"], now - AGE + 600)
    report = await run(redis_client)
    assert (report.legacy, report.dead_consumers) == (1, 0)
    assert pids_of(await taken_order(redis_client)) == ["old"]
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"young"]
    assert await redis_client.exists(KEYS.job("old")) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"1"


async def test_legacy_entries_without_a_readable_record(redis_client):
    now = await server_s(redis_client)
    old_pid = f"{now - 2 * DAY:08x}00000{1.5:.8f}"
    fresh_pid = f"{now:08x}00000{1.5:.8f}"
    await redis_client.lpush(KEYS.processing, "garbled", old_pid, fresh_pid)
    await redis_client.set(KEYS.job("garbled"), b"{not json")  # undecodable: taken as old
    await redis_client.set(KEYS.stat("processing"), 3)

    report = await run(redis_client)
    assert report.legacy == 1
    assert await taken_order(redis_client) == [b"{not json"]
    # The old pid without a record was dangling: removed. The fresh one may be a PHP
    # commit in progress (job deleted, pid not yet): left alone.
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [fresh_pid.encode()]
    assert await redis_client.get(KEYS.stat("processing")) == b"1"


async def test_a_legacy_entry_that_gained_an_owner_is_untouched(redis_client):
    now = await server_s(redis_client)
    await deliver_legacy(redis_client, ["p1"], now - AGE - 10)
    candidates = await find_candidates(redis_client, KEYS, ["p1"], now=now, recovery_age=AGE)
    await redis_client.set(KEYS.owner("p1"), "someone:nonce")
    assert await recover_candidates(Scripts(redis_client), KEYS, candidates,
                                    placeholder="sweeper") == ["skip"]
    assert await redis_client.llen(KEYS.processing) == 1


async def test_work_is_bounded_and_a_long_history_is_swept_by_the_cursor(redis_client):
    now = await server_s(redis_client)
    dead = [f"dead-{i}" for i in range(5000)]
    await deliver(redis_client, "dead-1", dead, now)  # oldest: at the tail
    await deliver_legacy(redis_client, [f"young-{i}" for i in range(20_000)], now - 60)
    scripts = CountingScripts(redis_client)

    calls = 0
    while await redis_client.llen(KEYS.processing) > 20_000:
        calls += 1
        assert calls <= 10, "the cursor does not make progress"
        report = await run(redis_client, scripts, batch=1000)
        assert report.total <= 1000
    recovered = [items for name, items in scripts.calls if name == "recover_processing"]
    assert all(items <= 1000 for items in recovered)
    assert calls == 5
    assert sorted(pids_of(await redis_client.lrange(KEYS.ready, 0, -1))) == sorted(dead)
    assert await redis_client.get(KEYS.stat("processing")) == b"20000"


async def test_the_cursor_wraps_and_finds_old_entries_anywhere(redis_client):
    now = await server_s(redis_client)
    old = []
    for i in range(3000):  # every third entry is past the age
        if i % 3 == 0:
            old.append(f"old-{i}")
            await deliver_legacy(redis_client, [old[-1]], now - AGE - 1)
        else:
            await deliver_legacy(redis_client, [f"young-{i}"], now)
    await redis_client.set(KEYS.reap_cursor, 2400)  # somewhere in the middle: must wrap

    calls = 0
    while await redis_client.llen(KEYS.ready) < len(old):
        calls += 1
        assert calls <= 2 * 3000 // 200 + 2
        report = await run(redis_client, batch=200)
        assert report.legacy <= 2 * 200
    assert sorted(pids_of(await redis_client.lrange(KEYS.ready, 0, -1))) == sorted(old)
    assert await redis_client.llen(KEYS.processing) == 2000


# --- lock, errors, script cache -------------------------------------------------------


async def test_of_two_concurrent_sweeps_one_does_the_work(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, "dead-1", [f"p{i}" for i in range(50)], now)
    first, second = await asyncio.gather(
        run(redis_client, consumer_id="a"), run(redis_client, consumer_id="b")
    )
    assert sorted([first.skipped, second.skipped]) == [False, True]
    assert first.total + second.total == 50
    assert await redis_client.llen(KEYS.ready) == 50
    assert await redis_client.exists(KEYS.reap_lock) == 0  # released
    assert not (await run(redis_client)).skipped


async def test_a_held_lock_skips_the_sweep(redis_client):
    await deliver(redis_client, "dead-1", ["p1"], await server_s(redis_client))
    await redis_client.set(KEYS.reap_lock, "other:nonce", px=60_000)
    report = await run(redis_client)
    assert report.skipped and report.total == 0
    assert await redis_client.llen(KEYS.processing) == 1
    assert await redis_client.get(KEYS.reap_lock) == b"other:nonce"


async def test_a_wrong_typed_ready_list_changes_nothing(redis_client):
    await redis_client.set(KEYS.ready, "not a list")
    key = await reserve(redis_client, "t1", [b"p"], await server_ms(redis_client) - 1)
    with pytest.raises(WrongTypeError, match="queue"):
        await run(redis_client)
    assert await redis_client.lrange(key, 0, -1) == [b"p"]
    assert await redis_client.zcard(KEYS.reservations) == 1
    assert await redis_client.exists(KEYS.reap_lock) == 0


async def test_a_non_integer_counter_changes_nothing(redis_client):
    await deliver(redis_client, "dead-1", ["p1", "p2"], await server_s(redis_client))
    await redis_client.set(KEYS.stat("processing"), "many")
    with pytest.raises(WrongTypeError, match="integer"):
        await run(redis_client)
    assert await redis_client.llen(KEYS.processing) == 2
    assert await redis_client.exists(KEYS.owner("p1"), KEYS.job("p1")) == 2
    assert await redis_client.llen(KEYS.ready) == 0


async def test_a_wrong_typed_processing_list_is_reported(redis_client):
    await redis_client.hset(KEYS.processing, "pid", "x")
    with pytest.raises(WrongTypeError):
        await run(redis_client)
    assert await redis_client.type(KEYS.processing) == b"hash"


async def test_a_wrong_typed_job_record_changes_nothing(redis_client):
    await deliver(redis_client, "dead-1", ["p1", "p2"], await server_s(redis_client))
    await redis_client.delete(KEYS.job("p2"))
    await redis_client.rpush(KEYS.job("p2"), "x")
    with pytest.raises(WrongTypeError, match="jobs"):
        await run(redis_client)
    assert await redis_client.llen(KEYS.processing) == 2
    assert await redis_client.exists(KEYS.owner("p1"), KEYS.job("p1")) == 2


async def test_maintain_survives_the_loss_of_the_script_cache(redis_client, redis_server):
    now = await server_s(redis_client)
    scripts = Scripts(redis_client)
    await deliver(redis_client, "dead-1", ["p1"], now)
    assert (await run(redis_client, scripts)).dead_consumers == 1

    redis_server.cli("SCRIPT", "FLUSH")
    await deliver(redis_client, "dead-2", ["p2"], now)
    await reserve(redis_client, "t1", [b"r"], await server_ms(redis_client) - 1)
    report = await run(redis_client, scripts)
    assert (report.dead_consumers, report.expired_reservations) == (1, 1)
    assert await redis_client.llen(KEYS.processing) == 0


# --- end to end through RedisBroker ---------------------------------------------------


@pytest.fixture
async def brokers(redis_url):
    """Two consumers of one queue, ``a`` and ``b``, each with a 1 s lease."""
    from broker.redis import RedisBroker

    pair = [
        RedisBroker(redis_url, KEYS.queue, namespace=KEYS.namespace, consumer_id=name,
                    lease=1.0)
        for name in ("a", "b")
    ]
    for broker in pair:
        await broker.connect()
    yield pair
    for broker in pair:
        await broker.close()


async def wait_until_expired(client, reservation: str) -> None:
    deadline = await client.zscore(KEYS.reservations, reservation)
    assert deadline is not None
    while await server_ms(client) <= deadline:
        await asyncio.sleep(0.05)


async def test_e2e_a_reservation_never_claimed_is_returned_in_order(brokers, redis_client):
    a, b = brokers
    pids = await a.publish_many(KEYS.queue, [{"i": i} for i in range(5)])
    reservation = await a.reserve(3, 0)  # ... and a dies before claiming
    assert len(reservation.payloads) == 3

    assert (await b.maintain()).expired_reservations == 0
    await wait_until_expired(redis_client, reservation.key)
    assert (await b.maintain()).expired_reservations == 3
    late = await a.claim(reservation)  # a late claim finds the reservation gone
    assert late.deliveries == [] and late.poisoned == []

    received = await b.receive(10, 0)
    assert [d.pid for d in received.deliveries] == pids
    assert await redis_client.zcard(KEYS.reservations) == 0


async def test_e2e_death_after_the_blocking_move(brokers, redis_client, monkeypatch):
    import broker.redis

    monkeypatch.setattr(broker.redis, "BLOCK_MARGIN", 0.5)
    a, b = brokers
    blocked = asyncio.create_task(a.reserve(10, 1.0))
    while not await redis_client.zcard(KEYS.reservations):  # registered before the move
        await asyncio.sleep(0.01)
    [pid] = await b.publish_many(KEYS.queue, [{"late": True}])
    reservation = await blocked  # moved, and a dies before claiming
    assert len(reservation.payloads) == 1

    await wait_until_expired(redis_client, reservation.key)
    assert (await b.maintain()).expired_reservations == 1
    [delivery] = (await b.receive(10, 0)).deliveries
    assert (delivery.pid, delivery.payload) == (pid, {"late": True})


async def test_e2e_a_dead_consumers_deliveries_go_to_the_living(brokers, redis_client):
    a, b = brokers
    pids = await a.publish_many(KEYS.queue, [{"i": i} for i in range(4)])
    taken = (await a.receive(10, 0)).deliveries
    assert [d.pid for d in taken] == pids
    assert (await b.maintain()).total == 0  # a is alive

    await redis_client.delete(KEYS.consumer("a"))  # a's lease ran out
    report = await b.maintain()
    assert report.dead_consumers == 4
    assert await redis_client.get(KEYS.stat("processing")) == b"0"

    # a comes back: it owns nothing any more and cannot settle what it had.
    assert await a.extend(taken) == [False] * 4
    assert [r.outcome for r in await a.commit(taken)] == ["stale"] * 4

    again = (await b.receive(10, 0)).deliveries
    assert sorted(d.pid for d in again) == sorted(pids)
    assert all(d.attempts == 0 for d in again)
    assert [r.ok for r in await b.commit(again)] == [True] * 4
    assert await redis_client.llen(KEYS.processing) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"0"


async def test_e2e_deliveries_settled_by_their_owner_are_not_recovered(brokers, redis_client):
    a, b = brokers
    await a.publish_many(KEYS.queue, [{"i": i} for i in range(3)])
    taken = (await a.receive(10, 0)).deliveries
    assert [r.ok for r in await a.commit(taken)] == [True] * 3
    await redis_client.delete(KEYS.consumer("a"))
    assert (await b.maintain()).total == 0
    assert await redis_client.llen(KEYS.ready) == 0
