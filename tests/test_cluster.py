"""The Redis broker on a private three-master Redis Cluster.

The single-node behaviour tests (``test_redis_broker.py``, ``test_recovery.py``) run here
again in cluster form: every operation must route by the queue's one slot, and keep working
when that slot's script cache is lost or the slot moves to another master.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from broker import envelope
from broker.base import Action, Outcome, Settlement
from broker.redis import RedisBroker
from broker.redis.keys import QueueKeys
from broker.redis.placement import PlacementError
from broker.redis.publish import Publisher
from supervisor import cli
from support import envelopes
from support.brokers import count_script_calls
from support.cluster import PrivateCluster
from support.envelopes import publish as publish_e2e
from support.supervision import Supervisor, counter, lines, outstanding, wait_for, write_config
from support.supervision import keys as e2e_keys
from support.waiting import until

NS = "{utopia-queue}"
QUEUE = "stats-usage"
KEYS = QueueKeys(NS, QUEUE)
SLOT = key_slot(b"utopia-queue")


# -- helpers ----------------------------------------------------------------------------


async def new_broker(cluster: PrivateCluster, **options: Any) -> RedisBroker:
    options = {"namespace": NS, "cluster": True, "consumer_id": "tester", **options}
    broker = RedisBroker(cluster.url, QUEUE, **options)
    await broker.connect()
    return broker


@pytest.fixture
async def client(redis_cluster: PrivateCluster):
    connection = RedisCluster.from_url(redis_cluster.url)
    yield connection
    await connection.aclose()


@pytest.fixture
async def broker(redis_cluster: PrivateCluster):
    consumer = await new_broker(redis_cluster)
    yield consumer
    await consumer.close()


@pytest.fixture
async def pair(redis_cluster: PrivateCluster):
    """Two consumers of the queue, ``a`` and ``b``, each with a 3 s lease (deadlines are
    whole seconds: with 1 s, a claim just after a second boundary finds its reservation
    expired)."""
    consumers = [await new_broker(redis_cluster, consumer_id=name, lease=3.0)
                 for name in ("a", "b")]
    yield consumers
    for consumer in consumers:
        await consumer.close()


def snapshot(cluster: PrivateCluster) -> dict[bytes, Any]:
    """Every key of the cluster with its value; asserts they all live on the slot's owner."""
    owner = cluster.owner(SLOT)
    state: dict[bytes, Any] = {}
    for node in cluster.nodes:
        for key in node.client.scan_iter(match="*"):
            assert node is owner, f"{key!r} is on {node.port}, not on {owner.port}"
            kind = node.client.type(key)
            if kind == b"string":
                state[key] = node.client.get(key)
            elif kind == b"list":
                state[key] = node.client.lrange(key, 0, -1)
            elif kind == b"zset":
                state[key] = node.client.zrange(key, 0, -1, withscores=True)
            else:
                state[key] = kind
    return state


async def publish(client, count: int, **fields: Any) -> list[str]:
    """``count`` fresh envelopes pushed the way PHP producers do; returns their pids."""
    return await envelopes.lpush_each(client, KEYS.ready, envelopes.fresh(QUEUE, count, **fields))


async def counters(client) -> dict[str, int]:
    names = ("total", "processing", "success", "failed")
    values = await client.mget([KEYS.stat(name) for name in names])
    return {name: int(value or 0) for name, value in zip(names, values, strict=True)}


async def server_ms(cluster: PrivateCluster) -> int:
    seconds, micros = cluster.owner(SLOT).client.time()
    return seconds * 1000 + micros // 1000


async def wait_until_expired(cluster: PrivateCluster, client, reservation: str) -> None:
    deadline = await client.zscore(KEYS.reservations, reservation)
    assert deadline is not None

    async def passed() -> bool:
        return await server_ms(cluster) >= deadline * 1000  # deadlines are whole seconds

    await until(passed, 30, "the reservation's deadline")


# -- the basics -------------------------------------------------------------------------


async def test_a_queue_lives_on_the_node_that_serves_its_slot(redis_cluster, broker, client):
    pids = await broker.publish_many(QUEUE, [{"n": n} for n in range(5)])
    received = await broker.receive(100, 0)
    assert [d.pid for d in received.deliveries] == pids
    assert await broker.extend(received.deliveries) == [True] * 5
    assert await counters(client) == {"total": 5, "processing": 5, "success": 0, "failed": 0}
    state = snapshot(redis_cluster)  # asserts every key is on the owner of the slot
    assert len(state[KEYS.processing.encode()]) == 5
    assert [r.outcome for r in await broker.commit(received.deliveries)] == [Outcome.OK] * 5
    assert await counters(client) == {"total": 5, "processing": 0, "success": 5, "failed": 0}


