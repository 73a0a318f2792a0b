"""Waiting for a condition: ``until`` inside a running event loop, ``wait_until`` blocking
(``support.supervision.wait_for``, blocking too, also returns the value that held)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def until(condition: Callable[[], Any], timeout: float = 10.0,
                what: str = "the condition") -> None:
    """Wait for ``condition()`` (a value or an awaitable) to be true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not await _value(condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def wait_until(condition: Callable[[], Any], timeout: float = 30.0) -> None:
    """Block until ``condition()`` holds (a guard against hangs, polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)
