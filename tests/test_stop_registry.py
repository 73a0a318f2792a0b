"""A graceful stop leaves nothing registered (issue 23.4).

An idle supervisor waits in BLMOVE into a registered, empty reservation. At a stop it ends
that wait with CLIENT UNBLOCK (from its other connection) and only then unregisters the
reservation: once Redis answered, no move into the list can follow. Before, the wait was
abandoned and the reservation left registered with deadline 0 until someone's maintenance
removed it, so ``check`` exited 1 right after a clean stop.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest
import redis

from broker.redis import RedisBroker
from broker.redis.keys import QueueKeys
from support.servers import environ_without_broker
from support.supervision import NAMESPACE, QUEUE, ROOT, Supervisor, wait_for, write_config

KEYS = QueueKeys(NAMESPACE, QUEUE)


def blocked_clients(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])


def check(config) -> subprocess.CompletedProcess[str]:
    env = {**environ_without_broker(), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "supervisor", "check", str(config)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


async def test_stop_waiting_unblocks_and_unregisters(redis_url, client):
    broker = RedisBroker(redis_url, QUEUE, namespace=NAMESPACE, lease=30)
    await broker.connect()
    try:
        waiting = asyncio.ensure_future(broker.receive(10, 60))
        await asyncio.to_thread(wait_for, lambda: blocked_clients(client) == 1, 10,
                                "the BLMOVE")
        assert client.zcard(KEYS.reservations) == 1
        broker.stop_waiting()
        received = await asyncio.wait_for(waiting, 30)  # not the 60 s of the BLMOVE
        assert received.deliveries == []
        assert client.zcard(KEYS.reservations) == 0
        assert blocked_clients(client) == 0
        # A message published now stays ready: no move can land in a list nobody names.
        client.lpush(KEYS.ready, b"x")
        assert client.llen(KEYS.ready) == 1
        assert not list(client.scan_iter(match=KEYS.reservation("") + "*"))
    finally:
        await broker.close()


async def test_without_client_unblock_a_stop_still_strands_nothing(redis_url, client):
    """An ACL from before (no CLIENT ID): the wait is abandoned, its reservation marked
    expired for maintenance, as before."""
    client.execute_command("ACL", "SETUSER", "old", "on", ">pw", "~*", "+@all", "-client")
    url = redis_url.replace("redis://", "redis://old:pw@")
    broker = RedisBroker(url, QUEUE, namespace=NAMESPACE, lease=30)
    await broker.connect()
    try:
        waiting = asyncio.ensure_future(broker.receive(10, 60))
        await asyncio.to_thread(wait_for, lambda: blocked_clients(client) == 1, 10,
                                "the BLMOVE")
        broker.stop_waiting()
        assert (await asyncio.wait_for(waiting, 30)).deliveries == []
        assert client.zscore(KEYS.reservations, client.zrange(KEYS.reservations, 0, 0)[0]) == 0
        await broker.maintain(force=True)
    finally:
        await broker.close()
        client.execute_command("ACL", "DELUSER", "old")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigterm_of_an_idle_supervisor_leaves_the_registry_empty(tmp_path, redis_url, client):
    config = write_config(tmp_path, redis_url, broker={"block_timeout": 60},
                          supervisor={"lease": 30, "shutdown_deadline": 20})
    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        wait_for(lambda: blocked_clients(client) == 1, 30, "the idle supervisor's BLMOVE")
        assert client.zcard(KEYS.reservations) == 1
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(40) == 0, supervisor.output()
    finally:
        supervisor.stop()
    assert client.zcard(KEYS.reservations) == 0
    checked = check(config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok: no reservation and no owner record" in checked.stdout


async def test_on_a_cluster_too(redis_cluster):
    from redis.asyncio.cluster import RedisCluster

    keys = QueueKeys("{utopia-queue}", QUEUE)
    client = RedisCluster.from_url(redis_cluster.url)
    broker = RedisBroker(redis_cluster.url, QUEUE, namespace="{utopia-queue}", cluster=True,
                         lease=30)
    await broker.connect()
    node = client.get_node_from_key(keys.ready) if await client.ping() else None

    async def blocked() -> int:
        info = await client.info("clients", target_nodes=node)
        return int(info["blocked_clients"])

    try:
        waiting = asyncio.ensure_future(broker.receive(10, 60))
        for _ in range(500):
            if await blocked() == 1:
                break
            await asyncio.sleep(0.02)
        assert await client.zcard(keys.reservations) == 1
        broker.stop_waiting()
        assert (await asyncio.wait_for(waiting, 30)).deliveries == []
        assert await client.zcard(keys.reservations) == 0
        assert await blocked() == 0
    finally:
        await broker.close()
        await client.aclose()


@pytest.mark.timeout(90)
def test_sigterm_of_an_idle_supervisor_on_a_cluster(tmp_path, redis_cluster, supervisors):
    namespace = "{utopia-queue}"
    keys = QueueKeys(namespace, QUEUE)
    client = redis.RedisCluster.from_url(redis_cluster.url)
    node = client.get_node_from_key(keys.ready)
    config = write_config(tmp_path, redis_cluster.url,
                          broker={"block_timeout": 60, "cluster": True, "namespace": namespace},
                          supervisor={"lease": 30, "shutdown_deadline": 20})
    supervisor = supervisors(config, redis_cluster.url, namespace=namespace, E2E_CLUSTER="1")
    try:
        wait_for(lambda: int(client.info("clients", target_nodes=node)["blocked_clients"]) == 1,
                 30, "the idle supervisor's BLMOVE")
        assert client.zcard(keys.reservations) == 1
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(40) == 0, supervisor.output()
        assert client.zcard(keys.reservations) == 0
        checked = check(config)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        client.close()
