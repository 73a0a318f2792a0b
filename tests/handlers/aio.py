"""An async handler for the handler-process tests; every hook is async.

Payload: {"log": path} gets "start <pid> <in flight>" and "end <pid>" lines; {"gate": path}
waits (yielding) for that file; {"hang": true} waits forever, yielding; {"block": s} blocks
the loop for s seconds; {"swallow": true} ignores cancellation until its gate opens;
{"fail": true} raises. on_success and on_error append "success <pid>" / "error <pid> <error>".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from support.waiting import until
from tests.handlers._log import append

_in_flight = 0


async def wait_for(path: str) -> None:
    await until(lambda: os.path.exists(path), None, f"the gate {path}", every=0.005)


async def handle(message) -> None:
    global _in_flight
    payload, log = message.payload, message.payload.get("log")
    _in_flight += 1
    try:
        if log:
            append(log, f"start {message.pid} {_in_flight}")
        if "gate" in payload and not payload.get("swallow"):
            await wait_for(payload["gate"])
        if payload.get("swallow"):
            # Not `until`: this loop outlives a cancellation on purpose (the test's point).
            while not os.path.exists(payload["gate"]):  # noqa: ASYNC240 - a gate file's stat
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.005)
        if payload.get("hang"):
            await asyncio.sleep(3600)
        if payload.get("block"):
            time.sleep(payload["block"])  # noqa: ASYNC251 - blocks its loop on purpose
        if payload.get("fail"):
            raise ValueError("boom")
        if log:
            append(log, f"end {message.pid}")
    finally:
        _in_flight -= 1


async def on_success(message) -> None:
    await asyncio.sleep(0)
    append(message.payload["log"], f"success {message.pid}")


async def on_error(message, error) -> None:
    await asyncio.sleep(0)
    if "log" in message.payload:
        append(message.payload["log"], f"error {message.pid} {type(error).__name__}: {error}")
