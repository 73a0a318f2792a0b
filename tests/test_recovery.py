"""Maintenance: recovery of expired reservations and abandoned processing entries.

States are written with plain Redis commands following the contract in ``broker.redis.keys``
(queue 5's layout, which RedisBroker and PHP queue-5 workers both write), then
``maintain()`` runs against a real redis-server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from broker import envelope
from broker.base import WrongTypeError
from broker.redis.keys import QueueKeys
from broker.redis.recovery import RESERVATION_GRACE, maintain, parse_cursor
from broker.redis.scripts import Scripts
from support import waiting

KEYS = QueueKeys("utopia-queue", "v1-stats-usage")
AGE = 90_000
#: An owner token (32 lowercase hex, as queue 5's) of a supervisor of ours that is gone: its
#: prefix is in the token registry (see ``run``), its record is not.
GONE_PREFIX = "0123456789abcdef"
TOKEN = GONE_PREFIX + "0123456789abcdef"


class CountingScripts(Scripts):
    """Scripts that remember every call: (name, number of items)."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.calls: list[tuple[str, int]] = []

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        items = (len(keys) - 4) // 4 if name == "reclaim" else len(keys) - 2
        self.calls.append((name, items))
        return await super().call(name, keys, args)


async def register(client, prefix: str, consumer: str, *, alive: bool) -> None:
    """A supervisor of ours in the token registry, as extend.lua writes it; ``alive``: its
    record exists."""
    until = (await server_s(client)) + 30
    await client.hset(KEYS.supervisor_tokens, prefix, f"{until} {consumer}")
    if alive:
        await client.set(KEYS.supervisor(consumer), "host 1", ex=30)


async def run(client, scripts: Scripts | None = None, **options):
    """One sweep, as if the fleet's sweep interval had passed (the lock is never released);
    TOKEN's supervisor is registered and gone."""
    await client.delete(KEYS.reap_lock)
    await register(client, GONE_PREFIX, "gone-1", alive=False)
    options = {"lock_seconds": 60, "recovery_age": AGE, "max_attempts": 3, **options}
    return await maintain(client, scripts or Scripts(client), KEYS, **options)


async def server_s(client) -> int:
    return (await client.time())[0]


async def server_s_past(client, deadline: float) -> bool:
    """Whether the server's clock (whole seconds) reached ``deadline``."""
    return await server_s(client) >= deadline


async def reserve(client, token: str, payloads: list[bytes], deadline: int) -> str:
    """A reservation as reserve.lua (and queue 5) leaves it: the last taken at the head."""
    key = KEYS.reservation(token)
    for payload in payloads:
        await client.lpush(key, payload)
    await client.zadd(KEYS.reservations, {key: deadline})
    return key


def record(pid: str, timestamp: int, attempts: int = 0, **extra: Any) -> bytes:
    return envelope.encode({
        "pid": pid, "queue": KEYS.queue, "timestamp": timestamp, "payload": {"pid": pid},
        "attempts": attempts, **extra,
    })


async def deliver(
    client, pids: Sequence[str], timestamp: int, *, token: str = TOKEN, live: bool = False,
    attempts: int = 0, owner: bool = True,
) -> None:
    """Claimed deliveries as claim.lua writes them; ``live``: with a claim (lease) key."""
    pipe = client.pipeline(transaction=False)
    for pid in pids:
        pipe.lpush(KEYS.processing, pid)
        pipe.set(KEYS.job(pid), record(pid, timestamp, attempts))
        if owner:
            pipe.set(KEYS.owner(pid), token)
        if live:
            pipe.set(KEYS.claim(pid), token, ex=90)
        pipe.incr(KEYS.stat("processing"))
    await pipe.execute()


async def taken_order(client) -> list[bytes]:
    """The ready list in the order consumers take it (from the right)."""
    return list(reversed(await client.lrange(KEYS.ready, 0, -1)))


def pids_of(raws: Sequence[bytes]) -> list[str]:
    return [orjson.loads(raw)["pid"] for raw in raws]


# --- expired reservations -------------------------------------------------------------


