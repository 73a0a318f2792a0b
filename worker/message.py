"""The object a handler function receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from broker import envelope


@dataclass(slots=True)
class Message:
    """One job as the handler sees it. ``receipt`` identifies the delivery; it is opaque
    to handlers and only meaningful to the supervisor that handed the job out.

    ``payload`` is what a PHP worker would get: usually a dict, but a list when the
    producer sent a non-empty JSON array (PHP has one array type for both); ``attempts``
    may be any signed 64-bit value, as in PHP."""

    pid: str
    queue: str
    timestamp: int
    attempts: int
    payload: dict[str, Any] | list[Any]
    receipt: int = field(repr=False)

    @classmethod
    def from_raw(
        cls, raw: bytes, receipt: int, attempts: int | None = None, plain: bool = False
    ) -> Message:
        """Decode a raw envelope (the supervisor validated it already; raises
        MalformedEnvelope if it is not valid after all). ``attempts``, when the broker
        counts them itself, overrides the envelope's field. ``plain``: the supervisor found
        the envelope plain (``envelope.decode_flagged``), so orjson reads it as decode
        would, without decode's checks: only a missing or null ``attempts`` is left to fill.
        """
        if plain:
            fields = orjson.loads(raw)
            if attempts is None:
                attempts = fields.get("attempts") or 0
        else:
            # The supervisor applied its size limit; do not apply another one here.
            fields = envelope.decode(raw, max_bytes=None)
            if attempts is None:
                attempts = fields["attempts"]
        return cls(
            fields["pid"], fields["queue"], fields["timestamp"], attempts, fields["payload"],
            receipt,
        )
