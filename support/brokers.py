"""Helpers for tests that drive a broker adapter directly."""

from __future__ import annotations

import time
from typing import Any

from broker.base import Delivery


async def receive_all(broker: Any, count: int,
                      timeout: float = 20.0,  # noqa: ASYNC109 - failure says how many came
                      ) -> list[Delivery]:
    """Receive until ``count`` deliveries arrived (each receive waits up to 1 s)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count}"
        got += (await broker.receive(count - len(got), 1.0)).deliveries
    return got


def count_script_calls(broker: Any) -> list[tuple[str, int]]:
    """Record (script, messages in the call) for every script call the broker makes."""
    calls: list[tuple[str, int]] = []
    original = broker.scripts.call

    async def counting(name: str, keys, args=()):
        size = {
            "reserve": lambda: int(args[0]),
            "claim": lambda: int(args[2]),
            "settle": lambda: int(args[1]),
            "extend": lambda: (len(keys) - 2) // 2,
        }.get(name, lambda: 0)()
        calls.append((name, size))
        return await original(name, keys, args)

    broker.scripts.call = counting  # type: ignore[method-assign]
    return calls
