"""Raises what the payload asks for, from a plain and an async handler (failure records).

Payload {"raise": kind}: "boom" ValueError("boom"); "huge" a 100 KB message; "bidi" a
message with bidirectional overrides and line breaks; "surrogate" a lone surrogate in the
message; "custom" this module's own class; "unprintable" an exception whose str() raises;
"deep" a RecursionError (a traceback of about a thousand frames).
"""

from __future__ import annotations


class BadInput(Exception):
    """A handler's own exception class: recorded with its module."""


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _recurse(depth: int) -> int:
    return _recurse(depth + 1) + 1


def fail(kind: str) -> None:
    if kind == "huge":
        raise ValueError("x" * 100_000 + "END")
    if kind == "bidi":
        raise ValueError("\u202eevil\nsecond line\u2028\x1b[31m")
    if kind == "surrogate":
        raise ValueError("bad \ud800 half")
    if kind == "custom":
        raise BadInput("no such user")
    if kind == "unprintable":
        raise Unprintable()
    if kind == "deep":
        _recurse(0)
    raise ValueError("boom")


def handle(message) -> None:
    fail(message.payload["raise"])


async def handle_async(message) -> None:
    fail(message.payload["raise"])
