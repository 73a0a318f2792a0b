"""Failovers of a Redis Cluster with replicas: what a failover can take back, and what each
taken-back write costs (a duplicate run, or a loss), without and with ``wait_replicas``.

Replication is asynchronous: a master acknowledges a write before its replica has it. To
make "acknowledged but not replicated" happen on purpose, a test cuts the replication link
of the queue's master (``cut_replication``), writes, SIGKILLs that master and promotes its
replica at once (``CLUSTER FAILOVER TAKEOVER``): the new master then lacks exactly the
writes made after the cut. That is the worst case of a real crash, where only the last
fraction of a millisecond is usually missing.

Found here (docs/redis-cluster.md, "Failover", has the table), per write taken back:

- a producer's push: the message is lost. With wait_replicas, publish raises NotReplicated
  instead of returning, and the producer publishes again.
- a reservation and its claim: the payloads are back in ready, each runs again (duplicates).
  With wait_replicas a handler starts only deliveries a replica has.
- a commit: the delivery is recovered once its lease runs out and runs again (duplicate).
  With wait_replicas a commit is confirmed only once a replica has it.
- the registration of a blocking receive: the client repeats its BLMOVE on the new master,
  into a list no registry names; lost if the receiver dies before it claims. With
  wait_replicas no blocking move starts before a replica has the registration.
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
from redis.cluster import ClusterNode as SyncClusterNode
from redis.crc import key_slot

from broker.base import Outcome
from broker.redis import RedisBroker, seeds
from broker.redis.keys import QueueKeys
from broker.redis.replication import NotReplicated, Replication
from support.cluster import ClusterNode, PrivateCluster
from support.envelopes import publish as publish_e2e
from support.supervision import Supervisor, lines, outstanding, wait_for, write_config
from support.supervision import keys as e2e_keys
from support.waiting import until

NS = "{utopia-queue}"
QUEUE = "stats-usage"
KEYS = QueueKeys(NS, QUEUE)
SLOT = key_slot(b"utopia-queue")
#: WAIT's timeout when the link is cut: short, the answer is known to be 0.
CUT_WAIT = Replication(1, 0.2)


async def new_broker(cluster: PrivateCluster, **options: Any) -> RedisBroker:
    # Reservation deadlines are whole seconds (now + lease): with a 1 s lease a claim made
    # even a few ms after its reserve expires whenever a second boundary falls between them
    # (a replicated claim waits up to CUT_WAIT first). 5 s leaves 4 s for a loaded machine.
    options = {"namespace": NS, "cluster": True, "consumer_id": "tester", "lease": 5.0,
               **options}
    broker = RedisBroker(cluster.seed_url, QUEUE, **options)
    await broker.connect()
    return broker


@pytest.fixture
async def client(replicated_cluster: PrivateCluster):
    connection = seeds.cluster_client(replicated_cluster.seed_url)  # any node may be down
    yield connection
    await connection.aclose()


@pytest.fixture
async def brokers(replicated_cluster: PrivateCluster):
    """``make(**options)``: a consumer of the queue, closed after the test."""
    made: list[RedisBroker] = []

    async def make(**options: Any) -> RedisBroker:
        broker = await new_broker(replicated_cluster, consumer_id=f"c{len(made)}", **options)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        await broker.close()


@pytest.fixture
async def synced(brokers):
    """``await synced()``: every write so far is on the replica. (A WAIT counts for its
    own connection's last write, and replication is in order: a later write confirmed
    confirms all earlier ones; a marker in another queue of the slot is that write.)"""
    syncer = await brokers(replication=Replication(1, 5.0))

    async def sync() -> None:
        await syncer.publish("sync", {})

    return sync


def cut(cluster: PrivateCluster) -> tuple[ClusterNode, ClusterNode]:
    """The queue's master, whose writes from now on reach no replica, and that replica."""
    master = cluster.owner(SLOT)
    replica = cluster.replica_of(master)
    master.cut_replication()
    return master, replica


def take_back(cluster: PrivateCluster, master: ClusterNode, replica: ClusterNode) -> None:
    """SIGKILL the master; its replica takes over with what it had at the cut."""
    master.kill()
    cluster.failover(replica, "TAKEOVER")


async def ready(client: RedisCluster) -> int:
    return await client.llen(KEYS.ready)


# -- a producer's push ------------------------------------------------------------------


