"""A mixed fleet: this project's RedisBroker and PHP queue-5 workers on one queue (SPEC §4, §5, §9).

The PHP side is ``tests.queue5.Queue5Consumer``, a model of queue 5's ``Broker\\Redis``
checked against its scripts. Everything runs against a real private redis-server; nothing
of Redis is mocked. A PHP worker "dies" by being dropped; ours by ``close()`` only (nothing
settled, released or abandoned) or, end to end, by SIGKILL.

Where PHP has to recover our work, the model is built with a small ``reap_after``:
production PHP keeps ``reapAfter = 90000`` s and only takes a lapsed delivery once its
envelope is 25 h old. Where ours has to recover a PHP worker's, the same holds: ours keeps
queue 5's rule for every owner it does not know for one of its own supervisors, so those
tests give it a small ``recovery_age`` (production: 90000 s too) and wait for the age. A
model built with a small ``claim_ttl`` stands for a PHP worker whose 90 s claims ran out.
Deleting a claim key stands for its expiry, deleting ``reap-lock`` for the sweep interval
passing.

Every test ends by checking that nothing is stranded (ready, registry, reservation lists,
processing, job/owner/claim keys: only what the scenario expects is left) and that the
counters are exactly what claims, settlements and recoveries add up to.
"""

from __future__ import annotations

import asyncio
import collections
import random
import signal
import socket
import threading
import time
from typing import Any

import orjson
import pytest
import redis

from broker.base import Delivery, Outcome
from broker.redis.keys import QueueKeys
from support import processes
from support.supervision import QUEUE as E2E_QUEUE
from support.supervision import counter, keys, lines, outstanding, wait_for, write_config
from support.waiting import until
from tests.queue5 import Message, NotOwned, Queue5Consumer, php_json_encode

NS = "utopia-queue"
SEED = 20261130
#: Keys that are no message's state: counters, the fleet's sweep lock and cursor, and this
#: project's supervisor record (it expires with the lease) and token registry.
NOT_STATE = {"stats", "reap-lock", "reap-cursor", "supervisors", "supervisor-tokens"}


# --- helpers ------------------------------------------------------------------------------


def php(client: redis.Redis, queue: str, **options: Any) -> Queue5Consumer:
    worker = Queue5Consumer(client, queue, namespace=NS, **options)
    worker.pop_timeout = 0.1
    return worker


def counters(client: redis.Redis, queue: str) -> dict[str, int]:
    k = QueueKeys(NS, queue)
    names = ("total", "processing", "success", "failed")
    return {name: int(client.get(k.stat(name)) or 0) for name in names}


def leftovers(client: redis.Redis, queue: str) -> set[str]:
    """Every key of the queue that holds message state (SCAN of the whole namespace)."""
    found = set()
    for raw in client.scan_iter(match=f"{NS}.*", count=1000):
        key = raw.decode()
        kind, _, rest = key[len(NS) + 1:].partition(".")
        if (rest == queue or rest.startswith(queue + ".")) and kind not in NOT_STATE:
            found.add(key)
    return found


def assert_settled(client: redis.Redis, queue: str, *, total: int, success: int,
                   failed: int = 0, left: set[str] | frozenset[str] = frozenset()) -> None:
    """Nothing stranded (only ``left`` remains) and the counters exactly as given."""
    k = QueueKeys(NS, queue)
    assert client.llen(k.ready) == 0
    assert client.llen(k.processing) == 0
    assert client.zcard(k.reservations) == 0
    assert list(client.scan_iter(match=f"{k.reservations}.*")) == []
    assert leftovers(client, queue) == set(left)
    assert counters(client, queue) == {
        "total": total, "processing": 0, "success": success, "failed": failed,
    }


def server_s(client: redis.Redis) -> int:
    return int(client.time()[0])


def processing_pids(client: redis.Redis, queue: str) -> list[str]:
    """Processing pids from the oldest (tail) to the newest (head)."""
    raws = client.lrange(QueueKeys(NS, queue).processing, 0, -1)
    return [raw.decode() for raw in reversed(raws)]


# --- 1. both sides consume one queue, no faults -------------------------------------------