async def test_blocking_receive_gets_a_message_published_later(broker, client):
    task = asyncio.create_task(broker.receive(10, 3))

    async def registered() -> bool:
        return await client.zcard(KEYS.reservations) == 1

    await until(registered)  # registered before it blocks in BLMOVE
    [pid] = await publish(client, 1)
    received = await task
    assert [d.pid for d in received.deliveries] == [pid]
    assert await client.zcard(KEYS.reservations) == 0


async def test_blocking_receive_times_out_cleanly(redis_cluster, broker):
    received = await broker.receive(10, 0.2)
    assert received.deliveries == [] and received.poisoned == []
    assert snapshot(redis_cluster) == {}


# -- recovery ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_death_after_the_blocking_move_is_recovered_after_the_deadline(
    redis_cluster, pair, client, monkeypatch
):
    monkeypatch.setattr("broker.redis.blocking.BLOCK_MARGIN", 1.0)
    a, b = pair
    blocked = asyncio.create_task(a.reserve(10, 3.0))  # 3 s for the publish to come

    async def registered() -> bool:
        return await client.zcard(KEYS.reservations) == 1

    await until(registered)
    [pid] = await publish(client, 1)
    reservation = await blocked  # registered + moved; a dies before claiming
    assert len(reservation.payloads) == 1
    assert await client.lrange(reservation.key, 0, -1) == reservation.payloads
    assert await client.llen(KEYS.ready) == 0

    deadline = await client.zscore(KEYS.reservations, reservation.key)  # whole seconds
    assert await server_ms(redis_cluster) < deadline * 1000
    assert (await b.maintain(force=True)).expired_reservations == 0  # not before the deadline
    assert await client.lrange(reservation.key, 0, -1) == reservation.payloads

    await wait_until_expired(redis_cluster, client, reservation.key)
    assert (await b.maintain(force=True)).expired_reservations == 1
    assert await client.exists(reservation.key) == 0
    [delivery] = (await b.receive(10, 0)).deliveries
    assert delivery.pid == pid


async def test_a_dead_consumers_deliveries_go_to_the_living(pair, client):
    a, b = pair
    await a.extend([])  # its first renewal: its record and its token-registry entry
    pids = await a.publish_many(QUEUE, [{"i": i} for i in range(4)])
    taken = (await a.receive(10, 0)).deliveries
    assert (await b.maintain(force=True)).total == 0  # a is alive
    await client.delete(*(KEYS.claim(d.pid) for d in taken))
    assert (await b.maintain(force=True)).total == 0  # claims gone, but its record is there

    # a's claims and record are gone, as after its lease ran out: ours and dead (the
    # registry, the records and the owners share the namespace's slot).
    await a._renew(taken, 0)
    assert (await b.maintain(force=True)).dead_consumers == 4
    assert await a.extend(taken) == [False] * 4
    assert [r.outcome for r in await a.commit(taken)] == [Outcome.STALE] * 4
    again = (await b.receive(10, 0)).deliveries
    assert sorted(d.pid for d in again) == sorted(pids)
    assert all(d.attempts == 1 for d in again)  # the lost runs count (queue 5)
    assert [r.ok for r in await b.commit(again)] == [True] * 4
    assert await counters(client) == {"total": 8, "processing": 0, "success": 4, "failed": 0}


async def test_legacy_entries_are_recovered_past_the_age(redis_cluster, client):
    consumer = await new_broker(redis_cluster, recovery_age=60)
    try:
        now = (await server_ms(redis_cluster)) // 1000
        for pid, age in (("old", 120), ("young", 10)):
            await client.lpush(KEYS.processing, pid)
            await client.set(KEYS.job(pid), envelope.encode(
                {"pid": pid, "queue": QUEUE, "timestamp": now - age, "payload": {}}
            ))
        assert (await consumer.maintain(force=True)).legacy == 1
        assert await client.lrange(KEYS.processing, 0, -1) == [b"young"]
        assert [d.pid for d in (await consumer.receive(10, 0)).deliveries] == ["old"]
    finally:
        await consumer.close()


# -- settlement -------------------------------------------------------------------------