@pytest.mark.slow
async def test_a_reservation_is_returned_once_its_deadline_in_seconds_passed(redis_client):
    await redis_client.lpush(KEYS.ready, b"newer")
    now = await server_s(redis_client)
    key = await reserve(redis_client, "t1", [b"p1", b"p2"], now + 2)

    assert (await run(redis_client)).expired_reservations == 0
    assert await redis_client.zcard(KEYS.reservations) == 1
    await waiting.until(lambda: server_s_past(redis_client, now + 2), 10, "the deadline to pass")
    assert (await run(redis_client)).expired_reservations == 2
    assert await taken_order(redis_client) == [b"p1", b"p2", b"newer"]
    assert await redis_client.zcard(KEYS.reservations) == 0
    assert await redis_client.exists(key) == 0


async def test_deadlines_are_rechecked_by_the_script(redis_client):
    past = await server_s(redis_client) - 10
    renewed = await reserve(redis_client, "renewed", [b"r"], past)
    claimed = await reserve(redis_client, "claimed", [b"c"], past)
    expired = await reserve(redis_client, "expired", [b"e"], past)
    found = await Scripts(redis_client).call("expired", [KEYS.reservations], [1000])
    assert len(found) == 3
    unregistered = KEYS.reservation("unregistered")  # a list no registry names
    await redis_client.rpush(unregistered, b"u")

    # Meanwhile: one reservation gets a later deadline, another is claimed.
    await redis_client.zadd(KEYS.reservations, {renewed: past + 3600})
    await redis_client.delete(claimed)
    await redis_client.zrem(KEYS.reservations, claimed)

    keys = [KEYS.reservations, KEYS.ready, *map(bytes.decode, found), unregistered]
    assert await Scripts(redis_client).call("recover", keys, [1000]) == [1, 0]
    assert await taken_order(redis_client) == [b"e"]
    assert await redis_client.exists(expired) == 0
    assert await redis_client.lrange(renewed, 0, -1) == [b"r"]
    assert await redis_client.lrange(unregistered, 0, -1) == [b"u"]


async def test_an_empty_expired_reservation_is_unregistered_after_its_grace(redis_client):
    """Until then a late blocking move may still land in it (issue 23.3)."""
    now = await server_s(redis_client)
    await reserve(redis_client, "empty", [], now - 1)
    await reserve(redis_client, "old", [], now - RESERVATION_GRACE - 1)
    assert (await run(redis_client)).expired_reservations == 0
    assert await redis_client.zrange(KEYS.reservations, 0, -1) == [
        KEYS.reservation("empty").encode()]
    await run(redis_client, force=True)  # an operator's sweep: no grace, as queue 5's
    assert await redis_client.zcard(KEYS.reservations) == 0


async def test_one_recover_call_moves_at_most_its_limit(redis_client):
    past = await server_s(redis_client) - 1
    found = [
        await reserve(redis_client, f"t{i}", [f"{i}-{j}".encode() for j in range(600)], past)
        for i in range(3)
    ]
    scripts = Scripts(redis_client)
    assert await scripts.call("recover", [KEYS.reservations, KEYS.ready, *found],
                              [1000]) == [1000, 2]
    # The one cut short stays registered (and expired) for the next call.
    assert await redis_client.zcard(KEYS.reservations) == 2
    assert (await run(redis_client)).expired_reservations == 800
    assert await redis_client.zcard(KEYS.reservations) == 0
    assert await redis_client.llen(KEYS.ready) == 1800


async def test_many_reservations_over_bounded_rounds(redis_client):
    past = await server_s(redis_client) - 1
    for i in range(1500):
        await reserve(redis_client, f"t{i}", [f"{i}-a".encode()], past)
    scripts = CountingScripts(redis_client)
    assert (await run(redis_client, scripts)).expired_reservations == 1500
    assert all(items <= 1000 for name, items in scripts.calls if name == "recover")
    assert await redis_client.zcard(KEYS.reservations) == 0


async def test_a_previous_format_reservation_in_ms_is_recovered_once_expired(redis_client):
    seconds, micros = await redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    old = await reserve(redis_client, "old", [b"o"], now_ms - 1)
    future = await reserve(redis_client, "future", [b"f"], now_ms + 3_600_000)
    assert (await run(redis_client)).expired_reservations == 1
    assert await taken_order(redis_client) == [b"o"]
    assert await redis_client.exists(old) == 0
    assert await redis_client.zscore(KEYS.reservations, future) is not None


# --- processing entries ---------------------------------------------------------------