async def test_both_sides_consume_one_queue_and_each_pid_runs_exactly_once(client, redis_brokers):
    q = "mixed"
    rng = random.Random(SEED)
    # reap_after=0: the model's sweeps would take any delivery without a live claim.
    model = php(client, q, reap_after=0)
    broker = await redis_brokers(q, namespace=NS, lease=30)
    published: set[str] = set()
    for _ in range(10):  # 250 + 250, producers interleaved
        published.update(model.publish({"by": "php", "n": rng.random()}) for _ in range(25))
        published.update(await broker.publish_many(q, [{"by": "ours"}] * 25))
    assert len(published) == 500

    ran: dict[str, list[str]] = collections.defaultdict(list)
    held_ours: list = []
    held_php: list = []
    k = QueueKeys(NS, q)
    while client.llen(k.ready) or held_ours or held_php:
        if rng.random() < 0.5:
            received = await broker.receive(rng.randint(1, 50), 0)
            assert received.poisoned == [] and received.deferred == 0
            for delivery in received.deliveries:
                ran[delivery.pid].append("ours")
            held_ours += received.deliveries
        else:
            for message in model.receive(rng.randint(1, 20)):
                ran[message.pid].append("php")
                held_php.append(message)
        # Each side settles a random part of what it holds, so both hold work at once.
        if held_ours and rng.random() < 0.5:
            cut = rng.randint(1, len(held_ours))
            batch, held_ours = held_ours[:cut], held_ours[cut:]
            assert [r.outcome for r in await broker.commit(batch)] == [Outcome.OK] * cut
        if held_php and rng.random() < 0.5:
            cut = rng.randint(1, len(held_php))
            for message in held_php[:cut]:
                model.commit(message)  # raises NotOwned if anything took it
            held_php = held_php[cut:]
        if rng.random() < 0.1:  # sweeps of both sides among live work take nothing
            assert (await broker.maintain(force=True)).total == 0
            client.delete(k.reap_lock)
            assert model.maintain() == 0

    assert set(ran) == published
    assert {pid: sides for pid, sides in ran.items() if len(sides) != 1} == {}
    by_side = collections.Counter(sides[0] for sides in ran.values())
    assert by_side["ours"] > 50 and by_side["php"] > 50, by_side
    assert_settled(client, q, total=500, success=500)


# --- 2. ours dies with work in flight; PHP finishes ----------------------------------------


@pytest.mark.slow
async def test_ours_killed_with_work_in_flight_php_finishes_everything(client, redis_brokers):
    q = "ours-dies"
    k = QueueKeys(NS, q)
    # claims and reservations lapse within ~3 s
    broker = await redis_brokers(q, namespace=NS, lease=3)
    await broker.publish_many(q, [{"n": n} for n in range(50)])
    claimed = (await broker.receive(20, 0)).deliveries
    assert [d.payload["n"] for d in claimed] == list(range(20))
    assert [r.ok for r in await broker.commit(claimed[:5])] == [True] * 5
    ran_by_ours = collections.Counter(d.payload["n"] for d in claimed[:10])  # 5..9: no commit
    reservation = await broker.reserve(10, 0)  # n 20..29, never claimed
    assert len(reservation.payloads) == 10
    await broker.close()  # killed: nothing settled, released or abandoned

    # reap_after=0: production PHP (90000 s) would wait 25 h for our lapsed deliveries.
    model = php(client, q, reap_after=0, reap_interval=1)
    assert model.maintain() == 0  # claims still live, reservation not due: nothing moves
    assert client.zcard(k.reservations) == 1 and client.llen(k.processing) == 15
    deadline = client.zscore(k.reservations, reservation.key)
    lapsed = [k.claim(d.pid) for d in claimed[5:]]
    await until(lambda: server_s(client) >= deadline and not client.exists(*lapsed)
                and not client.exists(k.reap_lock), 10, "our leases and the reap lock to lapse")

    assert model.maintain() == 15  # the 15 claimed deliveries: new pids, attempts + 1
    assert client.zcard(k.reservations) == 0
    runs: collections.Counter[int] = collections.Counter()
    attempts: dict[int, int] = {}
    rng = random.Random(SEED)
    while batch := model.receive(rng.randint(1, 20)):
        for message in batch:
            runs[message.payload["n"]] += 1
            attempts[message.payload["n"]] = message.attempts
            model.commit(message)
    assert runs == {n: 1 for n in range(5, 50)}
    assert attempts == {n: 1 if n < 20 else 0 for n in range(5, 50)}
    twice = {n for n in range(50) if runs[n] + ran_by_ours[n] > 1}
    assert twice == set(range(5, 10))  # only deliveries ours had claimed (and ran) run twice
    # total: 20 claimed by ours + 45 by PHP; success: 5 by ours + 45 by PHP.
    assert_settled(client, q, total=65, success=50)


# --- 3. PHP dies mid-batch; ours recovers ---------------------------------------------------


