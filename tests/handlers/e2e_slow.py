"""Handlers of the fair-dispatch tests: jobs that hang beside short ones (a plain ``def``;
``e2e_slow_aio`` is the ``async def`` one, the ``_flushing`` modules add ``flush()``).

Payload: {"hang": true} (never returns), {"sleep": s}. Files in E2E_DIR: "started"
("<pid> <process>"), "handled" (pids), "flushes" (one line per flush(): the pids it made
durable, space-separated).
"""

from __future__ import annotations

import os
import time

from tests.handlers.e2e_record import _append

#: Returned since the last flush() (a module without flush() never empties it: tests only).
returned: list[str] = []


def started(message) -> bool:
    """Note the start; True when the job is to hang."""
    _append("started", f"{message.pid} {os.getpid()}")
    return bool(message.payload.get("hang"))


def done(message) -> None:
    returned.append(message.pid)
    _append("handled", message.pid)


def flushed() -> None:
    _append("flushes", " ".join(returned))
    returned.clear()


def handle(message) -> None:
    while started(message):
        time.sleep(3600)
    time.sleep(message.payload.get("sleep", 0))
    done(message)