async def test_stale_owner_changes_nothing(redis_cluster, broker, client):
    await publish(client, 1)
    [delivery] = (await broker.receive(10, 0)).deliveries
    await client.set(KEYS.owner(delivery.pid), b"0123456789abcdef0123456789abcdef")
    before = snapshot(redis_cluster)
    for settle in (broker.commit, broker.reject, broker.release):
        assert [r.outcome for r in await settle([delivery])] == [Outcome.STALE]
        assert snapshot(redis_cluster) == before
    assert await broker.extend([delivery]) == [False]
    after = snapshot(redis_cluster)
    after.pop(KEYS.supervisor("tester").encode())  # the renewal wrote the record
    after.pop(KEYS.supervisor_tokens.encode())  # and registered its token prefix
    assert after == before


async def test_each_item_of_a_grouped_settle_gets_its_own_result(redis_cluster, client):
    consumer = await new_broker(redis_cluster, max_attempts=3)
    try:
        await publish(client, 5)
        await publish(client, 1, attempts=2)  # its next reject is the last
        commit, retry, release, stale, missing, last = (await consumer.receive(10, 0)).deliveries
        await client.set(KEYS.owner(stale.pid), b"someone-else:9")
        await client.delete(KEYS.job(missing.pid))
        calls = count_script_calls(consumer)
        results = await consumer.settle([
            Settlement(Action.COMMIT, commit),
            Settlement(Action.REJECT, retry, "boom"),
            Settlement(Action.RELEASE, release),
            Settlement(Action.COMMIT, stale),
            Settlement(Action.RELEASE, missing),
            Settlement(Action.REJECT, last, "boom"),
        ])
        assert calls == [("settle", 6)]  # one script call for the whole group
        assert [r.outcome for r in results] == [
            Outcome.OK, Outcome.OK, Outcome.OK, Outcome.STALE, Outcome.MISSING, Outcome.OK,
        ]
        assert await counters(client) == {  # failed counts failed runs: retry and reject
            "total": 6, "processing": 2, "success": 1, "failed": 2,
        }
        assert await client.get(KEYS.owner(missing.pid)) == missing.receipt.encode()
        assert await client.get(KEYS.owner(stale.pid)) == b"someone-else:9"
        ready = await client.lrange(KEYS.ready, 0, -1)
        assert ready[-1] == release.raw
        assert orjson.loads(ready[0])["attempts"] == 1
        assert await client.lrange(KEYS.failed, 0, -1) == [last.pid.encode()]
        snapshot(redis_cluster)  # still all on one node
    finally:
        await consumer.close()


# -- script cache, placement, publishing ------------------------------------------------


async def test_script_cache_loss_on_the_slot_owner_loses_nothing(redis_cluster, broker, client):
    owner = redis_cluster.owner(SLOT)
    await publish(client, 4)
    reservation = await broker.reserve(10, 0)
    owner.client.script_flush()
    received = await broker.claim(reservation)
    assert len(received.deliveries) == 4
    owner.client.script_flush()
    assert [r.outcome for r in await broker.commit(received.deliveries[:2])] == [Outcome.OK] * 2
    owner.client.script_flush()
    assert await broker.extend(received.deliveries) == [False, False, True, True]
    redis_cluster.flush_scripts()
    assert (await broker.receive(10, 0)).deliveries == []
    owner.client.script_flush()
    assert (await broker.maintain(force=True)).total == 0
    assert await counters(client) == {"total": 4, "processing": 2, "success": 2, "failed": 0}


async def test_unsafe_placement_is_refused_before_any_message_moves(redis_cluster, client):
    ready = "utopia-queue.queue.stats-usage"
    raws = [envelope.build(QUEUE, {"n": n})[1] for n in range(3)]
    await client.lpush(ready, *raws)
    before = await client.lrange(ready, 0, -1)
    consumer = RedisBroker(redis_cluster.url, QUEUE, namespace="utopia-queue", cluster=True)
    try:
        with pytest.raises(PlacementError, match=r"\{utopia-queue\}"):
            await consumer.connect()
    finally:
        await consumer.close()
    assert await client.lrange(ready, 0, -1) == before
    assert sum(node.client.dbsize() for node in redis_cluster.nodes) == 1


async def test_publish_and_the_background_publisher(broker, client):
    first = await broker.publish(QUEUE, {"n": 0})
    more = await broker.publish_many(QUEUE, [{"n": n} for n in range(1, 1500)])
    publisher = Publisher(client, NS)
    late = [await publisher.enqueue(QUEUE, {"n": n}) for n in range(1500, 1600)]
    await publisher.close()
    taken = [orjson.loads(raw)["pid"] for raw in reversed(await client.lrange(KEYS.ready, 0, -1))]
    assert taken == [first, *more, *late]


