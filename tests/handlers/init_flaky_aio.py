"""tests.handlers.init_flaky with an ``async def`` init() and handler (worker.aio)."""

from __future__ import annotations

from tests.handlers import init_flaky
from tests.handlers.e2e_record import _append


async def init() -> None:
    init_flaky.init()


async def handle(message) -> None:
    _append("handled", message.pid)
