"""An async handler that buffers pids and writes them in an async flush(), like one that
batches database rows. flush() logs "flushing <pids>" and, while the file $AIO_FLUSH_GATE
names does not exist, waits (yielding); then logs "flushed <pids>", or raises when a
message carried {"flush_fails": true}. init() logs "init" to $AIO_INIT_LOG, or raises when
$AIO_INIT_FAILS is set.
"""

from __future__ import annotations

import asyncio
import os

from support.waiting import until
from tests.handlers._log import append

_buffered: list = []


async def init() -> None:
    await asyncio.sleep(0)
    if os.environ.get("AIO_INIT_FAILS"):
        raise RuntimeError("no database")


async def _wait_for(gate: str) -> None:
    await until(lambda: os.path.exists(gate), None, f"the gate {gate}", every=0.005)


async def handle(message) -> None:
    gate = message.payload.get("gate")
    if gate:
        await _wait_for(gate)
    _buffered.append(message)


async def flush() -> None:
    taken = _buffered.copy()  # before the first await: later returns go to the next flush
    _buffered.clear()
    if not taken:
        return
    log = taken[0].payload["log"]
    pids = ",".join(message.pid for message in taken)
    append(log, f"flushing {pids}")
    gate = os.environ.get("AIO_FLUSH_GATE")
    if gate:
        await _wait_for(gate)
    if any(message.payload.get("flush_fails") for message in taken):
        raise RuntimeError("database down")
    append(log, f"flushed {pids}")
