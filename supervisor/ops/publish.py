"""``publish``: payloads from JSON lines (one object per line), sent with ``publish_many``.

Every line is read and checked before the first message is sent, so a bad line publishes
nothing (a half-published file is harder to repair than a refused one). A payload whose
envelope the consumers would poison for its size is such a bad line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import orjson

from broker import envelope
from broker.base import MAX_BATCH


class SizeLimit(NamedTuple):
    """The largest envelope the job's consumers accept, and the setting that makes it."""

    queue: str
    max_bytes: int
    source: str


class InputError(ValueError):
    """A line is not a JSON object; the message names the line."""


def read_payloads(
    lines: Iterable[bytes | str], name: str = "<stdin>", limit: SizeLimit | None = None
) -> list[dict[str, Any]]:
    """One payload per non-blank line; raises InputError naming the first bad line,
    including one whose envelope would be larger than ``limit``."""
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
        try:
            envelope.php_json(payload)
        except envelope.Unencodable as error:  # over 512 levels in all, say
            raise InputError(f"{name}:{number}: PHP's json_encode refuses it too ({error}); "
                             "nothing was published") from None
        if limit is not None:
            _check_size(payload, limit, f"{name}:{number}")
        payloads.append(payload)
    return payloads


def _check_size(payload: dict[str, Any], limit: SizeLimit, where: str) -> None:
    # The pid and the timestamp have a fixed width: the envelope published has this size.
    size = len(envelope.build(limit.queue, payload)[1])
    if size > limit.max_bytes:
        raise InputError(
            f"{where}: its envelope would be {size:,} bytes, above the {limit.max_bytes:,} a "
            f"consumer of {limit.queue} accepts ({limit.source}): it would go to poison "
            "unhandled; nothing was published"
        )


async def publish_all(broker: Any, queue: str, payloads: list[dict[str, Any]]) -> list[str]:
    """Publish in order, ``MAX_BATCH`` per call; returns the pids."""
    pids: list[str] = []
    for start in range(0, len(payloads), MAX_BATCH):
        pids += await broker.publish_many(queue, payloads[start:start + MAX_BATCH])
    return pids