@pytest.mark.slow
async def test_php_killed_mid_batch_ours_recovers_and_runs_everything(client, redis_brokers):
    q = "php-dies"
    k = QueueKeys(NS, q)
    # claim_ttl=3: the dead worker's claims and reservation lapse within ~3 s (production 90).
    model = php(client, q, claim_ttl=3)
    pids = [model.publish({"n": n}) for n in range(40)]
    claimed = model.receive(10)  # n 0..9
    assert [m.pid for m in claimed] == pids[:10]
    for message in claimed[:3]:
        model.commit(message)
    # n 3..5 ran and were never settled, 6..9 never started; n 10..19 reserved, never claimed.
    reserved = model.receive_reserve_only(10)
    assert len(reserved.batch) == 10
    deadline = client.zscore(k.reservations, reserved.key)

    # lease 30, max_attempts 3, maintenance_interval 5; recovery_age 1 (production 90000):
    # a PHP owner whose claim lapsed may be a worker that never renews, still running.
    broker = await redis_brokers(q, namespace=NS, recovery_age=1)
    assert (await broker.maintain()).total == 0  # nothing lapsed yet
    client.delete(k.reap_lock)
    lapsed = [k.claim(m.pid) for m in claimed[3:]]
    published = max(m.timestamp for m in claimed)
    await until(lambda: server_s(client) >= deadline and not client.exists(*lapsed)
                and server_s(client) > published + 1, 10,
                "the dead worker's claims and reservation to lapse, and recovery_age")

    report = await broker.maintain()
    assert (report.expired_reservations, report.dead_consumers, report.legacy) == (10, 7, 0)
    assert (await broker.maintain()).skipped  # our own lock: one sweep per interval
    assert (await broker.maintain(force=True)).total == 0  # nothing left to recover
    with pytest.raises(NotOwned):  # the dead worker cannot settle what was recovered
        model.commit(claimed[3])

    deliveries = []
    while received := (await broker.receive(16, 0)).deliveries:
        deliveries += received
    assert sorted(d.pid for d in deliveries) == sorted(pids[3:])  # same pids (ours requeues)
    assert {d.pid: d.attempts for d in deliveries} == {
        pid: 1 if i < 10 else 0 for i, pid in enumerate(pids) if i >= 3
    }
    assert all(r.ok for r in await broker.commit(deliveries))
    # total: 10 claimed by PHP + 37 by ours; success: 3 by PHP + 37 by ours.
    assert_settled(client, q, total=47, success=40)


# --- 4. live work is never taken, either way ----------------------------------------------


def publish_old(model: Queue5Consumer, n: int, age: int = 100_000) -> str:
    """A PHP envelope published ``age`` seconds ago (older than any reap threshold)."""
    envelope = {**model.envelope({"n": n}), "timestamp": int(time.time()) - age}
    model.client.lpush(model.key("queue"), php_json_encode(envelope))
    return envelope["pid"]


@pytest.mark.slow
async def test_a_renewed_claim_is_never_taken_in_either_direction(client, redis_brokers):
    q = "live"
    k = QueueKeys(NS, q)
    # PHP with 6 s claims and reap_after=0: it would take anything whose claim is gone.
    model = php(client, q, claim_ttl=6, reap_after=0)
    other = php(client, q)  # a second PHP worker (90 s claims): D
    broker = await redis_brokers(q, namespace=NS, lease=6, maintenance_interval=60)
    for n in range(6):
        publish_old(model, n)
    a = model.receive(2)  # PHP, renewed
    b = (await broker.receive(2, 0)).deliveries  # ours, renewed
    c = (await broker.receive(1, 0)).deliveries  # ours, not renewed: the model takes it
    d = other.receive(1)  # PHP, its claim lapses later: ours takes it
    assert len(a) == len(b) == 2 and len(c) == len(d) == 1

    await asyncio.sleep(3)  # half the lease: 3 s of slack on either side of the renewal
    model.extend(*a)
    assert await broker.extend(b) == [True, True]
    # c was claimed after a and b with the same 6 s lease: once its claim is gone, theirs
    # would be gone too had they not been renewed.
    await until(lambda: not client.exists(k.claim(c[0].pid)), 10, "c's claim to lapse")
    renewed = [k.claim(m.pid) for m in a] + [k.claim(x.pid) for x in b]
    assert client.exists(*renewed) == 4, "the machine is too slow for this test's leases"

    assert model.maintain() == 1  # PHP sweep, reap_after=0: takes c only
    assert (await broker.maintain()).skipped  # PHP's lock (60 s) holds our sweep off
    client.delete(k.claim(d[0].pid))  # D's worker died: its claim expired
    report = await broker.maintain(force=True)
    assert (report.dead_consumers, report.legacy, report.expired_reservations) == (1, 0, 0)
    assert client.exists(*renewed) == 4, "the renewed claims ran out during the test"
    assert sorted(processing_pids(client, q)) == sorted([m.pid for m in a] + [x.pid for x in b])
    for message in a:
        assert client.get(k.owner(message.pid)) == message.receipt.encode()
    for delivery in b:
        assert client.get(k.owner(delivery.pid)) == delivery.receipt.encode()

    for message in a:
        model.commit(message)  # still PHP's
    assert all(r.ok for r in await broker.commit(b))  # still ours
    with pytest.raises(NotOwned):
        other.commit(d[0])
    assert await broker.extend(c) == [False]
    assert [r.outcome for r in await broker.commit(c)] == [Outcome.STALE]

    again = (await broker.receive(10, 0)).deliveries
    assert sorted(x.payload["n"] for x in again) == sorted(
        [c[0].payload["n"], d[0].payload["n"]])
    by_n = {x.payload["n"]: x for x in again}
    assert by_n[c[0].payload["n"]].pid != c[0].pid  # PHP requeues under a new pid
    assert by_n[d[0].payload["n"]].pid == d[0].pid  # ours keeps the pid
    assert [x.attempts for x in again] == [1, 1]
    assert all(r.ok for r in await broker.commit(again))
    # total: a 2 + b 2 + c 1 + d 1 + again 2; success: a, b and again.
    assert_settled(client, q, total=8, success=6)


