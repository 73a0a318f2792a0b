"""Helpers for tests that drive a broker adapter directly."""

from __future__ import annotations

import time
from typing import Any

from broker.base import Delivery


async def receive_all(broker: Any, count: int, timeout: float = 20.0) -> list[Delivery]:
    """Receive until ``count`` deliveries arrived (each receive waits up to 1 s)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count}"
        got += (await broker.receive(count - len(got), 1.0)).deliveries
    return got
