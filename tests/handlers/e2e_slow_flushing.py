"""``e2e_slow``'s plain handler with ``flush()``: dispatch hands it slices."""

from __future__ import annotations

from tests.handlers.e2e_slow import flushed, handle

__all__ = ["flush", "handle"]


def flush() -> None:
    flushed()