async def test_a_delivery_whose_claim_lapsed_is_requeued_with_attempts_plus_one(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["d1", "d2"], now - 5, attempts=1)
    await deliver(redis_client, ["l1"], now - 5, token="f" * 32, live=True)
    report = await run(redis_client)
    assert report.dead_consumers == 2
    requeued = [orjson.loads(raw) for raw in await redis_client.lrange(KEYS.ready, 0, -1)]
    assert sorted(e["pid"] for e in requeued) == ["d1", "d2"]  # the same pids
    assert all(e["attempts"] == 2 and e["timestamp"] >= now for e in requeued)
    assert all(e["payload"] == {"pid": e["pid"]} for e in requeued)
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"l1"]
    for pid in ("d1", "d2"):
        assert await redis_client.exists(KEYS.job(pid), KEYS.owner(pid), KEYS.claim(pid)) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"1"
    # The live one (a PHP worker's token, renewed) is untouched.
    assert await redis_client.get(KEYS.owner("l1")) == b"f" * 32


async def test_at_max_attempts_a_lapsed_delivery_goes_to_dead(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["x"], now, attempts=2)
    keyed = record("k", now, 2, key="user:1")
    await redis_client.lpush(KEYS.processing, "k")
    await redis_client.set(KEYS.job("k"), keyed)
    await redis_client.set(KEYS.owner("k"), TOKEN)
    await redis_client.set(KEYS.pending("user:1"), "k", ex=86400)
    await redis_client.set(KEYS.stat("processing"), 2)
    report = await run(redis_client, max_attempts=3, job_ttl=3600)
    assert report.dead_consumers == 2
    assert sorted(await redis_client.lrange(KEYS.dead, 0, -1)) == [b"k", b"x"]
    assert await redis_client.get(KEYS.job("k")) == keyed  # kept as stored
    assert 0 < await redis_client.ttl(KEYS.job("x")) <= 3600
    assert await redis_client.exists(KEYS.pending("user:1")) == 0  # the marker is freed
    assert await redis_client.llen(KEYS.ready) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"0"


async def test_a_requeued_keyed_message_keeps_its_marker(redis_client):
    now = await server_s(redis_client)
    await redis_client.lpush(KEYS.processing, "k")
    await redis_client.set(KEYS.job("k"), record("k", now, 0, key="user:1"))
    await redis_client.set(KEYS.owner("k"), TOKEN)
    await redis_client.set(KEYS.pending("user:1"), "k", ex=86400)
    assert (await run(redis_client)).dead_consumers == 1
    [requeued] = await redis_client.lrange(KEYS.ready, 0, -1)
    assert orjson.loads(requeued)["key"] == "user:1"
    assert await redis_client.get(KEYS.pending("user:1")) == b"k"  # still pending: same pid


async def test_live_claims_are_never_recovered_whatever_their_age(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["php"], now - 2 * AGE, token="a" * 32, live=True)
    await deliver(redis_client, ["ours"], now, live=True)
    assert (await run(redis_client)).total == 0
    assert await redis_client.llen(KEYS.processing) == 2


async def test_owner_less_entries_are_recovered_only_past_the_age(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["old"], now - AGE - 10, owner=False)
    await deliver(redis_client, ["young"], now - AGE + 60, owner=False)
    report = await run(redis_client)
    assert report.legacy == 1
    assert pids_of(await redis_client.lrange(KEYS.ready, 0, -1)) == ["old"]
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"young"]


async def test_dangling_and_inconsistent_entries(redis_client):
    now = await server_s(redis_client)
    await redis_client.lpush(KEYS.processing, "dangling", "owned-no-record")
    await redis_client.set(KEYS.owner("owned-no-record"), TOKEN)
    await redis_client.lpush(KEYS.processing, "unreadable")
    await redis_client.set(KEYS.job("unreadable"), b"\x00 not json")
    await redis_client.set(KEYS.owner("unreadable"), TOKEN)
    await run(redis_client)
    # A pid with neither record nor owner goes; one with an owner but no record is left
    # alone (and logged); an unreadable record is kept in dead, never requeued.
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"owned-no-record"]
    assert await redis_client.lrange(KEYS.dead, 0, -1) == [b"unreadable"]
    assert await redis_client.get(KEYS.job("unreadable")) == b"\x00 not json"
    del now