@pytest.mark.slow
async def test_a_push_taken_back_is_lost(replicated_cluster, brokers, client):
    producer = await brokers()
    master, replica = cut(replicated_cluster)
    pids = await producer.publish_many(QUEUE, [{"n": n} for n in range(3)])
    assert len(pids) == 3 and await ready(client) == 3  # acknowledged by the master
    take_back(replicated_cluster, master, replica)
    assert await ready(client) == 0  # gone: the producer was told it was published


@pytest.mark.slow
async def test_with_wait_replicas_a_push_is_confirmed_or_refused(
    replicated_cluster, brokers, client
):
    producer = await brokers(replication=Replication(1, 2.0))
    await producer.publish(QUEUE, {"n": 0})  # the replica confirmed it
    careful = await brokers(replication=CUT_WAIT)
    master, replica = cut(replicated_cluster)
    with pytest.raises(NotReplicated, match="0 of 1 replicas"):
        await careful.publish_many(QUEUE, [{"n": n} for n in range(1, 4)])
    take_back(replicated_cluster, master, replica)
    assert await ready(client) == 1  # only what was confirmed survived
    with pytest.raises(NotReplicated):  # the new master has no replica yet
        await careful.publish(QUEUE, {"n": 1})
    replicated_cluster.revive(master)  # back, as the new master's replica
    await producer.publish_many(QUEUE, [{"n": n} for n in range(1, 4)])  # the retry
    assert await ready(client) == 5  # one refused on the replica-less master, kept there


# -- a reservation and its claim ----------------------------------------------------------


@pytest.mark.slow
async def test_a_claim_taken_back_runs_its_deliveries_again(
    replicated_cluster, brokers, client, synced
):
    first, second = await brokers(), await brokers()
    pids = await first.publish_many(QUEUE, [{"n": n} for n in range(5)])
    await synced()
    master, replica = cut(replicated_cluster)
    taken = (await first.receive(10, 0)).deliveries  # reserved and claimed on the master
    assert [d.pid for d in taken] == pids
    take_back(replicated_cluster, master, replica)

    assert await ready(client) == 5  # both scripts taken back: ready again, no loss
    assert [r.outcome for r in await first.commit(taken)] == [Outcome.STALE] * 5
    again = (await second.receive(10, 0)).deliveries
    assert [d.pid for d in again] == pids  # a second run of each: 5 duplicates
    assert [r.ok for r in await second.commit(again)] == [True] * 5


@pytest.mark.slow
async def test_with_wait_replicas_a_claim_no_replica_has_is_counted(
    replicated_cluster, brokers
):
    consumer = await brokers(replication=Replication(1, 5.0))
    await consumer.publish_many(QUEUE, [{"n": n} for n in range(4)])  # confirmed
    consumer.replication = CUT_WAIT
    cut(replicated_cluster)
    taken = (await consumer.receive(10, 0)).deliveries
    assert len(taken) == 4 and consumer.unreplicated == 4  # logged: may run twice


# -- a commit -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_commit_taken_back_is_recovered_and_run_again(
    replicated_cluster, brokers, client, synced
):
    first, second = await brokers(lease=3), await brokers()  # first's claims lapse in 3 s
    await first.extend([])  # its first renewal, at start: recovery knows its tokens for ours
    pids = await first.publish_many(QUEUE, [{"n": n} for n in range(3)])
    taken = (await first.receive(10, 0)).deliveries
    await synced()  # the claims (and its record and registration) are on the replica
    master, replica = cut(replicated_cluster)
    assert [r.outcome for r in await first.commit(taken)] == [Outcome.OK] * 3
    take_back(replicated_cluster, master, replica)

    assert sorted(await client.lrange(KEYS.processing, 0, -1)) == sorted(
        pid.encode() for pid in pids
    )  # still owned by first, which forgot them: its lease (claims and record) runs out

    async def recovered() -> bool:
        return (await second.maintain(force=True)).total == 3

    await until(recovered, timeout=10)
    again = (await second.receive(10, 0)).deliveries
    assert sorted(d.pid for d in again) == sorted(pids)  # 3 duplicates, attempts + 1
    assert all(d.attempts == 1 for d in again)


