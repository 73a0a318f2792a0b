"""The queue gauges operators alert on (issue 25 item 3): each has the value a known
setup gives it, read by the broker's sampler and served by the metrics endpoint."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.gauges import QueueGauges
from broker.nats import gauges as nats_gauges
from broker.redis import gauges as redis_gauges
from supervisor import metrics
from supervisor.gauges import Leadership
from support.brokers import receive_all
from support.envelopes import fresh, lpush_each, publish_nats
from support.servers import NatsCluster, free_port

QUEUE = "gauges"


def scrape(port: int, queue: str = QUEUE) -> dict[str, float]:
    """Every sample of the queue's series, by name (the other labels are dropped)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("queue") == queue
    }


async def test_redis_gauges_after_a_known_setup(redis_brokers, redis_client):
    broker = await redis_brokers(QUEUE)
    keys = broker.keys
    # The next one to be received (the tail) was published two minutes ago.
    old = fresh(QUEUE, 1, timestamp=int(time.time()) - 120)
    await lpush_each(redis_client, keys.ready, old + fresh(QUEUE, 4))
    await redis_client.rpush(keys.failed, "f1", "f2")
    await redis_client.rpush(keys.dead, "d1", "d2", "d3")
    await redis_client.rpush(keys.poison, b"{not json")
    await redis_client.rpush(keys.processing, "p1", "p2", "p3", "p4")
    # The first was due 40 s ago and is still there: nobody promoted it (issue 39.3).
    server_now = int((await redis_client.time())[0])
    await redis_client.zadd(keys.delayed, {b"e1": server_now - 40, b"e2": server_now + 90})
    now = int(time.time())
    await redis_client.hset(keys.supervisor_tokens, mapping={
        "a" * 16: f"{now + 30} host-1", "b" * 16: f"{now + 60} host-2",
        "c" * 16: f"{now - 30} host-3",  # its last renewal's lease ran out: gone
    })

    sample = await redis_gauges.sample(broker)

    assert (sample.ready, sample.failed, sample.dead, sample.poison) == (5, 2, 3, 1)
    assert (sample.processing, sample.delayed, sample.supervisors_alive) == (4, 2, 2)
    assert 40 <= sample.delayed_overdue < 100
    assert 120 <= sample.oldest_ready_age < 180
    assert (sample.reconnects, sample.unreplicated, sample.leader) == (0, 0, None)

    served = metrics.start(QUEUE, free_port())
    try:
        served.gauges(sample)
        scraped = scrape(served.port)
    finally:
        served.close()
    expected = {"ready_messages": 5, "failed_messages": 2, "dead_messages": 3,
                "poison_messages": 1, "processing_messages": 4, "delayed_messages": 2,
                "supervisors_alive": 2, "broker_reconnects_total": 0,
                "unreplicated_writes_total": 0, "broker_up": 1}
    for name, value in expected.items():
        assert scraped[f"queue_supervisor_{name}"] == value, name
    assert scraped["queue_supervisor_oldest_ready_age_seconds"] >= 120
    assert scraped["queue_supervisor_delayed_overdue_seconds"] >= 40
    assert "queue_supervisor_nats_leaderless_seconds" not in scraped  # NATS only


async def test_an_empty_redis_queue_reads_zero_and_no_age(redis_brokers):
    sample = await redis_gauges.sample(await redis_brokers(QUEUE))
    assert sample.ready == sample.failed == sample.supervisors_alive == 0
    assert sample.delayed_overdue == 0.0
    assert sample.oldest_ready_age == 0.0


async def test_a_reading_the_acl_refuses_is_left_out_not_zero(redis_brokers, redis_client):
    broker = await redis_brokers(QUEUE)
    await redis_client.set(broker.keys.delayed, "not a sorted set")  # ZCARD answers WRONGTYPE
    sample = await redis_gauges.sample(broker)
    assert sample.delayed is None and sample.ready == 0
    served = metrics.start(QUEUE, free_port())
    try:
        served.gauges(sample)
        scraped = scrape(served.port)
    finally:
        served.close()
    assert "queue_supervisor_delayed_messages" not in scraped
    assert scraped["queue_supervisor_ready_messages"] == 0


