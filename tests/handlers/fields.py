"""Appends ``repr((pid, queue, timestamp, attempts, payload))`` of each message to the file
its payload's "log" key names: the values a handler gets, with their types. ``handle`` is a
plain handler, ``handle_async`` the same as an ``async def`` one."""

from __future__ import annotations

from tests.handlers._log import append


def handle(message) -> None:
    fields = (message.pid, message.queue, message.timestamp, message.attempts, message.payload)
    append(message.payload["log"], repr(fields))


async def handle_async(message) -> None:
    handle(message)
