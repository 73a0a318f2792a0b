"""A large history on the server: does the work per call stay bounded?

``fill_history`` puts 100,000 stale pids in the queue's processing list, as a legacy
consumer (one that never renews) leaves them: each with its job record and no owner key,
published just now, so maintenance must leave them alone (they are far younger than
``recovery_age``). It adds 100,000 keys of other queues in the same namespace. The runs
with ``history=True`` then show whether settlement and its server time per call grow
with that history, and ``time_maintain`` times ``RedisBroker.maintain()`` calls directly.
The last maintenance case also puts 100,000 entries past ``recovery_age`` at the tail, so
every sweep recovers a full window (1,000) behind the 100,000 young ones.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from bench.common import NAMESPACE, QUEUE
from broker import envelope
from broker.redis.keys import QueueKeys

STALE_PIDS = 100_000
OTHER_KEYS = 100_000
KEYS = QueueKeys(NAMESPACE, QUEUE)


#: Seconds past the default recovery_age (90,000) of the old entries.
OLD_AGE = 90_000 + 3_600


def fill_history(
    client: redis.Redis, stale: int = STALE_PIDS, others: int = OTHER_KEYS, old: int = 0
) -> None:
    pipe = client.pipeline(transaction=False)
    published = int(time.time()) - OLD_AGE
    for n in range(old):  # pushed first: the tail, the oldest end
        pid = envelope.new_pid(at=published)  # published then, as a PHP producer would
        raw = envelope.encode({"pid": pid, "queue": QUEUE, "timestamp": published,
                               "payload": {"project": {"$id": f"old-{n % 50}"}}})
        pipe.set(KEYS.job(pid), raw)
        pipe.lpush(KEYS.processing, pid)
        if len(pipe) >= 10_000:
            pipe.execute()
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
    from bench import redis_side
    from broker.redis import RedisBroker

    broker = RedisBroker(url, QUEUE, namespace=NAMESPACE)
    stats = redis.Redis.from_url(url)
    await broker.connect()
    figures = []
    try:
        for _ in range(calls):
            redis_side.reset(stats, slowlog_usec=0)  # every call in the slow log
            cpu = redis_side.snapshot(stats).cpu
            began = time.perf_counter()
            report = await broker.maintain(force=True)  # the fleet's lock would space them
            seconds = time.perf_counter() - began
            server = redis_side.snapshot(stats).cpu - cpu
            scripts = [int(entry["duration"]) for entry in stats.slowlog_get(10000)
                       if _command(entry).startswith("evalsha")]
            commands = [int(entry["duration"]) for entry in stats.slowlog_get(10000)
                        if not _command(entry).startswith(("info", "config", "slowlog"))]
            figures.append({
                "wall_ms": seconds * 1000, "server_cpu_ms": server * 1000,
                "longest_script_ms": max(scripts, default=0) / 1000,
                "longest_command_ms": max(commands, default=0) / 1000,
                "recovered": report.total, "skipped": report.skipped,
            })
    finally:
        redis_side.reset(stats)
        await broker.close()
        stats.close()
    return figures


def _command(entry: dict[str, Any]) -> str:
    words = entry["command"]
    return (words.decode(errors="replace") if isinstance(words, bytes) else str(words)).lower()


def time_maintain(url: str, calls: int = 5) -> list[dict[str, Any]]:
    """Wall time, server CPU (INFO cpu, the server being otherwise idle) and the longest
    script of ``calls`` consecutive ``RedisBroker.maintain()`` calls on what the server
    holds now."""
    return asyncio.run(_maintain(url, calls))


SIZES = ((0, 0), (10_000, 0), (STALE_PIDS, 0), (STALE_PIDS, STALE_PIDS))


def maintenance_comparison(client: redis.Redis, url: str, calls: int = 5) -> dict[str, Any]:
    """``maintain()`` on an empty queue, then over 10,000 and 100,000 young legacy entries
    (and as many keys of other queues), then with 100,000 old ones behind them at the tail:
    bounded work per call means the young cases cost the same, and recovering a full window
    from behind 100,000 entries stays bounded too."""
    cases = []
    for size, old in SIZES:
        client.flushdb()
        if size or old:
            fill_history(client, stale=size, others=size, old=old)
        calls_figures = time_maintain(url, calls)
        cases.append({"stale_pids": size, "old_pids": old, "calls": calls_figures,
                      "processing_after": client.llen(KEYS.processing)})
    return {"calls": calls, "cases": cases}