async def test_changes_after_the_read_are_rechecked_by_the_script(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["renewed", "reowned", "settled"], now)
    from broker.redis import recovery

    original = recovery._read_state

    async def then_things_change(client, scripts, keys, pids, **options):
        state = await original(client, scripts, keys, pids, **options)
        await client.set(KEYS.claim("renewed"), TOKEN, ex=90)  # its owner renewed it
        await client.set(KEYS.owner("reowned"), "b" * 32)  # recovered and re-delivered
        await client.lrem(KEYS.processing, 1, "settled")  # settled by its owner
        await client.delete(KEYS.job("settled"), KEYS.owner("settled"))
        return state

    recovery._read_state = then_things_change
    try:
        report = await run(redis_client)
    finally:
        recovery._read_state = original
    assert report.total == 0
    assert await redis_client.llen(KEYS.ready) == 0
    assert sorted(await redis_client.lrange(KEYS.processing, 0, -1)) == [b"renewed", b"reowned"]


# --- the shared cursor and bounded work -------------------------------------------------


async def test_the_cursor_is_queue_5s_and_sweeps_a_long_history(redis_client):
    now = await server_s(redis_client)
    lapsed = [f"lapsed-{i}" for i in range(2500)]
    await deliver(redis_client, lapsed, now)  # oldest: at the tail
    await deliver(redis_client, [f"live-{i}" for i in range(3000)], now, live=True)
    scripts = CountingScripts(redis_client)
    cursors = []
    for _ in range(3):
        report = await run(redis_client, scripts, scan=1000)
        assert report.total <= 1000
        cursors.append(parse_cursor(await redis_client.get(KEYS.reap_cursor)))
    # queue 5's arithmetic: each window spends `remaining`; recovered entries leave the list.
    assert cursors == [(0, 4500), (0, 3500), (500, 2500)]
    assert sorted(pids_of(await redis_client.lrange(KEYS.ready, 0, -1))) == sorted(lapsed)
    assert all(items <= 1000 for name, items in scripts.calls if name == "reclaim")
    for _ in range(3):  # the live ones: retained, cursor moves on, wraps at the end
        await run(redis_client, scripts, scan=1000)
        cursors.append(parse_cursor(await redis_client.get(KEYS.reap_cursor)))
    assert cursors[3:] == [(1500, 1500), (2500, 500), (3000, 0)]
    assert await redis_client.get(KEYS.stat("processing")) == b"3000"


async def test_a_cursor_in_another_format_is_reset(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["a", "b"], now, live=True)
    for stored in (b"17", b"junk", b"-5:3", b"9:9"):
        await redis_client.set(KEYS.reap_cursor, stored)
        await run(redis_client)
        assert await redis_client.get(KEYS.reap_cursor) == b"2:0"


@pytest.mark.slow
async def test_recovery_work_per_script_call_is_bounded_in_a_long_list(redis_client):
    """100,000 young owner-less entries ahead of 1,000 lapsed ones: each LREM scans from the
    nearer end, and the calls split by scanned entries, so no call is slow."""
    now = await server_s(redis_client)
    await deliver(redis_client, [f"old-{i}" for i in range(1000)], now)
    pipe = redis_client.pipeline(transaction=False)
    young = [f"young-{i}" for i in range(100_000)]
    for start in range(0, len(young), 5000):
        pipe.lpush(KEYS.processing, *young[start:start + 5000])
    await pipe.execute()
    # Also 1,000 lapsed ones in the middle, reached by a cursor window there.
    middle = [f"mid-{i}" for i in range(1000)]
    await deliver(redis_client, middle, now)
    young2 = [f"young2-{i}" for i in range(50_000)]
    await redis_client.lpush(KEYS.processing, *young2)
    await redis_client.mset({KEYS.job(pid): record(pid, now) for pid in young2[-1000:]})
    # A whole second: a bounded call takes milliseconds on a quiet machine but was seen at
    # 249 ms on a loaded 2-core one; an unbounded pass (an LREM from the far end of 150,000
    # entries per item, 2,000 items) runs for seconds.
    await redis_client.config_set("slowlog-log-slower-than", 1_000_000)
    await redis_client.slowlog_reset()

    report = await run(redis_client)
    assert report.dead_consumers == 1000  # the tail window
    await redis_client.set(KEYS.reap_cursor, "100000:50000")  # 100,000 from the tail
    report = await run(redis_client)
    assert report.dead_consumers == 1000  # the middle window
    assert await redis_client.slowlog_get() == []
    assert await redis_client.llen(KEYS.processing) == 150_000


