"""``e2e_slow``'s handler as an ``async def``: several jobs at once in one process."""

from __future__ import annotations

import asyncio

from tests.handlers.e2e_slow import done, started


async def handle(message) -> None:
    while started(message):  # noqa: ASYNC110 - no poll: a job that hangs, as in e2e_slow
        await asyncio.sleep(3600)
    await asyncio.sleep(message.payload.get("sleep", 0))
    done(message)
