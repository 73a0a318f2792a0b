"""The stats-usage handler, plus the latency record of ``bench.latency`` (same hooks)."""

from __future__ import annotations

from typing import Any

from bench.latency import record
from examples.stats_usage import flush, init
from examples.stats_usage import handle as _handle

__all__ = ["flush", "handle", "init"]


def handle(message: Any) -> None:
    record(message)
    _handle(message)
