from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from support.operator import conf, run  # noqa: F401 (fixtures: an operator command run in-process)
from support.servers import NatsServer, RedisServer


@pytest.fixture(scope="session")
def redis_server():
    """One private redis-server per xdist worker; flushed by the ``redis_url`` fixture."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The URL of an empty private Redis (flushed data and script cache)."""
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.start()
    redis_server.cli("FLUSHALL")
    redis_server.cli("SCRIPT", "FLUSH")
    return redis_server.url


@pytest.fixture
def own_redis_server():
    """A private redis-server for one test, free to be killed and restarted."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
async def redis_client(redis_url: str):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def nats_server():
    server = NatsServer().start()
    yield server
    server.close()


@pytest.fixture
async def proxy(nats_server: NatsServer):
    """A fault proxy in front of this test's NATS (support.faultproxy): cut, stall, drop."""
    from support.faultproxy import FaultProxy

    fault = await FaultProxy(nats_server.port).start()
    yield fault
    await fault.close()


@pytest.fixture
async def js(nats_server: NatsServer):
    """A plain nats-py JetStream context on this test's NATS, for setting up and inspecting."""
    import nats

    client = await nats.connect(nats_server.url)
    yield client.jetstream()
    await client.close()


@pytest.fixture
async def redis_brokers(redis_url: str):
    """``await redis_brokers(queue, url=None, **options)``: a connected RedisBroker (on this
    test's Redis unless ``url`` is given); every one is closed afterwards."""
    from broker.redis import RedisBroker

    made: list[RedisBroker] = []

    async def make(queue: str, url: str | None = None, **options: Any) -> RedisBroker:
        broker = RedisBroker(url or redis_url, queue, **options)
        await broker.connect()
        made.append(broker)
        return broker

    yield make
    for broker in made:
        await broker.close()


@pytest.fixture
async def nats_brokers(nats_server: NatsServer):
    """``await nats_brokers(queue, url=None, **options)``: a connected NatsBroker (on this
    test's NATS unless ``url`` is given; a 2 s request timeout unless given); every one is
    closed afterwards."""
    from broker.nats import NatsBroker

    made: list[NatsBroker] = []

    async def make(queue: str, url: str | None = None, **options: Any) -> NatsBroker:
        options.setdefault("request_timeout", 2.0)
        broker = NatsBroker(url or nats_server.url, queue, **options)
        made.append(broker)
        await broker.connect()
        return broker

    yield make
    for broker in made:
        await broker.close()


@pytest.fixture
def no_url_override(monkeypatch):
    """QUEUE_BROKER_URL from the shell that runs the tests would replace every config's
    [broker] url; tests that load configs use this (``pytest.mark.usefixtures``)."""
    monkeypatch.delenv("QUEUE_BROKER_URL", raising=False)


@pytest.fixture(scope="session")
def redis_cluster_servers():
    """One private three-master Redis Cluster per xdist worker; see ``redis_cluster``."""
    from support.cluster import PrivateCluster

    cluster = PrivateCluster().start()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_cluster(redis_cluster_servers):
    """The private cluster, emptied (data and script caches) for this test."""
    redis_cluster_servers.wait_ok()
    redis_cluster_servers.flush()
    return redis_cluster_servers


@pytest.fixture(scope="session")
def replicated_cluster_servers():
    """One private Redis Cluster of three masters with a replica each, per xdist worker;
    see ``replicated_cluster``. A 2 s node timeout: a killed master's replica takes over
    within about 5 s."""
    from support.cluster import PrivateCluster

    cluster = PrivateCluster(replicas=1, node_timeout=2000).start()
    yield cluster
    cluster.close()


@pytest.fixture
def replicated_cluster(replicated_cluster_servers):
    """The replicated cluster with every node up and replicating, emptied for this test;
    healed again afterwards (a test kills masters and cuts replication links)."""
    replicated_cluster_servers.heal()
    replicated_cluster_servers.flush()
    yield replicated_cluster_servers
    replicated_cluster_servers.heal()


@pytest.fixture
def client(redis_url: str):
    """A plain redis-py client on this test's Redis."""
    import redis

    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture
def supervisors(tmp_path):
    """``launch(config, redis_url="", **options)`` runs ``python -m supervisor`` for this
    test (see support.supervision.Supervisor); every one of them is gone afterwards."""
    from support.supervision import Supervisor

    started: list[Supervisor] = []

    def launch(config, redis_url: str = "", **options) -> Supervisor:
        supervisor = Supervisor(config, tmp_path, redis_url, **options)
        started.append(supervisor)
        return supervisor

    yield launch
    for supervisor in started:
        supervisor.stop()


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A CA with server and client certificates for 127.0.0.1/localhost (and one for
    another name), made with openssl once per test process."""
    from tests.tls import Certificates

    return Certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def children():
    """``children(handler, **options)``: a handler process on its own fork server
    (support.handler_child.Child); every one is stopped afterwards."""
    from support.handler_child import Child

    started: list[Child] = []

    def start_child(handler: Any, **options: Any) -> Child:
        child = Child(handler, **options)
        started.append(child)
        return child

    yield start_child
    for child in started:
        child.close()


@pytest.fixture
def steady(redis_url):
    """Publishes 200 no-op jobs a second onto the end-to-end queue until the test ends."""
    import threading

    import redis

    from support import envelopes
    from support.supervision import QUEUE, keys

    stop = threading.Event()
    client = redis.Redis.from_url(redis_url)

    def publish() -> None:
        while not stop.wait(0.05):
            client.lpush(keys().ready, *[raw for _, raw in envelopes.of(QUEUE, [{}] * 10)])

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    yield stop
    stop.set()
    thread.join(5)
    client.close()


@pytest.fixture
def dashboards(tmp_path):
    """``start(*configs, token=None, **options)`` runs ``python -m supervisor dashboard`` for
    this test (support.dashboard.Dashboard; ``interval`` among the options); every one of
    them is stopped afterwards."""
    from support.dashboard import Dashboard

    started: list[Dashboard] = []

    def start(*configs, token=None, **options):
        dashboard = Dashboard(list(configs), tmp_path, token=token, **options)
        started.append(dashboard)
        return dashboard

    yield start
    for dashboard in started:
        dashboard.stop()
