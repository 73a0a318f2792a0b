"""Waiting for a condition: ``until`` inside a running event loop, ``wait_until`` blocking
(``support.supervision.wait_for``, blocking too, also returns the value that held).

``until`` is the one poll loop of the async tests and their handlers: it is for state that
tells no one when it changes (a broker's keys, the server's clock, another process, a gate
file); where the code under test offers an event, wait on that instead."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def until(condition: Callable[[], Any],
                timeout: float | None = 10.0,  # noqa: ASYNC109 - its failure names `what`
                what: str = "the condition", every: float = 0.05) -> None:
    """Wait for ``condition()`` (a value or an awaitable) to be true, checking it every
    ``every`` seconds; fail naming ``what`` after ``timeout`` seconds. ``timeout=None``
    waits until cancelled: a test handler's gate, ended by the code under test."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not await _value(condition()):
        if deadline is not None and time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def wait_until(condition: Callable[[], Any], timeout: float = 30.0) -> None:
    """Block until ``condition()`` holds (a guard against hangs, polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)