@pytest.mark.slow
async def test_with_wait_replicas_a_commit_no_replica_has_is_counted(
    replicated_cluster, brokers
):
    consumer = await brokers(replication=CUT_WAIT)
    await consumer.publish_many(QUEUE, [{"n": n} for n in range(3)])
    taken = (await consumer.receive(10, 0)).deliveries
    cut(replicated_cluster)
    assert [r.ok for r in await consumer.commit(taken)] == [True] * 3
    assert consumer.unreplicated == 3


# -- the registration of a blocking receive -----------------------------------------------


@pytest.mark.slow
async def test_a_registration_taken_back_can_strand_a_payload(
    replicated_cluster, brokers, client
):
    receiver, other = await brokers(), await brokers()
    master, replica = cut(replicated_cluster)
    blocked = asyncio.create_task(receiver.reserve(10, 5.0))

    async def registered() -> bool:
        return await client.zcard(KEYS.reservations) == 1

    await until(registered)  # registered on the master only

    async def blocking() -> bool:  # and its BLMOVE waits there: the failover interrupts it
        return master.client.info("clients")["blocked_clients"] >= 1

    await until(blocking)
    [key] = await client.zrange(KEYS.reservations, 0, -1)
    take_back(replicated_cluster, master, replica)
    assert await client.zcard(KEYS.reservations) == 0  # the registration is gone...
    [pid] = await other.publish_many(QUEUE, [{"n": 0}])
    reservation = await blocked  # ...but the client repeated the BLMOVE on the new master
    assert len(reservation.payloads) == 1
    # The receiver dies here, before its claim: nothing names the list any more.
    assert (await other.maintain(force=True)).total == 0
    assert await client.lrange(key, 0, -1) == reservation.payloads
    assert await ready(client) == 0 and await client.zcard(KEYS.reservations) == 0
    assert await other.oldest_ready_age() is None  # and no consumer will ever see it
    # (Had the receiver lived, its claim would have found the reservation unregistered and
    # put the payload back on the ready list.)
    assert orjson.loads(reservation.payloads[0])["pid"] == pid


@pytest.mark.slow
async def test_with_wait_replicas_no_blocking_move_without_a_replicated_registration(
    replicated_cluster, brokers, client, monkeypatch
):
    receiver = await brokers(replication=CUT_WAIT)
    moves: list[tuple] = []
    monkeypatch.setattr(receiver._blocking._blocking, "blmove", lambda *args: moves.append(args))
    master, replica = cut(replicated_cluster)
    reservation = await receiver.reserve(10, 5.0)  # the registration was not confirmed
    assert reservation.payloads == [] and receiver.unreplicated == 1
    assert moves == []  # so no BLMOVE was sent
    assert await client.zcard(KEYS.reservations) == 0  # withdrawn: it never blocked
    take_back(replicated_cluster, master, replica)
    await (await brokers()).publish_many(QUEUE, [{"n": 0}])
    assert await ready(client) == 1  # where any consumer finds it


async def test_a_receive_blocked_during_a_manual_failover_returns_and_follows(
    replicated_cluster, brokers, client
):
    """The old master lets blocked clients go ("UNBLOCKED ... master -> replica"): the
    receive ends empty, not with an error that would stop the supervisor."""
    receiver = await brokers()
    blocked = asyncio.create_task(receiver.receive(10, 5.0))

    async def registered() -> bool:
        return await client.zcard(KEYS.reservations) == 1

    await until(registered)
    master = replicated_cluster.owner(SLOT)

    async def blocking() -> bool:  # its BLMOVE waits on the master itself
        return master.client.info("clients")["blocked_clients"] >= 1

    await until(blocking)
    replicated_cluster.failover(replicated_cluster.replica_of(master))
    assert (await blocked).deliveries == []
    [pid] = await receiver.publish_many(QUEUE, [{"n": 0}])
    assert [d.pid for d in (await receiver.receive(10, 1.0)).deliveries] == [pid]


async def test_seed_list_starts_while_a_seed_is_down(replicated_cluster):
    down = replicated_cluster.replica_of(replicated_cluster.owner(SLOT))
    down.kill()  # a replica: every slot stays served
    url = ",".join([down.url, *(node.url for node in replicated_cluster.nodes
                                if node is not down)])
    broker = RedisBroker(url, QUEUE, namespace=NS, cluster=True)
    await broker.connect()  # the first seed is dead: the next one answers
    try:
        [pid] = await broker.publish_many(QUEUE, [{"n": 0}])
        assert [d.pid for d in (await broker.receive(1, 0)).deliveries] == [pid]
    finally:
        await broker.close()


