"""The chaos soak's async handler: ``examples.stats_usage_async`` (aiosqlite) with the
seeded failures and the ledger of ``bench.chaos.handler`` (see there for the line format).

The work sleep is awaited, so a process runs many calls at once. ``flush()`` takes the pids
it covers before its first ``await``, exactly when ``stats_usage_async.flush()`` takes its
buffer, so a ``C`` line names what that transaction counted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.chaos.handler import LedgerLines, extra_work
from examples import stats_usage_async

_lines = LedgerLines()


async def init() -> None:
    await stats_usage_async.init()
    _lines.open()


async def handle(message: Any) -> None:
    await asyncio.sleep(_lines.work + extra_work(message.payload))
    _lines.before(message)
    try:
        await stats_usage_async.handle(message)
    except ValueError:
        _lines.call(message, "v")
        raise
    _lines.call(message, ".")


async def flush() -> None:
    pids = _lines.take_buffered()
    await stats_usage_async.flush()
    _lines.flushed(pids)
