"""The job envelope, byte-compatible with what `utopia-php/queue` writes and reads.

PHP's ``json_encode`` escapes ``/`` as ``\\/`` and writes an empty payload as ``[]``;
we do the same when we write, and accept both spellings (and unknown extra fields) when
we read. Anything else is malformed: it is reported with a reason and never handed on.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import orjson

#: Envelopes above this size are malformed (they would stall a batch and the ring).
MAX_ENVELOPE_BYTES = 512 * 1024


class MalformedEnvelope(ValueError):
    """The bytes are not a valid job envelope; ``str(error)`` is the reason."""


def new_pid() -> str:
    """A 23-character pid in the shape of PHP's ``uniqid('', true)``.

    8 hex digits of seconds, 5 of microseconds, then a random ``D.DDDDDDDD`` tail. The
    ``random`` module is reseeded after ``fork`` so handler processes do not collide.
    """
    now = time.time()
    seconds = int(now)
    micros = int((now - seconds) * 1_000_000)
    return f"{seconds:08x}{micros:05x}{random.random() * 10:.8f}"


def encode(envelope: dict[str, Any]) -> bytes:
    """Serialise an envelope as PHP's ``json_encode`` would (``\\/``, ``[]`` for empty)."""
    if not envelope.get("payload"):
        envelope = {**envelope, "payload": []}
    # "/" can only occur inside JSON strings, so escaping every one is safe.
    return orjson.dumps(envelope).replace(b"/", b"\\/")


def build(queue: str, payload: dict[str, Any], pid: str | None = None) -> tuple[str, bytes]:
    """A fresh envelope for ``payload``: returns ``(pid, bytes)``."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, not {type(payload).__name__}")
    pid = pid or new_pid()
    return pid, encode(
        {"pid": pid, "queue": queue, "timestamp": int(time.time()), "payload": payload}
    )


def decode(raw: bytes, max_bytes: int = MAX_ENVELOPE_BYTES) -> dict[str, Any]:
    """Decode and validate one envelope; raises MalformedEnvelope with the reason.

    The returned dict has ``payload`` normalised to a dict and ``attempts`` filled in.
    """
    if not raw:
        raise MalformedEnvelope("empty message")
    if len(raw) > max_bytes:
        raise MalformedEnvelope(f"envelope of {len(raw)} bytes exceeds {max_bytes}")
    try:
        envelope = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise MalformedEnvelope(f"invalid JSON: {error}") from None
    if not isinstance(envelope, dict):
        raise MalformedEnvelope(f"envelope is a JSON {_json_type(envelope)}, not an object")
    _require(envelope, "pid", str)
    if not envelope["pid"]:
        raise MalformedEnvelope("pid is empty")
    _require(envelope, "queue", str)
    _require(envelope, "timestamp", int)
    payload = envelope.get("payload", None)
    if payload == []:
        envelope["payload"] = {}
    elif not isinstance(payload, dict):
        raise MalformedEnvelope(f"payload is a JSON {_json_type(payload)}, not an object")
    attempts = envelope.setdefault("attempts", 0)
    if not _is_int(attempts) or attempts < 0:
        raise MalformedEnvelope("attempts is not a non-negative integer")
    return envelope


def with_attempts(envelope: dict[str, Any], attempts: int) -> bytes:
    """The envelope re-encoded with a new ``attempts`` value (used by retries)."""
    return encode({**envelope, "attempts": attempts})


def _require(envelope: dict[str, Any], name: str, kind: type) -> None:
    if name not in envelope:
        raise MalformedEnvelope(f"{name} is missing")
    value = envelope[name]
    if not (_is_int(value) if kind is int else isinstance(value, kind)):
        expected = "an integer" if kind is int else "a string"
        raise MalformedEnvelope(f"{name} is a JSON {_json_type(value)}, not {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    return {
        dict: "object", list: "array", str: "string", int: "number", float: "number",
        bool: "boolean", type(None): "null",
    }.get(type(value), type(value).__name__)


def _reseed_after_fork() -> None:
    random.seed(os.urandom(16))


os.register_at_fork(after_in_child=_reseed_after_fork)