# --- lock, errors, script cache -------------------------------------------------------


async def test_the_lock_is_queue_5s_and_schedules_the_fleet(redis_client):
    now = await server_s(redis_client)
    await register(redis_client, GONE_PREFIX, "gone-1", alive=False)
    await deliver(redis_client, [f"p{i}" for i in range(50)], now)
    scripts = Scripts(redis_client)
    options = {"lock_seconds": 5, "recovery_age": AGE, "max_attempts": 3}
    first, second = await asyncio.gather(
        maintain(redis_client, scripts, KEYS, **options),
        maintain(redis_client, scripts, KEYS, **options),
    )
    assert sorted([first.skipped, second.skipped]) == [False, True]
    assert first.dead_consumers + second.dead_consumers == 50
    # Never released: it expires after the interval, as queue 5's does.
    assert abs(int(await redis_client.get(KEYS.reap_lock)) - now) <= 2
    assert 0 < await redis_client.ttl(KEYS.reap_lock) <= 5
    assert (await maintain(redis_client, scripts, KEYS, **options)).skipped


async def test_a_wrong_typed_key_changes_nothing(redis_client):
    now = await server_s(redis_client)
    await deliver(redis_client, ["p1"], now)
    await redis_client.hset(KEYS.ready, "x", "y")
    with pytest.raises(WrongTypeError):
        await run(redis_client)
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"p1"]
    await redis_client.delete(KEYS.ready)
    await redis_client.set(KEYS.stat("processing"), "abc")
    with pytest.raises(WrongTypeError):
        await run(redis_client)
    assert await redis_client.exists(KEYS.owner("p1")) == 1


async def test_maintain_survives_the_loss_of_the_script_cache(redis_client, redis_server):
    now = await server_s(redis_client)
    scripts = Scripts(redis_client)
    await deliver(redis_client, ["p1"], now)
    assert (await run(redis_client, scripts)).dead_consumers == 1
    redis_server.cli("SCRIPT", "FLUSH")
    await deliver(redis_client, ["p2"], now)
    await reserve(redis_client, "t1", [b"r"], now - 1)
    report = await run(redis_client, scripts)
    assert (report.dead_consumers, report.expired_reservations) == (1, 1)
    assert await redis_client.llen(KEYS.processing) == 0


# --- end to end through RedisBroker ---------------------------------------------------


@pytest.fixture
async def brokers(redis_brokers):
    """Two consumers of one queue, ``a`` and ``b``, each with a 3 s lease (deadlines are
    whole seconds: a 2 s one can leave a claim or a sweep barely 1 s)."""
    return [await redis_brokers(KEYS.queue, namespace=KEYS.namespace, consumer_id=name,
                                lease=3.0)
            for name in ("a", "b")]


async def sweep(broker, client):
    await client.delete(KEYS.reap_lock)
    return await broker.maintain()


async def wait_until_expired(client, reservation: str) -> None:
    deadline = await client.zscore(KEYS.reservations, reservation)
    assert deadline is not None
    await waiting.until(lambda: server_s_past(client, deadline), 30, "the reservation's deadline")


@pytest.mark.slow
async def test_e2e_a_reservation_never_claimed_is_returned_in_order(brokers, redis_client):
    a, b = brokers
    pids = await a.publish_many(KEYS.queue, [{"i": i} for i in range(5)])
    reservation = await a.reserve(3, 0)  # ... and a dies before claiming
    assert len(reservation.payloads) == 3

    assert (await sweep(b, redis_client)).expired_reservations == 0
    await wait_until_expired(redis_client, reservation.key)
    assert (await sweep(b, redis_client)).expired_reservations == 3
    late = await a.claim(reservation)  # a late claim finds the reservation gone
    assert late.deliveries == [] and late.poisoned == []

    received = await b.receive(10, 0)
    assert [d.pid for d in received.deliveries] == pids
    assert await redis_client.zcard(KEYS.reservations) == 0