async def test_a_blocked_receive_keeps_its_reservation_through_the_other_sides_sweep(
    redis_url, client, redis_brokers
):
    """A consumer blocked on an empty queue has a registered, empty reservation (deadline:
    now + lease + timeout, in seconds); the other side's sweep must leave it registered,
    or the payload the blocking move brings would land in a list no registry names."""
    q = "blocked"
    k = QueueKeys(NS, q)
    # a receive frozen for lease/2 gives up its reservation
    broker = await redis_brokers(q, namespace=NS, lease=6)
    # PHP blocks in BRPOPLPUSH (its own connection, in a thread); ours sweeps.
    blocking = redis.Redis.from_url(redis_url)
    model = php(blocking, q)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.extend(model.receive(5, timeout=10)))
    thread.start()
    try:
        await until(lambda: client.zcard(k.reservations) == 1, 5, "PHP's registration")
        report = await broker.maintain(force=True)
        assert (report.expired_reservations, client.zcard(k.reservations)) == (0, 1)
        [pid] = await broker.publish_many(q, [{"n": 1}])
    finally:
        thread.join(10)
        blocking.close()
    assert [m.pid for m in got] == [pid]
    model.commit(got[0])

    # Ours blocks (BLMOVE); PHP sweeps (reap_after=0).
    sweeper = php(client, q, reap_after=0)
    receiving = asyncio.create_task(broker.receive(5, 10.0))  # ends when the publish comes
    await until(lambda: client.zcard(k.reservations) == 1, 5, "our registration")
    client.delete(k.reap_lock)
    assert sweeper.maintain() == 0
    assert client.zcard(k.reservations) == 1
    published = sweeper.publish({"n": 2})
    [delivery] = (await receiving).deliveries
    assert delivery.pid == published
    assert all(r.ok for r in await broker.commit([delivery]))
    assert_settled(client, q, total=2, success=2)


# --- 5. one cursor, one lock ----------------------------------------------------------------


@pytest.mark.slow
async def test_sweeps_share_the_cursor_and_the_lock(client, redis_brokers):
    """4,012 deliveries (PHP's and ours in blocks of 1,000); lapsed ones spread out. Sweeps
    alternate PHP (a 2,000 window) and ours (a 1,000 window plus the newest 1,000), each
    continuing where the other stopped; the expected cursors and finds are queue 5's
    protocol worked out by hand. Had either side reset the other's cursor, sweep 2 (or 5)
    would miss the lapsed entries in the middle of the list."""
    q = "cursor"
    k = QueueKeys(NS, q)
    model = php(client, q, reap_after=0)  # reap_interval 60: its lock outlives the test
    # recovery_age 1: ours takes a lapsed delivery it does not know for its own only by age.
    broker = await redis_brokers(q, namespace=NS, maintenance_interval=60, recovery_age=1)
    await broker.publish_many(q, [{"n": n} for n in range(4012)])
    # After the publish: 4,012 envelopes can straddle a second boundary, and one stamped a
    # second later than a clock read before them was still young to recovery_age 1.
    published = server_s(client)
    owned_by: dict[str, Any] = {}
    for side, size in (("php", 1000), ("ours", 1000), ("php", 1000), ("ours", 1000),
                       ("ours", 12)):
        if side == "php":
            got: list[Any] = model.receive(size)
        else:
            got = (await broker.receive(size, 0)).deliveries
        assert len(got) == size
        owned_by.update({item.pid: item for item in got})
    order = processing_pids(client, q)  # oldest first
    assert len(order) == 4012

    lapsed: set[str] = set()

    def lapse(positions: list[int]) -> None:
        current = processing_pids(client, q)
        for position in positions:
            lapsed.add(current[position])
            client.delete(k.claim(current[position]))

    def still_lapsed() -> int:
        return len(lapsed & set(processing_pids(client, q)))

    async def php_sweep() -> None:
        client.delete(k.reap_lock)  # the interval passed
        assert model.maintain() is not None
        assert (await broker.maintain()).skipped  # PHP's lock holds ours off
        assert 0 < client.ttl(k.reap_lock) <= 60 and int(client.get(k.reap_lock)) > 0

    async def our_sweep() -> None:
        client.delete(k.reap_lock)
        assert not (await broker.maintain()).skipped
        assert model.maintain() is None  # our lock holds PHP off
        assert 0 < client.ttl(k.reap_lock) <= 60 and int(client.get(k.reap_lock)) > 0

    def cursor() -> str:
        text = client.get(k.reap_cursor).decode()
        retained, remaining = text.split(":")
        assert str(int(retained)) == retained and str(int(remaining)) == remaining
        return text

    await until(lambda: server_s(client) > published + 1, 10, "recovery_age to pass")
    lapse([150 + 333 * i for i in range(12)])  # 150, 483, ..., 3813 from the oldest end
    await php_sweep()  # window [0, 2000): 6 found
    assert (cursor(), still_lapsed()) == ("1994:2012", 6)
    await our_sweep()  # window [2000, 3000) + the newest 1000: the other 6
    assert (cursor(), still_lapsed()) == ("2991:1012", 0)
    await php_sweep()  # to the end
    assert (cursor(), still_lapsed()) == ("4000:0", 0)
    lapse([500, 1500, 2100, 2400, 2700])
    await our_sweep()  # restarts: [0, 1000) + the newest 1000
    assert (cursor(), still_lapsed()) == ("999:3000", 4)
    await php_sweep()  # continues ours: [1000, 3000)
    assert (cursor(), still_lapsed()) == ("2995:1000", 0)
    assert client.llen(k.processing) == 4012 - 17

    # Owners settle their live work; the 17 recovered come back with attempts 1.
    live = [owned_by[pid] for pid in processing_pids(client, q)]
    ours_live = [item for item in live if isinstance(item, Delivery)]
    php_live = [item for item in live if isinstance(item, Message)]
    assert len(ours_live) + len(php_live) == 3995
    for message in php_live:
        model.commit(message)
    assert all(r.ok for r in await broker.commit(ours_live))
    recovered = []
    while received := (await broker.receive(1000, 0)).deliveries:
        recovered += received
    assert sorted(d.payload["n"] for d in recovered) == sorted(
        owned_by[pid].payload["n"] for pid in lapsed)
    assert {d.attempts for d in recovered} == {1}
    assert all(r.ok for r in await broker.commit(recovered))
    # total: 4012 first claims + 17 again; success: 3995 live + 17 recovered.
    assert_settled(client, q, total=4029, success=4012)


