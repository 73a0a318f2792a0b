"""``publish``: payloads from JSON lines (one object per line), sent with ``publish_many``.

Every line is read and checked before the first message is sent, so a bad line publishes
nothing (a half-published file is harder to repair than a refused one).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from broker.base import MAX_BATCH


class InputError(ValueError):
    """A line is not a JSON object; the message names the line."""


def read_payloads(lines: Iterable[bytes | str], name: str = "<stdin>") -> list[dict[str, Any]]:
    """One payload per non-blank line; raises InputError naming the first bad line."""
    payloads = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            payload = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise InputError(f"{name}:{number}: invalid JSON: {error}") from None
        if not isinstance(payload, dict):
            kind = type(payload).__name__
            raise InputError(f"{name}:{number}: a payload must be a JSON object, not {kind}")
        payloads.append(payload)
    return payloads


async def publish_all(broker: Any, queue: str, payloads: list[dict[str, Any]]) -> list[str]:
    """Publish in order, ``MAX_BATCH`` per call; returns the pids."""
    pids: list[str] = []
    for start in range(0, len(payloads), MAX_BATCH):
        pids += await broker.publish_many(queue, payloads[start:start + MAX_BATCH])
    return pids
