"""The soak on a Redis Cluster with replicas, and its ``failover`` fault.

Three masters with a replica each (``support.cluster``, node timeout 2 s); the queue is
hash-tagged (``{utopia-queue}``) and the supervisors get every node as a seed. The
``failover`` fault alternates a manual ``CLUSTER FAILOVER`` (the replica catches up first)
and a SIGKILL of the queue's master (its replica is elected after the node timeout; the
killed node is started again and rejoins as a replica).

Replication is asynchronous: a push acknowledged by a master that is then killed can be
taken back by the failover (see docs/redis-cluster.md, "Failover"). The soak's producer is
not what is under test, so, as on the single server (where publishing pauses across a
restart), its pushes wait for the replica (``WAIT 1``) and pause across a failover: every
message is published exactly once and known to the cluster. The supervisors keep the
default ``wait_replicas = 0``; whatever of theirs a failover takes back must only cost
duplicate runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from bench.chaos.sides import RedisSide
from broker.redis import seeds
from broker.redis.keys import QueueKeys
from broker.redis.replication import Replication, write_and_wait
from support.cluster import PrivateCluster
from support.soak_workload import Message

NAMESPACE = "{utopia-queue}"
SLOT = key_slot(b"utopia-queue")
CONFIRMED = Replication(1, 5.0)


class RedisClusterSide(RedisSide):
    name = "redis-cluster"
    # No connection_kill (CLIENT KILL is per node) and no broker_restart (the failover is
    # this side's server fault).
    faults = ("handler_kill", "supervisor_kill", "supervisor_term", "script_flush", "failover")

    def __init__(self, queue: str) -> None:
        super().__init__(queue)
        self.keys = QueueKeys(NAMESPACE, queue)
        self.cluster = PrivateCluster(replicas=1, node_timeout=2000)
        self.failovers = 0
        self._pushing = asyncio.Lock()  # held by a push in flight; a failover waits for it

    @property
    def supervisor_url(self) -> str:
        return self.cluster.seed_url

    def config_sections(self, settings: Any) -> dict[str, dict[str, Any]]:
        return {"broker": {"cluster": True, "namespace": NAMESPACE}}

    async def start(self) -> None:
        await asyncio.to_thread(self.cluster.start)
        self.admin = seeds.cluster_client(self.cluster.seed_url)
        self.producer = seeds.cluster_client(self.cluster.seed_url)
        await self.admin.ping()
        await self.producer.ping()

    async def close(self) -> None:
        for client in (self.admin, self.producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        self.cluster.close()
        self.server.close()  # the single server the base class prepared, never started

    async def publish(self, messages: list[Message]) -> None:
        """LPUSH, then WAIT for the replica on the same connection."""
        await self.publishing.wait()
        async with self._pushing:
            key = self.keys.ready
            command = ("LPUSH", key, *(message.raw for message in messages))
            [pushed], confirmed = await write_and_wait(self.producer, key, [command], CONFIRMED)
            if isinstance(pushed, Exception):
                raise pushed
            if confirmed < 1:
                raise RuntimeError("a push was not confirmed by the replica")

    async def inject(self, fault: str) -> str:
        if fault == "failover":
            return await self._failover()
        if fault == "script_flush":
            await asyncio.to_thread(self.cluster.flush_scripts)
            return "SCRIPT FLUSH on every node"
        raise ValueError(f"unknown fault {fault!r}")

    async def _failover(self) -> str:
        self.publishing.clear()
        await self._pushing.acquire()  # no push in flight across the failover
        try:
            self.failovers += 1
            manual = self.failovers % 2 == 1
            began = time.monotonic()
            detail = await asyncio.to_thread(self._fail_over, manual)
            await self.producer.nodes_manager.initialize()  # where the slot is now
            return f"{detail} ({time.monotonic() - began:.2f}s)"
        finally:
            self._pushing.release()
            self.publishing.set()

    def _fail_over(self, manual: bool) -> str:
        master = self.cluster.owner(SLOT)
        replica = self.cluster.replica_of(master)
        if manual:
            self.cluster.failover(replica)
            return f"CLUSTER FAILOVER {master.port} -> {replica.port}"
        master.kill()
        promoted = self.cluster.wait_promoted(replica, 60)
        self.cluster.revive(master)
        return f"SIGKILL of master {master.port}, {replica.port} promoted in {promoted:.2f}s"

    async def _admin(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """An idempotent admin command, retried while a failover settles."""
        for attempt in range(50):
            try:
                return await getattr(self.admin, command)(*args, **kwargs)
            except Exception:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def _scan(self, pattern: str) -> list[bytes]:
        client: RedisCluster = self.admin
        return [key async for key in client.scan_iter(match=pattern, count=1000)]