@pytest.mark.slow
async def test_e2e_a_reservation_made_ahead_by_a_consumer_that_died_is_returned_in_order(
    brokers, redis_client
):
    """A settle call's write reserved ahead for a's next receive (``reserve_ahead``), and a
    dies before that receive: the reservation is registered like any other, so another
    consumer's sweep returns it once its deadline passed, in order, with nothing claimed."""
    a, b = brokers
    pids = await a.publish_many(KEYS.queue, [{"i": i} for i in range(6)])
    first = (await a.receive(1, 0)).deliveries
    await a.commit(first)  # settle.lua ran on a's connection: reserving ahead may go with it
    second = (await a.receive(2, 0)).deliveries
    assert a.reserve_ahead(3)
    await a.commit(second)  # ... carries the reserve; a dies before its next receive
    [reservation] = await redis_client.zrange(KEYS.reservations, 0, -1)
    assert await redis_client.llen(reservation) == 3

    await wait_until_expired(redis_client, reservation)
    assert (await sweep(b, redis_client)).expired_reservations == 3
    received = await b.receive(10, 0)
    assert [d.pid for d in received.deliveries] == pids[3:]
    assert await redis_client.zcard(KEYS.reservations) == 0


@pytest.mark.slow
async def test_e2e_death_after_the_blocking_move(brokers, redis_client):
    a, b = brokers
    blocked = asyncio.create_task(a.reserve(10, 3.0))  # 3 s for the publish to come
    await waiting.until(lambda: redis_client.zcard(KEYS.reservations), 10,
                        "its registration, made before the move", every=0.01)
    [pid] = await b.publish_many(KEYS.queue, [{"late": True}])
    reservation = await blocked  # moved, and a dies before claiming
    assert len(reservation.payloads) == 1

    await wait_until_expired(redis_client, reservation.key)
    assert (await sweep(b, redis_client)).expired_reservations == 1
    [delivery] = (await b.receive(10, 0)).deliveries
    assert (delivery.pid, delivery.payload) == (pid, {"late": True})


@pytest.mark.slow
async def test_e2e_a_frozen_consumer_does_not_move_into_a_recovered_reservation(
    brokers, redis_client
):
    """Hole 1: frozen between registering and BLMOVE past the deadline, the reservation is
    recovered (empty: unregistered); a late BLMOVE would strand a payload in a list no
    registry names. The consumer notices the freeze and does not move."""
    a, b = brokers
    original = a.scripts.call

    async def freeze_after_reserve(name, keys, args=()):
        result = await original(name, keys, args)
        if name == "reserve" and not result:
            await asyncio.sleep(a._lease / 2 + 0.2)  # SIGSTOP, a VM pause
            await b.publish_many(KEYS.queue, [{"while": "frozen"}])
        return result

    a.scripts.call = freeze_after_reserve  # type: ignore[method-assign]
    reservation = await a.reserve(10, 1.0)
    assert reservation.payloads == []
    assert await redis_client.zcard(KEYS.reservations) == 0
    assert await redis_client.llen(KEYS.ready) == 1  # not moved anywhere


async def test_e2e_a_late_move_into_an_unregistered_reservation_goes_back(brokers, redis_client):
    """The same hole at the claim: whatever a reservation that is no longer registered
    holds goes back to the ready list, never into a list no registry names."""
    a, b = brokers
    [pid] = await b.publish_many(KEYS.queue, [{"n": 1}])
    reservation = await a.reserve(10, 0)
    await redis_client.zrem(KEYS.reservations, reservation.key)  # recovered while empty
    assert (await a.claim(reservation)).deliveries == []
    assert await redis_client.exists(reservation.key) == 0
    [delivery] = (await b.receive(10, 0)).deliveries
    assert delivery.pid == pid