# --- 6. coalescing markers -------------------------------------------------------------------


async def test_coalescing_markers_are_freed_and_kept_as_php_expects(client, redis_brokers):
    q = "coalesce"
    k = QueueKeys(NS, q)
    model = php(client, q, reap_after=0)
    broker = await redis_brokers(q, namespace=NS, max_attempts=2)
    marker = k.pending("tenant-1")
    assert marker == model.marker("tenant-1")

    async def one() -> Any:
        [delivery] = (await broker.receive(10, 0)).deliveries
        assert delivery.envelope["key"] == "tenant-1"
        return delivery

    # Commit frees the marker; release keeps it.
    assert model.coalesce({"v": 1}, "tenant-1")
    assert not model.coalesce({"v": 2}, "tenant-1")  # coalesced into the pending one
    first = await one()
    assert client.get(marker) == first.pid.encode()
    assert [r.ok for r in await broker.release([first])] == [True]
    assert client.get(marker) == first.pid.encode()
    assert not model.coalesce({"v": 3}, "tenant-1")
    first = await one()
    assert first.attempts == 0
    assert [r.ok for r in await broker.commit([first])] == [True]
    assert not client.exists(marker)

    # A retry keeps it (the same pid is still pending); a reject at max attempts frees it.
    assert model.coalesce({"v": 4}, "tenant-1")
    second = await one()
    assert [r.ok for r in await broker.reject([second])] == [True]  # attempts 1 < 2: retry
    assert client.get(marker) == second.pid.encode()
    assert not model.coalesce({"v": 5}, "tenant-1")
    second = await one()
    assert second.attempts == 1
    assert [r.ok for r in await broker.reject([second])] == [True]  # 2 >= 2: failed
    assert not client.exists(marker)
    assert client.lrange(k.failed, 0, -1) == [second.pid.encode()]

    # PHP's reap moves the marker of our lapsed delivery to its successor; our commit of
    # the successor frees it.
    assert model.coalesce({"v": 6}, "tenant-1")
    third = await one()
    client.delete(k.claim(third.pid))  # ours was killed: its claim lapsed, ownership kept
    assert model.maintain() == 1
    successor = orjson.loads(client.lindex(k.ready, 0))
    assert successor["pid"] != third.pid and client.get(marker) == successor["pid"].encode()
    assert 0 < client.ttl(marker) <= 86400
    assert not model.coalesce({"v": 7}, "tenant-1")
    fourth = await one()
    assert (fourth.pid, fourth.attempts) == (successor["pid"], 1)
    assert [r.ok for r in await broker.commit([fourth])] == [True]
    assert not client.exists(marker)
    assert model.coalesce({"v": 8}, "tenant-1")
    fifth = await one()
    assert [r.ok for r in await broker.commit([fifth])] == [True]

    # total: first 2 (release), second 2 (retry), third, fourth, fifth;
    # success: first, fourth, fifth; failed: one retry + one reject.
    assert_settled(client, q, total=7, success=3, failed=2,
                   left={k.failed, k.job(second.pid), k.error(second.pid),
                         k.failures(second.pid)})


