"""Raises what a handler should never raise, by payload: {"raise": "exit3"} SystemExit(3)
(sys.exit(3) in a job), "exit0" SystemExit(0), "interrupt" KeyboardInterrupt, "base" a
BaseException subclass of its own; anything else succeeds."""

from __future__ import annotations

import sys


class Abort(BaseException):
    """Not an Exception: what some frameworks raise to unwind (gevent's GreenletExit)."""


def fail(kind: str) -> None:
    if kind == "exit3":
        sys.exit(3)
    if kind == "exit0":
        sys.exit(0)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "base":
        raise Abort("unwound")


def handle(message) -> None:
    fail(message.payload.get("raise", ""))


async def handle_async(message) -> None:
    fail(message.payload.get("raise", ""))