@pytest.mark.slow
async def test_e2e_lapsed_deliveries_go_to_the_living(brokers, redis_client):
    a, b = brokers
    await a.extend([])  # a supervisor's first renewal, at start: its record and registry entry
    pids = await a.publish_many(KEYS.queue, [{"i": i} for i in range(4)])
    taken = (await a.receive(10, 0)).deliveries
    assert [d.pid for d in taken] == pids
    assert (await sweep(b, redis_client)).total == 0  # a's claims are live

    # a stops renewing (killed, or frozen): its claims and its record run out together.
    async def lapsed() -> bool:
        return not await redis_client.exists(KEYS.supervisor("a"),
                                             *(KEYS.claim(pid) for pid in pids))

    await waiting.until(lapsed, 30, "a's claims and record to lapse", every=0.1)
    report = await sweep(b, redis_client)
    assert report.dead_consumers == 4
    assert await redis_client.get(KEYS.stat("processing")) == b"0"

    # a comes back: it owns nothing any more and cannot settle what it had.
    assert await a.extend(taken) == [False] * 4
    assert [r.outcome for r in await a.commit(taken)] == ["stale"] * 4

    again = (await b.receive(10, 0)).deliveries
    assert sorted(d.pid for d in again) == sorted(pids)
    assert all(d.attempts == 1 for d in again)  # a crashed run counts (queue 5)
    assert [r.ok for r in await b.commit(again)] == [True] * 4
    assert await redis_client.llen(KEYS.processing) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"0"


async def test_e2e_abandoned_deliveries_are_requeued_by_their_owner_at_exit(
    brokers, redis_client
):
    """What a supervisor still owns at exit (handlers killed at the deadline) it requeues
    itself, as recovery would: nothing owned by it is left for queue-5 workers, which would
    wait their ``reapAfter`` (25 h) before taking it."""
    a, b = brokers
    await a.extend([])
    await a.publish_many(KEYS.queue, [{"i": i} for i in range(3)])
    taken = (await a.receive(10, 0)).deliveries
    assert [r.ok for r in await a.commit(taken[2:])] == [True]
    await a.abandon(taken[:2])  # at exit, with two still running when killed
    ready = [orjson.loads(raw) for raw in await redis_client.lrange(KEYS.ready, 0, -1)]
    assert sorted(e["pid"] for e in ready) == sorted(d.pid for d in taken[:2])
    assert all(e["attempts"] == 1 for e in ready)  # the killed run counts
    assert await redis_client.llen(KEYS.processing) == 0
    assert await redis_client.get(KEYS.stat("processing")) == b"0"
    assert await redis_client.exists(KEYS.supervisor("a")) == 0
    assert (await sweep(b, redis_client)).total == 0
    assert await a.extend(taken[:2]) == [False, False]


async def test_e2e_what_a_requeue_at_exit_missed_is_recovered_at_once(brokers, redis_client):
    """If the requeue at exit cannot run (the connection broke after the claims went), the
    registry still names the supervisor, now gone: the next sweep takes its deliveries at
    once, young as they are."""
    a, b = brokers
    await a.extend([])
    await a.publish_many(KEYS.queue, [{"i": i} for i in range(2)])
    taken = (await a.receive(10, 0)).deliveries
    await a._renew(taken, 0)  # the first step of abandon(), then the connection broke
    report = await sweep(b, redis_client)
    assert report.dead_consumers == 2
    assert await redis_client.llen(KEYS.processing) == 0


async def test_e2e_deliveries_settled_by_their_owner_are_not_recovered(brokers, redis_client):
    a, b = brokers
    await a.publish_many(KEYS.queue, [{"i": i} for i in range(3)])
    taken = (await a.receive(10, 0)).deliveries
    assert [r.ok for r in await a.commit(taken)] == [True] * 3
    assert (await sweep(b, redis_client)).total == 0
    assert await redis_client.llen(KEYS.ready) == 0


async def test_what_a_previous_format_supervisor_left_is_recovered(redis_client):
    """Its owner tokens were ``<consumer>:<nonce>`` and it never wrote claim keys: once it
    is stopped, the first sweep takes its deliveries (and its ms-deadline reservations)."""
    now = await server_s(redis_client)
    await deliver(redis_client, ["old-1", "old-2"], now, token="host-1-abcdef:0a1b2c3d-7")
    await reserve(redis_client, "host-1-abcdef:0a1b2c3d-8", [b"r"], now * 1000 - 1)
    report = await run(redis_client)
    assert (report.dead_consumers, report.expired_reservations) == (2, 1)
    ready = await redis_client.lrange(KEYS.ready, 0, -1)
    assert sorted(orjson.loads(raw)["pid"] for raw in ready if raw != b"r") == ["old-1", "old-2"]
    assert await redis_client.llen(KEYS.processing) == 0
    assert await redis_client.zcard(KEYS.reservations) == 0


# --- whose owner: queue 5's rule unless the registry knows the owner for one of ours ----


