"""The arq peer of the async benchmark: one arq worker whose job awaits a fixed time.

    ARQ_PYTHON -m bench.peer_arq fill redis://127.0.0.1:PORT/0 --messages 20000
    ARQ_PYTHON -m bench.peer_arq work redis://127.0.0.1:PORT/0 --max-jobs 200 --wait-ms 50

arq pins redis-py below 6, which this project does not use, so it runs in an interpreter of
its own (``--arq-python`` of the harness) and imports nothing from this project. The worker
keeps arq's defaults (results kept, its own retries) except ``max_jobs`` (jobs at once) and
``poll_delay`` (10 ms instead of 500 ms: arq only fetches new jobs between polls, and with
its default the comparison would measure the poll, not the worker). Prints "ready", runs
until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

QUEUE = "arq:queue"  # arq's default queue: job ids in a sorted set until they finish
POLL_DELAY = 0.01
_wait = 0.05


async def wait(ctx, payload) -> None:
    await asyncio.sleep(_wait)


async def fill(url: str, messages: int) -> None:
    from arq import create_pool
    from arq.connections import RedisSettings

    pool = await create_pool(RedisSettings.from_dsn(url))
    payload = {"project": {"$id": "project-1"}, "metrics": [{"key": "executions", "value": 1}]}
    for start in range(0, messages, 500):
        await asyncio.gather(*(pool.enqueue_job("wait", payload)
                               for _ in range(start, min(messages, start + 500))))
    await pool.aclose()


def work(url: str, max_jobs: int) -> None:
    from arq.connections import RedisSettings
    from arq.worker import Worker

    worker = Worker(functions=[wait], redis_settings=RedisSettings.from_dsn(url),
                    max_jobs=max_jobs, poll_delay=POLL_DELAY, handle_signals=True)
    print("ready", flush=True)
    worker.run()


def main() -> None:
    global _wait
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("fill", "work"))
    parser.add_argument("url")
    parser.add_argument("--messages", type=int, default=0)
    parser.add_argument("--max-jobs", type=int, default=200)
    parser.add_argument("--wait-ms", type=float, default=50)
    args = parser.parse_args()
    _wait = args.wait_ms / 1000
    if args.command == "fill":
        asyncio.run(fill(args.url, args.messages))
    else:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        work(args.url, args.max_jobs)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
