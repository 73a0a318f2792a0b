"""Grouped settlement against pipelined per-message settlement, at prefetch 100.

Both variants drive the same ``RedisBroker`` reserve/claim (batches of up to 100) in this
process, with no handler; only the commit differs:

- grouped: ``RedisBroker.commit()``, i.e. one ``settle.lua`` call per batch;
- per-message: one EVALSHA of ``bench/lua/commit_one.lua`` per delivery (the same owner
  check, job/owner deletion, LREM and counters), all of a batch in one pipeline.

Client CPU is this process's CPU time (the whole loop, and the commits alone); server CPU
is Redis's, both per job.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from bench import redis_side
from bench.common import NAMESPACE, QUEUE, ROOT
from broker.redis.keys import QueueKeys

KEYS = QueueKeys(NAMESPACE, QUEUE)
COMMIT_ONE = (ROOT / "bench" / "lua" / "commit_one.lua").read_text()


async def _drive(url: str, variant: str, messages: int, prefetch: int) -> dict[str, Any]:
    from broker.redis import RedisBroker

    broker = RedisBroker(url, QUEUE, namespace=NAMESPACE)
    await broker.connect()
    sha = await broker.client.script_load(COMMIT_ONE)
    fixed = [KEYS.processing, KEYS.stat("processing"), KEYS.stat("success")]
    done = calls = 0
    commit_cpu = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        while done < messages:
            received = await broker.receive(prefetch, 0)
            deliveries = received.deliveries
            if not deliveries:
                raise RuntimeError(f"queue empty after {done} of {messages}")
            began = time.process_time()
            if variant == "grouped":
                results = [result.outcome.value for result in await broker.commit(deliveries)]
            else:
                pipe = broker.client.pipeline(transaction=False)
                for delivery in deliveries:
                    pipe.evalsha(sha, 5, *fixed, KEYS.job(delivery.pid),
                                 KEYS.owner(delivery.pid), delivery.receipt, delivery.pid)
                results = [r.decode() if isinstance(r, bytes) else r
                           for r in await pipe.execute()]
            commit_cpu += time.process_time() - began
            if any(result != "ok" for result in results):
                raise RuntimeError(f"{variant}: not every commit applied: {set(results)}")
            done += len(deliveries)
            calls += 1
    finally:
        await broker.close()
    return {"seconds": time.perf_counter() - wall, "client_cpu_s": time.process_time() - cpu,
            "commit_cpu_s": commit_cpu, "batches": calls}


def compare(client: redis.Redis, url: str, messages: int, prefetch: int = 100
            ) -> list[dict[str, Any]]:
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    rows = []
    for variant in ("grouped", "per-message"):
        client.flushdb()
        redis_side.fill(client, KEYS.ready, messages)
        redis_side.reset(client)
        before = redis_side.snapshot(client)
        figures = run(_drive(url, variant, messages, prefetch))
        after = redis_side.snapshot(client)
        server = redis_side.delta(before, after, set(), redis_side.Probe(client))
        rows.append({
            "variant": variant, "prefetch": prefetch, "messages": messages,
            "jobs_per_s": messages / figures["seconds"],
            "client_us_per_job": figures["client_cpu_s"] / messages * 1e6,
            "commit_client_us_per_job": figures["commit_cpu_s"] / messages * 1e6,
            "server_us_per_job": server["server_cpu_s"] / messages * 1e6,
            "script_calls_per_job": server["script_calls"] / messages,
            "script_usec_per_call": server["script_usec_per_call"],
            "bytes_in_per_job": server["bytes_in"] / messages,
        })
    return rows
