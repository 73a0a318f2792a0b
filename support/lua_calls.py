"""Recording the scripts a broker calls, and a Redis database saved and put back as it was."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.redis.scripts import Scripts


class Recorded:
    """Wraps ``Scripts.call``: every call's name, keys and arguments, as sent."""

    def __init__(self, scripts: Scripts) -> None:
        self.calls: list[tuple[str, list[str], list[Any]]] = []
        self._call = scripts.call
        scripts.call = self.call  # type: ignore[method-assign]

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        self.calls.append((name, list(keys), list(args)))
        return await self._call(name, keys, args)

    def last(self, name: str) -> tuple[list[str], list[Any]]:
        keys, args = next((k, a) for n, k, a in reversed(self.calls) if n == name)
        return keys, args


async def snapshot(client) -> dict[bytes, tuple[bytes, bool]]:
    """Every key's serialized value and whether it has an expiry."""
    state = {}
    for key in await client.keys("*"):
        state[key] = (await client.dump(key), await client.pttl(key) > 0)
    return state


async def restore(client, state: dict[bytes, tuple[bytes, bool]]) -> None:
    """The keys as they were; an expiry as a long one (only its presence is compared)."""
    await client.flushdb()
    for key, (value, expires) in state.items():
        await client.restore(key, 3_600_000 if expires else 0, value)