async def test_a_queue5_owner_whose_claim_lapsed_is_kept_until_recovery_age(redis_client):
    """Queue 5's rule (``Broker\\Redis::reap()``): an entry is kept while its claim exists
    or it is younger than ``reapAfter``, owner or not. A Workerman or KubernetesJob worker
    never renews: its claim lapses while its handler still runs."""
    now = await server_s(redis_client)
    php_token = "c" * 32  # not in the registry: not known to be ours
    await deliver(redis_client, ["young"], now - AGE + 60, token=php_token)
    await deliver(redis_client, ["old"], now - AGE - 10, token=php_token)
    report = await run(redis_client)
    assert (report.dead_consumers, report.legacy) == (1, 0)
    assert pids_of(await redis_client.lrange(KEYS.ready, 0, -1)) == ["old"]
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"young"]
    assert await redis_client.get(KEYS.owner("young")) == php_token.encode()


async def test_a_live_supervisor_of_ours_is_never_touched(redis_client):
    now = await server_s(redis_client)
    await register(redis_client, "a" * 16, "alive-1", alive=True)
    await deliver(redis_client, ["mine"], now - 2 * AGE, token="a" * 16 + "1" * 16)
    assert (await run(redis_client)).total == 0
    assert await redis_client.lrange(KEYS.processing, 0, -1) == [b"mine"]
    await redis_client.delete(KEYS.supervisor("alive-1"))  # it died: its record expired
    assert (await run(redis_client)).dead_consumers == 1


async def test_the_registry_is_never_the_reason_to_take_what_queue5_keeps(redis_client):
    """An entry without a consumer id, one of another format, or a registry that is not a
    hash knows nothing: queue 5's rule applies."""
    now = await server_s(redis_client)
    await redis_client.hset(KEYS.supervisor_tokens, mapping={
        "b" * 16: "not-a-time gone-2", "d" * 16: "123"})
    await deliver(redis_client, ["b"], now, token="b" * 32)
    await deliver(redis_client, ["d"], now, token="d" * 32)
    await redis_client.delete(KEYS.reap_lock)
    options = {"lock_seconds": 60, "recovery_age": AGE, "max_attempts": 3}
    assert (await maintain(redis_client, Scripts(redis_client), KEYS, **options)).total == 0
    await redis_client.delete(KEYS.supervisor_tokens, KEYS.reap_lock)
    await redis_client.set(KEYS.supervisor_tokens, "not a hash")
    await deliver(redis_client, ["e"], now, token=GONE_PREFIX + "e" * 16)
    assert (await maintain(redis_client, Scripts(redis_client), KEYS, **options)).total == 0
    assert await redis_client.llen(KEYS.processing) == 3


async def test_the_registry_forgets_supervisors_gone_past_recovery_age(redis_client):
    now = await server_s(redis_client)
    await redis_client.hset(KEYS.supervisor_tokens, mapping={
        "1" * 16: f"{now - AGE - 5} long-gone",  # queue 5's rule covers all it held
        "2" * 16: f"{now - AGE + 60} recently-gone",  # its deliveries may be young
        "3" * 16: f"{now - AGE - 5} frozen-but-back",  # its record is there again
    })
    await redis_client.set(KEYS.supervisor("frozen-but-back"), "host 1", ex=30)
    await redis_client.delete(KEYS.reap_lock)
    await maintain(redis_client, Scripts(redis_client), KEYS, lock_seconds=60,
                   recovery_age=AGE, max_attempts=3)
    assert sorted(await redis_client.hkeys(KEYS.supervisor_tokens)) == [b"2" * 16, b"3" * 16]


async def test_extend_registers_the_token_prefix_and_the_record_expires_with_the_lease(
    brokers, redis_client
):
    a, _ = brokers
    await a.extend([])
    until, consumer = (await redis_client.hget(KEYS.supervisor_tokens, a.token_prefix)).split()
    assert consumer == b"a" and 0 < int(until) - await server_s(redis_client) <= a._lease
    assert 0 < await redis_client.ttl(KEYS.supervisor("a")) <= a._lease
    await a.publish_many(KEYS.queue, [{"i": 1}])
    [delivery] = (await a.receive(10, 0)).deliveries
    assert delivery.receipt.startswith(a.token_prefix) and len(delivery.receipt) == 32
