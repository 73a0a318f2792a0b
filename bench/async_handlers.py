"""Handlers of the async benchmark (``python -m bench.async_compare``).

``wait``/``wait_sync``: an I/O-bound call, $BENCH_WAIT_MS (default 50) milliseconds of
waiting (awaited, or a blocking sleep). ``spin``/``spin_sync``: a CPU-bound call,
$BENCH_SPIN_MS (default 5) milliseconds of computing without yielding.
"""

from __future__ import annotations

import asyncio
import os
import time

WAIT = float(os.environ.get("BENCH_WAIT_MS", "50")) / 1000
SPIN = float(os.environ.get("BENCH_SPIN_MS", "5")) / 1000


async def wait(message) -> None:
    await asyncio.sleep(WAIT)


def wait_sync(message) -> None:
    time.sleep(WAIT)


def _spin() -> None:
    end = time.thread_time() + SPIN  # CPU time of this thread: load elsewhere does not count
    while time.thread_time() < end:
        pass


async def spin(message) -> None:
    _spin()


def spin_sync(message) -> None:
    _spin()
