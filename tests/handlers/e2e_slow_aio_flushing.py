"""``e2e_slow_aio`` with an ``async def flush()``."""

from __future__ import annotations

from tests.handlers.e2e_slow import flushed
from tests.handlers.e2e_slow_aio import handle

__all__ = ["flush", "handle"]


async def flush() -> None:
    flushed()
