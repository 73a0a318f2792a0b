"""A large history on the server: does the work per call stay bounded?

``fill_history`` puts 100,000 stale pids in the queue's processing list, as a legacy
consumer (one that never renews) leaves them: each with its job record and no owner key,
published just now, so maintenance must leave them alone (they are far younger than
``recovery_age``). It adds 100,000 keys of other queues in the same namespace. The runs
with ``history=True`` then show whether settlement and its server time per call grow
with that history, and ``time_maintain`` times ``RedisBroker.maintain()`` calls directly.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from bench.common import NAMESPACE, QUEUE
from broker import envelope
from broker.keys import QueueKeys

STALE_PIDS = 100_000
OTHER_KEYS = 100_000
KEYS = QueueKeys(NAMESPACE, QUEUE)


def fill_history(client: redis.Redis, stale: int = STALE_PIDS, others: int = OTHER_KEYS) -> None:
    pipe = client.pipeline(transaction=False)
    for n in range(stale):
        pid, raw = envelope.build(QUEUE, {"project": {"$id": f"legacy-{n % 50}"}, "metrics": []})
        pipe.set(KEYS.job(pid), raw)
        pipe.lpush(KEYS.processing, pid)
        if len(pipe) >= 10_000:
            pipe.execute()
    for n in range(others):
        other = QueueKeys(NAMESPACE, f"other-{n % 100}")
        if n < 100:
            pipe.lpush(other.ready, envelope.build(other.queue, {"n": n})[1])
        else:
            pid, raw = envelope.build(other.queue, {"n": n})
            pipe.set(other.job(pid), raw)
        if len(pipe) >= 10_000:
            pipe.execute()
    pipe.execute()


async def _maintain(url: str, calls: int) -> list[dict[str, Any]]:
    from broker.redis import RedisBroker

    broker = RedisBroker(url, QUEUE, namespace=NAMESPACE)
    stats = redis.Redis.from_url(url)
    await broker.connect()
    figures = []
    try:
        for _ in range(calls):
            stats.config_resetstat()
            began = time.perf_counter()
            report = await broker.maintain()
            seconds = time.perf_counter() - began
            commands = stats.info("commandstats")
            server_usec = sum(int(value["usec"]) for name, value in commands.items()
                              if name not in ("cmdstat_info", "cmdstat_config|resetstat"))
            figures.append({
                "wall_ms": seconds * 1000, "server_ms": server_usec / 1000,
                "recovered": report.total, "skipped": report.skipped,
            })
    finally:
        await broker.close()
        stats.close()
    return figures


def time_maintain(url: str, calls: int = 5) -> list[dict[str, Any]]:
    """Wall and server time (all commands it sent, scripts included) of ``calls``
    consecutive ``RedisBroker.maintain()`` calls on whatever the server holds now."""
    return asyncio.run(_maintain(url, calls))


def maintenance_comparison(client: redis.Redis, url: str, calls: int = 5) -> dict[str, Any]:
    """``maintain()`` on an empty queue, then over the large history."""
    client.flushdb()
    empty = time_maintain(url, calls)
    fill_history(client)
    length = client.llen(KEYS.processing)
    history = time_maintain(url, calls)
    left = client.llen(KEYS.processing)
    return {"calls": calls, "empty": empty, "history": history, "processing_before": length,
            "processing_after": left}