# --- 7. envelopes: what PHP runs, ours runs; what PHP poisons, ours poisons ------------------

ACCEPTED = [
    b'{"pid":1234567,"queue":"q","timestamp":1700000000,"payload":{"a":1}}',
    b'{"pid":"list","queue":"q","timestamp":1700000000,"payload":[1,"two",{"3":3}]}',
    b'{"pid":"ts-string","queue":"q","timestamp":"1700000000","payload":{"b":2}}',
    b'{"pid":"ts-prefix","queue":"q","timestamp":"1700000000abc","payload":{}}',
    b'{"pid":"ts-float","queue":"q","timestamp":1700000000.9,"payload":[]}',
    b'{"pid":"ts-array","queue":"q","timestamp":[1,2],"payload":{}}',
    b'{"pid":"no-payload","queue":"q","timestamp":1700000000}',
    b'{"pid":"null-payload","queue":"q","timestamp":1700000000,"payload":null}',
    b'{"pid":"attempts-string","queue":"q","timestamp":1,"payload":{},"attempts":"2"}',
    b'{"pid":2.5,"queue":"q","timestamp":1700000000,"payload":{}}',
    b'{"pid":true,"queue":7,"timestamp":true,"payload":{}}',
    b'{"pid":"esc\\/aped","queue":"q","timestamp":1,"payload":{"url":"http:\\/\\/x\\u00e9"}}',
    b'{"pid":"extra","queue":"q","timestamp":1,"payload":{},"sequence":5,"other":[1]}',
]
POISON = [
    b"",
    b"{not json",
    b'["array"]',
    b'"text"',
    b"null",
    b"{}",
    b"\xff\xfe",
    b'{"queue":"q","timestamp":1}',
    b'{"pid":"p1","queue":null,"timestamp":1}',
    b'{"pid":"p2","queue":"q","timestamp":null}',
    b'{"pid":"p3","queue":"q","timestamp":1,"payload":"text"}',
    b'{"pid":"p4","queue":"q","timestamp":1,"payload":5}',
    b'{"pid":"p5","queue":"q","timestamp":1,"attempts":"abc"}',
    b'{"pid":{"a":1},"queue":"q","timestamp":1}',
    b'{"pid":"p6","queue":["q"],"timestamp":1}',
]


async def test_envelopes_run_and_poison_exactly_as_php_decides(client, redis_brokers):
    # The same bytes on two queues: one consumed by the model, one by ours.
    theirs_q, ours_q = "env-php", "env-ours"
    raws = ACCEPTED + POISON
    random.Random(SEED).shuffle(raws)
    for q in (theirs_q, ours_q):
        client.lpush(QueueKeys(NS, q).ready, *raws)

    model = php(client, theirs_q)
    messages = model.receive(100)
    broker = await redis_brokers(ours_q, namespace=NS)
    received = await broker.receive(100, 0)

    php_view = {m.raw: (m.pid, m.queue, m.timestamp, m.attempts, m.payload or None)
                for m in messages}
    our_view = {d.raw: (d.pid, d.queue, d.timestamp, d.attempts, d.payload or None)
                for d in received.deliveries}
    assert set(php_view) == set(ACCEPTED)
    assert our_view == php_view
    assert sorted(p.raw for p in received.poisoned) == sorted(POISON)
    php_poison = client.lrange(QueueKeys(NS, theirs_q).poison, 0, -1)
    our_poison = client.lrange(QueueKeys(NS, ours_q).poison, 0, -1)
    assert sorted(our_poison) == sorted(php_poison) == sorted(POISON)

    for message in messages:
        model.commit(message)
    assert all(r.ok for r in await broker.commit(received.deliveries))
    # Poison counts in no counter, on either side.
    for q in (theirs_q, ours_q):
        assert_settled(client, q, total=len(ACCEPTED), success=len(ACCEPTED),
                       left=poisoned(QueueKeys(NS, q), ours=q == ours_q))


# Rows of the PHP 8.2 truth table, tests/data/php_redis_decode.json (bytes verbatim), on
# which the model's decode strays from real PHP: its (string) of a float uses 17 digits instead
# of PHP's precision 14, its int coercion accepts leading-numeric strings ("12abc", "1 2") and
# fails on ".5". What matters is PHP: these run on ours exactly as PHP ran them, or poison.
PHP_RUNS = {
    b'{"pid":0.30000000000000004,"queue":"q","timestamp":1,"payload":{"a":1}}':
        ("0.3", "q", 1, 0, {"a": 1}),
    b'{"pid":1e15,"queue":"q","timestamp":1,"payload":{"a":1}}': ("1.0E+15", "q", 1, 0, {"a": 1}),
    b'{"pid":"p","queue":"q","timestamp":".5","payload":{"a":1}}': ("p", "q", 0, 0, {"a": 1}),
}
PHP_POISONS = [
    b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1},"attempts":"12abc"}',
    b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1},"attempts":"1 2"}',
    b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1},"sequence":"0x1A"}',
]