@pytest.mark.usefixtures("no_url_override")
async def test_operator_commands_on_the_cluster(tmp_path, redis_cluster, client, capsys):
    conf = str(write_config(tmp_path, redis_cluster.url, handler="examples.noop:handle",
                            broker={"cluster": True, "namespace": NS}))
    consumer = RedisBroker(redis_cluster.url, "e2e", namespace=NS, cluster=True, lease=30)
    await consumer.connect()
    try:
        await consumer.publish_many("e2e", [{"n": n} for n in range(3)])
        [delivery] = (await consumer.receive(1, 0)).deliveries
        await consumer.reject([delivery], ["boom"])

        async def run(*args: str) -> tuple[int, str]:
            code = await asyncio.to_thread(cli.main, list(args))
            return code, capsys.readouterr().out

        code, out = await run("status", "--json", conf)
        status = orjson.loads(out)
        assert code == 0 and (status["ready"], status["processing"]) == (3, 0)
        assert status["stats"]["total"] == 1
        assert (await run("check", conf))[0] == 0
        assert (await run("recover", conf))[0] == 0
    finally:
        await consumer.close()


# -- the slot moves ---------------------------------------------------------------------


@pytest.fixture
def moving(redis_cluster: PrivateCluster):
    """The queue's slot may be migrated by the test; never left half-moved afterwards."""
    yield redis_cluster
    redis_cluster.stabilize(SLOT)


async def test_every_operation_follows_the_slot_to_another_master(moving, broker, client):
    await publish(client, 6)
    held = (await broker.receive(3, 0)).deliveries
    source = moving.owner(SLOT)
    moving.migrate_slot(SLOT, moving.other_than(source))
    assert moving.owner(SLOT) is not source

    assert await broker.extend(held) == [True] * 3
    assert [r.ok for r in await broker.commit(held[:2])] == [True, True]
    more = (await broker.receive(10, 0)).deliveries
    assert len(more) == 3
    assert (await broker.maintain(force=True)).total == 0
    assert [r.ok for r in await broker.commit([held[2], *more])] == [True] * 4
    await broker.publish(QUEUE, {"after": "move"})
    assert await counters(client) == {"total": 6, "processing": 0, "success": 6, "failed": 0}
    assert len(snapshot(moving)[KEYS.ready.encode()]) == 1


async def test_a_blocked_receive_follows_the_slot(moving, broker, client):
    blocked = asyncio.create_task(broker.receive(10, 4))

    async def registered() -> bool:
        return await client.zcard(KEYS.reservations) == 1

    await until(registered)  # blocked in BLMOVE on the old owner
    moving.migrate_slot(SLOT, moving.other_than(moving.owner(SLOT)))
    [pid] = await publish(client, 1)
    received = await blocked
    assert [d.pid for d in received.deliveries] == [pid]
    assert await client.zcard(KEYS.reservations) == 0
    assert await counters(client) == {"total": 1, "processing": 1, "success": 0, "failed": 0}


async def test_a_settle_during_the_migration_waits_for_it(moving, broker, client, monkeypatch):
    """Keys half moved: the slot's scripts get TRYAGAIN until the move completes."""
    await publish(client, 4)
    deliveries = (await broker.receive(10, 0)).deliveries
    refused: list[str] = []
    evalsha = broker.client.evalsha

    async def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return await evalsha(*args, **kwargs)
        except Exception as error:
            refused.append(type(error).__name__)
            raise

    monkeypatch.setattr(broker.client, "evalsha", watched)
    migration = moving.begin_migration(SLOT, moving.other_than(moving.owner(SLOT)))
    migration.move_keys([KEYS.processing])  # the rest stays behind for now
    settling = asyncio.create_task(broker.commit(deliveries))

    async def refused_once() -> bool:
        return bool(refused)

    await until(refused_once)
    assert not settling.done()
    await asyncio.to_thread(migration.finish)
    assert [r.outcome for r in await settling] == [Outcome.OK] * 4
    assert await counters(client) == {"total": 4, "processing": 0, "success": 4, "failed": 0}
    assert await client.llen(KEYS.processing) == 0


# -- end to end: python -m supervisor on the cluster --------------------------------------


