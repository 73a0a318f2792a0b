"""The broker-specific part of a soak run: the server, publishing, faults, final state.

The harness's own connections are never the target of a fault: connection kills spare
them (the producer is not what is under test) and publishing pauses while the server
restarts, so every message is published exactly once and known to the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from broker.redis.keys import QueueKeys
from support.servers import RedisServer
from support.soak_workload import Message

NAMESPACE = "utopia-queue"

# In one script, so a claim (reservation -> processing) is never counted twice or missed.
# An idle supervisor keeps an empty blocking reservation registered: payloads are counted.
_OUTSTANDING = """
local reserved = 0
for _, reservation in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    reserved = reserved + redis.call('LLEN', reservation)
end
return {redis.call('LLEN', KEYS[1]), reserved, redis.call('LLEN', KEYS[3])}
"""


@dataclass(slots=True)
class Check:
    """One line of the result table."""

    name: str
    expected: Any
    actual: Any
    ok: bool = True
    note: str = ""


@dataclass(slots=True)
class FinalState:
    """What the broker holds at the end."""

    failed_pids: set[str]  # failed for good (Redis failed list / NATS dead stream)
    checks: list[Check] = field(default_factory=list)


class RedisSide:
    name = "redis"
    faults = ("handler_kill", "supervisor_kill", "supervisor_term", "connection_kill",
              "script_flush", "broker_restart")

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.keys = QueueKeys(NAMESPACE, queue)
        self.server = RedisServer(persist=True)
        self.publishing = asyncio.Event()
        self.publishing.set()
        self.admin: Any = None
        self.producer: Any = None

    @property
    def supervisor_url(self) -> str:
        return self.server.url

    def config_sections(self, settings: Any) -> dict[str, dict[str, Any]]:
        return {}

    async def start(self) -> None:
        self.server.start()
        # One connection each, so each has one CLIENT ID to spare from connection kills.
        self.admin = aioredis.Redis.from_url(self.server.url, single_connection_client=True)
        # The producer never retries on its own: a repeated LPUSH would publish twice.
        self.producer = aioredis.Redis.from_url(
            self.server.url, single_connection_client=True, retry=Retry(NoBackoff(), 0)
        )
        await self.admin.ping()
        await self.producer.ping()

    async def ready(self) -> None:
        """Nothing to prepare: the queue's keys appear with the first publish."""

    async def close(self) -> None:
        for client in (self.admin, self.producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        self.server.close()

    # -- publishing -----------------------------------------------------------------------

    async def publish(self, messages: list[Message]) -> None:
        """LPUSH the batch; raises if the reply was lost (the batch is then uncertain)."""
        await self.publishing.wait()
        await self.producer.lpush(self.keys.ready, *(message.raw for message in messages))

    # -- faults ---------------------------------------------------------------------------

    async def inject(self, fault: str) -> str:
        if fault == "connection_kill":
            return await self._kill_connections()
        if fault == "script_flush":
            await self._admin("script_flush")
            return "SCRIPT FLUSH"
        if fault == "broker_restart":
            return await self._restart()
        raise ValueError(f"unknown fault {fault!r}")

    async def _kill_connections(self) -> str:
        """CLIENT KILL TYPE normal, sparing the harness's own two connections."""
        spared = {await self._admin("client_id"), await self._client_id(self.producer)}
        clients = await self._admin("client_list", _type="normal")
        victims = [int(client["id"]) for client in clients if int(client["id"]) not in spared]
        for victim in victims:
            with contextlib.suppress(Exception):  # gone meanwhile
                await self.admin.client_kill_filter(_id=victim)
        return f"CLIENT KILL of {len(victims)} supervisor connections"

    async def _client_id(self, client: Any) -> int:
        for _ in range(5):
            with contextlib.suppress(ConnectionError, OSError, aioredis.ConnectionError):
                return await client.client_id()
            await asyncio.sleep(0.05)
        return await client.client_id()

    async def _restart(self) -> str:
        self.publishing.clear()
        try:
            began = time.monotonic()
            self.server.stop()  # SIGKILL: appendfsync always keeps every acknowledged write
            self.server.start()
            down = time.monotonic() - began
            await self._client_id(self.producer)  # reconnect before publishing again
            await self._admin("ping")
        finally:
            self.publishing.set()
        return f"redis-server SIGKILL and restart (down {down:.2f}s)"

    async def _admin(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """An idempotent admin command, retried across a reconnect."""
        for attempt in range(20):
            try:
                return await getattr(self.admin, command)(*args, **kwargs)
            except (aioredis.ConnectionError, ConnectionError, OSError):
                if attempt == 19:
                    raise
                await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    # -- state ------------------------------------------------------------------------------

    async def consumer_of(self, process: int) -> str | None:
        """None: on Redis a delivery's owner token (queue 5's, 32 hex per reservation) does
        not name its supervisor, so what one supervisor still holds cannot be told apart;
        recovery is measured to the redelivery's handler call instead."""
        del process
        return None

    async def held_by(self, consumer: str) -> int:
        raise NotImplementedError("owner tokens do not name their supervisor on Redis")

    async def outstanding(self) -> dict[str, int]:
        """Counts that must all reach zero once everything is recovered and settled."""
        k = self.keys
        ready, reserved, processing = await self._admin(
            "eval", _OUTSTANDING, 3, k.ready, k.reservations, k.processing
        )
        return {"ready": ready, "reserved": reserved, "processing": processing}

    async def failed_now(self) -> set[str]:
        """Pids failed for good: the failed list, and dead (out of attempts by crashes)."""
        pids = [*await self._admin("lrange", self.keys.failed, 0, -1),
                *await self._admin("lrange", self.keys.dead, 0, -1)]
        return {pid.decode() for pid in pids}

    async def final_state(self, messages: list[Message], max_attempts: int) -> FinalState:
        k = self.keys
        failed = [pid.decode() for pid in await self._admin("lrange", k.failed, 0, -1)]
        poison = await self._admin("lrange", k.poison, 0, -1)
        # dead: deliveries lost with their handler or supervisor on their last attempt
        # (recovery counts a crashed run as an attempt, as queue 5 does).
        dead = [pid.decode() for pid in await self._admin("lrange", k.dead, 0, -1)]
        jobs = {key.decode().removeprefix(k.job("")) for key in await self._scan(k.job("*"))}
        owners = await self._scan(k.owner("*"))
        claims = await self._scan(k.claim("*"))
        reservation_lists = await self._scan(k.reservation("*"))
        counts = await self.outstanding()
        registered = await self._admin("zcard", k.reservations)
        reserved_elsewhere = 0  # payloads in reservation lists that are not registered
        for key in reservation_lists:
            if await self._admin("zscore", k.reservations, key) is None:
                reserved_elsewhere += await self._admin("llen", key)
        counters = {name: int(await self._admin("get", k.stat(name)) or 0)
                    for name in ("total", "processing", "success", "failed")}
        valid = [m for m in messages if m.pid is not None]
        malformed = Counter(m.raw for m in messages if m.pid is None)
        attempts_ok = True  # rejected as queue 5 does: the record of the last run, kept
        for pid in failed:
            record = await self._admin("get", k.job(pid))
            if record is None or orjson.loads(record).get("attempts") != max_attempts - 1:
                attempts_ok = False
        ended = failed + dead
        checks = [
            Check("ready list", 0, counts["ready"], counts["ready"] == 0),
            Check("reserved payloads", 0, counts["reserved"] + reserved_elsewhere,
                  counts["reserved"] == 0 and not reserved_elsewhere,
                  f"{registered} empty registrations left by killed supervisors"
                  if registered else ""),
            Check("processing list", 0, counts["processing"], counts["processing"] == 0),
            Check("owner and claim keys", 0, len(owners) + len(claims), not owners + claims),
            Check("job records = failed and dead pids", len(ended), len(jobs),
                  jobs == set(ended)),
            Check(f"failed records at attempts {max_attempts - 1} (the last run's)",
                  len(failed), "all" if attempts_ok else "not all", attempts_ok),
            Check("failed and dead lists, each pid once", len(set(ended)), len(ended),
                  len(ended) == len(set(ended))),
            Check("poison = malformed + oversized published", sum(malformed.values()),
                  len(poison),
                  Counter(poison) == malformed),
            Check("stats.processing", 0, counters["processing"], counters["processing"] == 0),
            Check("stats.success = valid - failed - dead", len(valid) - len(ended),
                  counters["success"], counters["success"] == len(valid) - len(ended)),
            Check("stats.failed >= failed (failed runs; poison not counted)", len(failed),
                  counters["failed"], counters["failed"] >= len(failed)),
            Check("stats.total >= valid (claims; poison not counted)", len(valid),
                  counters["total"], counters["total"] >= len(valid),
                  f"{counters['total'] - len(valid)} redeliveries"),
        ]
        return FinalState(set(ended), checks)

    async def _scan(self, pattern: str) -> list[bytes]:
        return [key async for key in self.admin.scan_iter(match=pattern, count=1000)]

    async def locate(self, pid: str) -> str:
        """Where the broker holds ``pid`` now, in words."""
        k = self.keys
        places = []
        needle = f'"pid":"{pid}"'.encode()
        if any(needle in raw for raw in await self._admin("lrange", k.ready, 0, -1)):
            places.append("ready list")
        for key in await self._scan(k.reservation("*")):
            if any(needle in raw for raw in await self._admin("lrange", key, 0, -1)):
                score = await self._admin("zscore", k.reservations, key)
                places.append(f"reservation {key.decode()} (deadline {score})")
        if pid.encode() in await self._admin("lrange", k.processing, 0, -1):
            places.append("processing list")
        if pid.encode() in await self._admin("lrange", k.failed, 0, -1):
            places.append("failed list")
        if owner := await self._admin("get", k.owner(pid)):
            places.append(f"owner {owner.decode()}")
        if await self._admin("exists", k.job(pid)):
            places.append("job record")
        return ", ".join(places) or "nowhere in Redis"
