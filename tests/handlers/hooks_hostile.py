"""Every job fails; its on_error() raises an exception whose str() raises ("unprintable")
or is 10 MB long ("huge"), as the payload's "hook" says."""

from __future__ import annotations


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def handle(message) -> None:
    raise ValueError("boom")


def on_error(message, error: BaseException) -> None:
    if message.payload.get("hook") == "huge":
        raise RuntimeError("y" * 10_000_000)
    raise Unprintable()
