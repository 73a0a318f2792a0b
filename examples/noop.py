"""A handler that does nothing: measures the runtime itself (benchmarks)."""

from __future__ import annotations

from typing import Any


def handle(message: Any) -> None:
    """Succeed at once."""