async def test_nats_gauges_come_from_the_consumer_and_the_dead_stream(nats_brokers,
                                                                      nats_server):
    broker = await nats_brokers(QUEUE)
    names = broker.names
    await publish_nats(nats_server.url, names.subject, fresh(QUEUE, 3))
    await publish_nats(nats_server.url, names.dead_subject, fresh(QUEUE, 2))
    await receive_all(broker, 1)  # held: one ack pending, two waiting

    sample = await nats_gauges.sample(broker)

    assert (sample.ready, sample.processing, sample.dead) == (2, 1, 2)
    assert sample.redelivered == 0 and sample.reconnects == 0 and sample.leader is True
    assert 0 <= sample.oldest_ready_age < 60
    assert sample.failed is None and sample.poison is None  # no such lists on NATS


@pytest.mark.slow
async def test_nats_leaderless_when_the_cluster_lost_its_quorum(tmp_path):
    from broker.nats import NatsBroker

    cluster = NatsCluster().start()
    broker = NatsBroker(cluster.url, QUEUE, replicas=3, request_timeout=2.0)
    try:
        await broker.connect()
        assert (await nats_gauges.sample(broker)).leader is True
        for server in cluster.servers[1:]:  # two of three gone: no quorum, no leader
            server.stop()
        leadership = Leadership()
        deadline = time.monotonic() + 60
        while (sample := await _sample_or_none(broker)) is None or sample.leader:
            assert time.monotonic() < deadline, "the API kept answering without a quorum"
        assert leadership.seen(sample).leaderless_seconds == 0.0  # from this sample on
    finally:
        await broker.close()
        cluster.close()


async def _sample_or_none(broker) -> QueueGauges | None:
    from broker.base import BrokerError

    try:
        return await nats_gauges.sample(broker)
    except BrokerError:
        return None  # the connection itself went: try the next server


def test_leaderless_time_counts_from_the_first_sample_without_a_leader():
    now = [100.0]
    leadership = Leadership(clock=lambda: now[0])
    assert leadership.seen(QueueGauges(leader=True)).leaderless_seconds == 0.0
    now[0] = 105.0
    assert leadership.seen(QueueGauges(leader=False)).leaderless_seconds == 0.0
    now[0] = 117.0
    assert leadership.seen(QueueGauges(leader=False)).leaderless_seconds == 12.0
    now[0] = 120.0
    assert leadership.seen(QueueGauges(leader=True)).leaderless_seconds == 0.0
    assert leadership.seen(QueueGauges(ready=1)).leaderless_seconds is None  # Redis


@pytest.mark.parametrize("field", sorted(metrics.QUEUE_GAUGES) + sorted(metrics.QUEUE_COUNTERS))
def test_every_gauge_is_a_field_of_the_sample(field):
    assert field in QueueGauges.__dataclass_fields__


async def test_redis_cluster_gauges_from_the_node_of_the_queue(redis_cluster):
    from redis.asyncio.cluster import RedisCluster

    from broker.redis import RedisBroker

    broker = RedisBroker(redis_cluster.url, QUEUE, namespace="{ns}", cluster=True)
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        await broker.connect()
        await lpush_each(client, broker.keys.ready, fresh(QUEUE, 3))
        await client.rpush(broker.keys.dead, "d1")
        await broker.extend([])  # registers this supervisor in the token registry
        sample = await redis_gauges.sample(broker)
    finally:
        await client.aclose()
        await broker.close()
    assert (sample.ready, sample.dead, sample.failed, sample.supervisors_alive) == (3, 1, 0, 1)
    assert sample.reconnects is None  # redis-py's cluster client reconnects by itself


@pytest.mark.slow
async def test_writes_no_replica_confirmed_are_counted(redis_brokers, redis_client):
    from broker.redis.replication import Replication

    # A server without replicas: WAIT 1 times out, every claimed delivery counts.
    broker = await redis_brokers(QUEUE, replication=Replication(replicas=1, timeout=1.0))
    await lpush_each(redis_client, broker.keys.ready, fresh(QUEUE, 2))
    await receive_all(broker, 2)
    sample = await redis_gauges.sample(broker)
    assert sample.unreplicated == broker.unreplicated >= 2