@pytest.fixture
def sync_client(redis_cluster: PrivateCluster):
    connection = redis.RedisCluster.from_url(redis_cluster.url)
    yield connection
    connection.close()


@pytest.fixture
def start(tmp_path: Path, redis_cluster: PrivateCluster, supervisors):
    """Start supervisors on the cluster; every one of them is gone afterwards."""

    def starter(**sections: dict[str, Any]) -> Supervisor:
        sections["broker"] = {"cluster": True, "namespace": NS, **sections.get("broker", {})}
        config = write_config(tmp_path, redis_cluster.url, **sections)
        return supervisors(config, redis_cluster.url, namespace=NS, E2E_CLUSTER="1")

    return starter


def handled(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "handled")


def stop_cleanly(supervisor: Supervisor) -> None:
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(20) == 0, supervisor.output()
    assert "Traceback" not in supervisor.output()


@pytest.mark.slow
def test_e2e_prefetch_100_with_one_handler(tmp_path, sync_client, start):
    pids = publish_e2e(sync_client, [{"n": n, "sleep": 0.001} for n in range(1500)], NS)
    supervisor = start(job={"coroutines": 1, "prefetch": 100})
    samples = []
    while len(handled(tmp_path)) < len(pids):
        samples.append(outstanding(sync_client, NS))
        assert supervisor.process.poll() is None, supervisor.output()
        time.sleep(0.005)
    assert 1 < max(samples) <= 100
    assert sorted(handled(tmp_path)) == sorted(pids)
    wait_for(lambda: counter(sync_client, "success", NS) == len(pids), 10, "all commits")
    # on_success ran only after the commit was confirmed (checked by the handler).
    succeeded = wait_for(lambda: len(lines(tmp_path / "succeeded")) == len(pids) and
                         lines(tmp_path / "succeeded"), 10, "every on_success")
    assert {line.split()[1] for line in succeeded} == {"confirmed"}
    stop_cleanly(supervisor)
    assert counter(sync_client, "processing", NS) == 0
    assert outstanding(sync_client, NS) == 0


@pytest.mark.slow
def test_e2e_the_queue_slot_moves_while_a_supervisor_runs(
    tmp_path, redis_cluster, sync_client, start
):
    # 0.02 s each: ~7 s of work outlasts the migration, which must happen mid-run.
    pids = publish_e2e(sync_client, [{"n": n, "sleep": 0.02} for n in range(800)], NS)
    supervisor = start(job={"coroutines": 2, "prefetch": 50})
    wait_for(lambda: len(handled(tmp_path)) >= 100, 30, "the first messages")
    source = redis_cluster.owner(SLOT)
    try:
        # One key per MIGRATE: the queue spends a while half moved (ASK, TRYAGAIN).
        migration = redis_cluster.begin_migration(SLOT, redis_cluster.other_than(source))
        migration.move_keys(per_call=1)
        migration.finish()
    finally:
        redis_cluster.stabilize(SLOT)
    assert redis_cluster.owner(SLOT) is not source
    assert len(set(handled(tmp_path))) < len(pids)  # it really moved under a running supervisor
    pids += publish_e2e(sync_client, [{"after": "move"} for _ in range(50)], NS)

    wait_for(lambda: set(handled(tmp_path)) >= set(pids), 60, "every message handled")
    wait_for(lambda: outstanding(sync_client, NS) == 0, 20, "nothing outstanding")
    assert supervisor.process.poll() is None, supervisor.output()
    stop_cleanly(supervisor)
    k = e2e_keys(NS)
    assert sync_client.llen(k.ready) == 0 and sync_client.llen(k.processing) == 0
    assert counter(sync_client, "success", NS) >= len(pids)
    assert all(node.client.dbsize() == 0 for node in redis_cluster.nodes
               if node is not redis_cluster.owner(SLOT))


def test_e2e_a_namespace_without_hash_tag_is_refused(tmp_path, redis_cluster, sync_client,
                                                     start):
    pids = publish_e2e(sync_client, [{"n": n} for n in range(3)])  # utopia-queue.queue.e2e
    before = sync_client.lrange(e2e_keys().ready, 0, -1)
    supervisor = start(broker={"namespace": "utopia-queue"})
    assert supervisor.wait(20) == 2, supervisor.output()
    assert "{utopia-queue}" in supervisor.output()
    assert sync_client.lrange(e2e_keys().ready, 0, -1) == before
    assert handled(tmp_path) == [] and len(pids) == 3
