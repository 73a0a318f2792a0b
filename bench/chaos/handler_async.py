"""The chaos soak's async handler: ``examples.stats_usage_async`` (aiosqlite) with the
seeded failures and the ledger of ``bench.chaos.handler`` (see there for the line format).

The work sleep is awaited, so a process runs many calls at once. ``flush()`` takes the pids
it covers before its first ``await``, exactly when ``stats_usage_async.flush()`` takes its
buffer, so a ``C`` line names what that transaction counted.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from bench.chaos.handler import ENV_LEDGER, ENV_WORK_MS, ChaosFailure, extra_work, seeded_failure
from examples import stats_usage_async

_fd: int | None = None
_work = 0.0
_buffered: list[str] = []


async def init() -> None:
    global _fd, _work
    _work = float(os.environ.get(ENV_WORK_MS, "0")) / 1000
    await stats_usage_async.init()
    _fd = os.open(os.environ[ENV_LEDGER], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


async def handle(message: Any) -> None:
    await asyncio.sleep(_work + extra_work(message.payload))
    if seeded_failure(message.payload, message.pid, message.attempts):
        _write(f"I {time.time():.3f} {os.getpid()} {message.pid} {message.attempts} x\n")
        raise ChaosFailure(f"seeded failure of {message.pid} at attempt {message.attempts}")
    try:
        await stats_usage_async.handle(message)
    except ValueError:
        _write(f"I {time.time():.3f} {os.getpid()} {message.pid} {message.attempts} v\n")
        raise
    _write(f"I {time.time():.3f} {os.getpid()} {message.pid} {message.attempts} .\n")
    _buffered.append(message.pid)


async def flush() -> None:
    pids = _buffered.copy()
    _buffered.clear()
    await stats_usage_async.flush()
    if pids:
        _write(f"C {time.time():.3f} {os.getpid()} {' '.join(pids)}\n")


def _write(line: str) -> None:
    if _fd is None:
        raise RuntimeError("chaos handler used before init()")
    os.write(_fd, line.encode())