async def test_envelopes_where_the_model_strays_run_as_php_8_ran_them(client, redis_brokers):
    q = "env-php8"
    client.lpush(QueueKeys(NS, q).ready, *PHP_RUNS, *PHP_POISONS)
    broker = await redis_brokers(q, namespace=NS)
    received = await broker.receive(100, 0)
    assert {d.raw: (d.pid, d.queue, d.timestamp, d.attempts, d.payload)
            for d in received.deliveries} == PHP_RUNS
    assert sorted(p.raw for p in received.poisoned) == sorted(PHP_POISONS)
    assert all(r.ok for r in await broker.commit(received.deliveries))
    assert_settled(client, q, total=len(PHP_RUNS), success=len(PHP_RUNS),
                   left=poisoned(QueueKeys(NS, q), ours=True))


def poisoned(keys: QueueKeys, ours: bool) -> set[str]:
    """What poison leaves: the list, and beside it our reason store (PHP keeps no reason)."""
    return {keys.poison, keys.poison_reasons, keys.poison_times} if ours else {keys.poison}


# --- 8. handover both ways with a real supervisor process -----------------------------------


@pytest.mark.slow
def test_handover_both_ways_with_a_supervisor_process(tmp_path, redis_url, client, supervisors):
    k = keys()
    origin: dict[str, int] = {}  # pid -> n, for every pid a supervisor can see

    # A PHP worker holds claimed deliveries (5 of them ran) and a reservation, and dies.
    # claim_ttl=3: its claims and reservation lapse in 3 s (production: 90 s).
    dying = php(client, E2E_QUEUE, claim_ttl=3)
    for n in range(30):
        origin[dying.publish({"n": n})] = n
    claimed = dying.receive(10)  # n 0..9
    ran_by_php = collections.Counter(m.payload["n"] for m in claimed[:5])
    assert len(dying.receive_reserve_only(10).batch) == 10  # n 10..19; 20..29 stay ready

    # [supervisor] lease must be >= 3 (config); maintenance every second.
    # recovery_age 1 (production 90000): the dead worker's claims lapse after 2 s, and only
    # their age tells the supervisor that a PHP owner is gone.
    config = write_config(tmp_path, redis_url, job={"prefetch": 20, "max_attempts": 3},
                          supervisor={"lease": 3, "maintenance_interval": 1,
                                      "recovery_age": 1})
    supervisor = supervisors(config, redis_url=redis_url)

    def handled() -> list[str]:
        return lines(tmp_path / "handled")

    wait_for(lambda: set(handled()) >= set(origin), 30, "the supervisor to run all of it")
    wait_for(lambda: counter(client, "success") == 30 and outstanding(client) == 0, 10,
             "its commits")
    started = sorted((line.split()[0], int(line.split()[1]))
                     for line in lines(tmp_path / "started"))
    # Each once; the PHP worker's claimed ones (recovered: same pid) with attempts 1.
    assert started == sorted((pid, 1 if n < 10 else 0) for pid, n in origin.items())
    with pytest.raises(NotOwned):
        dying.commit(claimed[0])
    assert counter(client, "total") == 40  # 10 claimed by PHP + 30 by the supervisor

    # The supervisor is SIGKILLed (with its whole family) holding work.
    for n in range(30, 90):
        origin[dying.publish({"n": n, "sleep": 0.1})] = n
    wait_for(lambda: len(handled()) >= 40, 20, "some of the new work")
    for process in supervisor.family():
        processes.kill(process)
    supervisor.process.wait(10)
    assert supervisor.process.returncode == -signal.SIGKILL
    assert outstanding(client) > 0, "the supervisor died holding nothing"
    ran_by_supervisor = collections.Counter(origin[pid] for pid in handled())

    # A PHP worker (reap_after=0; production waits 25 h) recovers and finishes the rest.
    rescuer = php(client, E2E_QUEUE, reap_after=0, reap_interval=1)
    runs: dict[int, list[int]] = {}  # n -> the attempts of each of PHP's runs
    deadline = time.monotonic() + 25
    while not (counter(client, "success") == 90 and outstanding(client) == 0
               and client.llen(k.ready) == 0):
        assert time.monotonic() < deadline, "PHP did not finish the supervisor's work"
        rescuer.maintain()
        for message in rescuer.receive(20):
            runs.setdefault(message.payload["n"], []).append(message.attempts)
            rescuer.commit(message)
        time.sleep(0.05)

    everyone = set(ran_by_supervisor) | set(runs) | set(ran_by_php)
    assert everyone == set(range(90))
    assert all(len(attempts) == 1 for attempts in runs.values())
    reclaimed = {n for n, [attempts] in runs.items() if attempts == 1}
    assert {attempts for [attempts] in runs.values()} <= {0, 1}
    # Run twice: the 5 the dead PHP worker ran, and only deliveries the supervisor claimed.
    twice = {n for n in range(90)
             if ran_by_supervisor[n] + len(runs.get(n, [])) + ran_by_php[n] > 1}
    assert twice - set(range(5)) <= reclaimed
    assert set(range(5)) <= twice
    # total: 40 (phase 1) + 60 claims of the new work + one more per delivery PHP reclaimed.
    assert counter(client, "total") == 100 + len(reclaimed)
    assert_settled(client, E2E_QUEUE, total=100 + len(reclaimed), success=90)