# -- end to end: supervisors follow the new master ----------------------------------------


@pytest.fixture
def sync_client(replicated_cluster: PrivateCluster):
    nodes = [SyncClusterNode("127.0.0.1", node.port) for node in replicated_cluster.nodes]
    connection = redis.RedisCluster(startup_nodes=nodes)
    yield connection
    connection.close()


def start_supervisors(tmp_path: Path, cluster: PrivateCluster, launch, count: int,
                      **broker: Any) -> list[Supervisor]:
    config = write_config(
        tmp_path, cluster.seed_url, job={"coroutines": 1, "prefetch": 20},
        broker={"cluster": True, "namespace": NS, **broker},
    )
    # No on_success check against Redis (E2E_REDIS empty): it would connect per message.
    return [launch(config, "", namespace=NS) for _ in range(count)]


def run_through_failover(tmp_path: Path, cluster: PrivateCluster, sync_client, launch,
                         fail_over, again_when_idle: bool = False) -> dict[str, float]:
    """Two supervisors consume 1,500 messages; ``fail_over(master, replica)`` strikes the
    queue's master after the first 300 (and, ``again_when_idle``, once more while both wait
    on the empty queue, after which 50 more are published). Returns what happened, and
    checks that nothing is lost or stuck and that both supervisors lived through it."""
    pids = publish_e2e(sync_client, [{"n": n, "sleep": 0.002} for n in range(1500)], NS)
    running = start_supervisors(tmp_path, cluster, launch, 2)
    wait_for(lambda: len(lines(tmp_path / "handled")) >= 300, 60, "the first 300")
    master = cluster.owner(SLOT)
    replica = cluster.replica_of(master)
    struck = time.monotonic()
    before = len(lines(tmp_path / "handled"))
    fail_over(master, replica)
    promoted = time.monotonic() - struck
    # Past what the two prefetch buffers held at the strike: new receives were needed.
    wait_for(lambda: len(lines(tmp_path / "handled")) > before + 60, 60, "progress")
    resumed = time.monotonic() - struck
    wait_for(lambda: set(lines(tmp_path / "handled")) >= set(pids), 90, "every message")
    wait_for(lambda: outstanding(sync_client, NS) == 0, 30, "nothing outstanding")
    if again_when_idle:
        time.sleep(1.5)  # both blocked in BLMOVE on the master (block_timeout 1 s)
        master = cluster.owner(SLOT)
        fail_over(master, cluster.replica_of(master))
        pids += publish_e2e(sync_client, [{"after": n} for n in range(50)], NS)
        wait_for(lambda: set(lines(tmp_path / "handled")) >= set(pids), 60, "the 50 more")
        wait_for(lambda: outstanding(sync_client, NS) == 0, 30, "nothing outstanding")
    for supervisor in running:
        assert supervisor.process.poll() is None, supervisor.output()  # followed, no restart
    handled = lines(tmp_path / "handled")
    assert sync_client.llen(e2e_keys(NS).ready) == 0
    for supervisor in running:
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0, supervisor.output()
    return {"messages": len(pids), "handled": len(handled),
            "duplicates": len(handled) - len(set(handled)), "lost": len(set(pids) - set(handled)),
            "promoted_s": round(promoted, 2), "resumed_s": round(resumed, 2)}


@pytest.mark.slow
def test_e2e_supervisors_follow_a_killed_master(tmp_path, replicated_cluster, sync_client,
                                               supervisors):
    def kill(master: ClusterNode, replica: ClusterNode) -> None:
        master.kill()  # SIGKILL; the replica is elected after the node timeout
        replicated_cluster.wait_promoted(replica, 30)

    result = run_through_failover(tmp_path, replicated_cluster, sync_client, supervisors, kill)
    print("SIGKILL of the master:", result)
    assert result["lost"] == 0


@pytest.mark.slow
def test_e2e_supervisors_follow_a_manual_failover(tmp_path, replicated_cluster, sync_client,
                                                 supervisors):
    def manual(master: ClusterNode, replica: ClusterNode) -> None:
        replicated_cluster.failover(replica)  # CLUSTER FAILOVER: the replica catches up first

    result = run_through_failover(tmp_path, replicated_cluster, sync_client, supervisors,
                                  manual, again_when_idle=True)
    print("CLUSTER FAILOVER:", result)
    assert result["lost"] == 0