@pytest.mark.slow
def test_a_worker_that_never_renews_keeps_its_deliveries_beside_supervisor_sweeps(
    tmp_path, redis_url, client
):
    """Issue 23.1, with processes. A queue-5 Workerman worker (never renews; claims of 1 s
    here, 90 s in production) runs handlers far longer than its claims, beside two
    supervisors sweeping every second at the default ``recovery_age``: its deliveries are
    never taken, none runs twice, its commits succeed. Meanwhile one supervisor is SIGKILLed
    holding work: the other's next sweep after its lease ran out takes that work at once
    (a supervisor of ours, its record gone), and a living supervisor's is never touched."""
    from support.supervision import Supervisor

    k = keys()
    workerman = php(client, E2E_QUEUE, claim_ttl=1, adapter="workerman")  # reapAfter 90,000
    origin = {workerman.publish({"n": n}): n for n in range(30)}
    long_running = workerman.receive(3)
    php_pids = {m.pid for m in long_running}
    runs: dict[str, Supervisor] = {}

    def start(name: str, **env: str) -> None:
        workdir = tmp_path / name
        workdir.mkdir()
        config = write_config(workdir, redis_url, job={"prefetch": 5},
                              supervisor={"lease": 3, "maintenance_interval": 1})
        runs[name] = Supervisor(config, workdir, redis_url, **env)

    try:
        # The doomed one first: started together, the living one could take every message
        # before the other's first receive on a loaded machine, leaving it nothing to hold.
        start("killed", E2E_HANG_ALWAYS="1")
        wait_for(lambda: lines(tmp_path / "killed" / "started"), 30, "the hanging handler")
        start("living")
        lapsed_at = server_s(client)
        wait_for(lambda: not client.exists(*(k.claim(pid) for pid in php_pids)), 10,
                 "the Workerman worker's claims to lapse")
        # Sweeps by the supervisors for three more seconds: the lock is taken every second.
        wait_for(lambda: int(client.get(k.reap_lock) or 0) >= lapsed_at + 3, 15,
                 "three seconds of sweeps")
        # What the doomed supervisor holds: owner tokens with its registered prefix.
        [consumer] = [key.decode().rpartition(".")[2]
                      for key in client.scan_iter(match=k.supervisor("") + "*")
                      if client.get(key) == f"{socket.gethostname()} {runs['killed'].pid}"
                      .encode()]
        [prefix] = [field.decode() for field, value
                    in client.hgetall(k.supervisor_tokens).items()
                    if value.decode().endswith(f" {consumer}")]
        held_by_killed = [pid.decode() for pid in client.lrange(k.processing, 0, -1)
                          if (client.get(k.owner(pid.decode())) or b"").decode()
                          .startswith(prefix)]
        for process in runs["killed"].family():
            processes.kill(process)
        runs["killed"].process.wait(10)
        wait_for(lambda: set(lines(tmp_path / "living" / "handled")) >= set(origin) - php_pids,
                 30, "the living supervisor to run the rest, the dead one's work too")
        # Handled is not settled: the stop below kills it, so its commits come first.
        wait_for(lambda: counter(client, "success") == len(origin) - len(php_pids), 10,
                 "the living supervisor's commits")
        for message in long_running:  # the handlers end: still the Workerman worker's
            assert client.get(k.owner(message.pid)) == message.receipt.encode()
            workerman.commit(message)
    finally:
        for supervisor in runs.values():
            supervisor.stop()
    started = [line.split() for name in ("killed", "living")
               for line in lines(tmp_path / name / "started")]
    assert not php_pids & {pid for pid, *_ in started}  # never run by a supervisor
    living = collections.Counter(pid for pid in lines(tmp_path / "living" / "handled"))
    assert set(living) == set(origin) - php_pids and set(living.values()) == {1}
    assert held_by_killed
    attempts = {pid: int(n) for pid, n, *_ in
                (line.split() for line in lines(tmp_path / "living" / "started"))}
    assert {attempts[pid] for pid in held_by_killed} == {1}  # the killed run counted
    assert client.llen(k.processing) == 0
    assert counter(client, "success") == 30
