"""The job envelope, byte-compatible with what `utopia-php/queue` writes and reads.

When we write (publish, retry, recovery), the bytes are what PHP's ``json_encode`` with its
default flags writes for the same value (``php_json``: see ``broker.phpjson``).
``tests/data/php_json_encode.json`` is PHP's truth table for it.

When we read, ``decode`` accepts exactly what a queue-5 PHP worker accepts
(``Broker\\Redis::claim()``): ``json_decode($raw, true, 512, JSON_THROW_ON_ERROR)``, an
array holding non-null ``pid``, ``queue`` and ``timestamp``, ``(int)`` on the timestamp,
then ``new Message($envelope)``, whose typed properties (``string $pid``, ``string $queue``,
``int $timestamp``, ``array $payload``, ``int $attempts``, ``?int $sequence``, no
``strict_types``) coerce the way PHP's weak mode does. Whatever throws there is poison
here, and a value comes out as PHP would see it (``"pid": 12`` is the pid ``"12"``).
On top of PHP, one project rule: a number PHP would silently wrap, saturate or round to
fit a signed 64-bit integer (a ``timestamp`` or ``attempts`` outside that range) is poison,
never a made-up value. ``tests/data/php_redis_decode.json`` holds the truth table, made by
PHP (``tests/data/php_redis_decode.php`` regenerates it).
Anything malformed is reported with a reason and never handed on.
"""

from __future__ import annotations

import math
import os
import random
import re
import time
from collections.abc import Iterable
from typing import Any

import orjson

from broker import phpjson

# Part of this module's API too (re-exported).
from broker.phpjson import MAX_NESTING as MAX_NESTING
from broker.phpjson import Unencodable as Unencodable
from broker.phpjson import php_json as php_json

# decode's fast path: bytes that orjson reads as PHP does (see ``broker.phpjson.loads``).
_SHALLOW_BYTES = phpjson.SHALLOW_BYTES
_DIGITS_AS_ZERO = phpjson.DIGITS_AS_ZERO
_NINETEEN_DIGITS = phpjson.NINETEEN_DIGITS

#: The default size limit of ``decode``: none, as in PHP. A caller may still pass one.
MAX_ENVELOPE_BYTES: int | None = None

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_TWO_63 = 2.0**63  # (double) ZEND_LONG_MAX: a double fits a PHP int iff -2**63 <= d < 2**63

# PHP's numeric strings (``is_numeric_string``): whitespace, sign, digits with an optional
# fraction (either side of the point may be empty, not both) and exponent, whitespace.
_PHP_SPACE = " \t\n\r\v\f"
_NUMBER = r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?"
_NUMERIC_STRING = re.compile(f"[{_PHP_SPACE}]*{_NUMBER}[{_PHP_SPACE}]*", re.ASCII)
_NUMERIC_PREFIX = re.compile(f"[{_PHP_SPACE}]*{_NUMBER}", re.ASCII)


class MalformedEnvelope(ValueError):
    """The bytes are not a valid job envelope; ``str(error)`` is the reason."""


def new_pid(at: float | None = None) -> str:
    """A 23-character pid in the shape of PHP's ``uniqid('', true)``, made now (or ``at``).

    8 hex digits of seconds, 5 of microseconds, then a random ``D.DDDDDDDD`` tail. The
    ``random`` module is reseeded after ``fork`` so handler processes do not collide.
    """
    now = time.time() if at is None else at
    seconds = int(now)
    micros = int((now - seconds) * 1_000_000)
    return f"{seconds:08x}{micros:05x}{random.random() * 10:.8f}"


def encode(envelope: dict[str, Any]) -> bytes:
    """Serialise an envelope as PHP's ``json_encode`` would (``[]`` for an empty payload)."""
    if not envelope.get("payload"):
        envelope = {**envelope, "payload": []}
    return php_json(envelope)


def build(queue: str, payload: dict[str, Any], pid: str | None = None) -> tuple[str, bytes]:
    """A fresh envelope for ``payload``: returns ``(pid, bytes)``."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, not {type(payload).__name__}")
    pid = pid or new_pid()
    return pid, encode(
        {"pid": pid, "queue": queue, "timestamp": int(time.time()), "payload": payload}
    )


def decode_nats(raw: bytes, max_bytes: int | None = MAX_ENVELOPE_BYTES) -> dict[str, Any]:
    """``decode`` as queue 5's ``Broker\\Nats::pull()`` reads a message: the same checks, but
    no ``(int)`` cast of the timestamp before ``new Message()``, so the timestamp must be
    what an ``int`` property takes in PHP's weak mode (``"abc"``, ``""``, ``[]``, ``{}``
    and ``"12abc"`` throw there, so they are poison here; ``"12"``, ``1.5`` and ``true``
    convert). ``tests/data/php_nats_decode.json`` is PHP's truth table for it."""
    return decode(raw, max_bytes, cast_timestamp=False)


def decode(
    raw: bytes, max_bytes: int | None = MAX_ENVELOPE_BYTES, *, cast_timestamp: bool = True
) -> dict[str, Any]:
    """Decode one envelope as a PHP queue-5 worker would; raises MalformedEnvelope (only)
    with the reason where PHP would poison it (or where the project rule above does).

    ``max_bytes`` (None: no limit, as in PHP) makes longer envelopes malformed too.
    The returned dict holds every field of the envelope, unknown ones (``key``,
    ``sequence`` ...) as they were, and: ``pid`` and ``queue`` (str), ``timestamp`` and
    ``attempts`` (int, ``attempts`` 0 when missing or null) and ``payload``: a dict, or a
    list for a non-empty JSON array; ``{}`` when empty, missing or null (PHP has one
    empty array for both ``{}`` and ``[]``, and writes it as ``[]``).
    ``cast_timestamp``: ``Broker\\Redis::claim()``'s ``(int)`` cast first (NATS has none).
    """
    return decode_flagged(raw, max_bytes, cast_timestamp=cast_timestamp)[0]


def decode_flagged(
    raw: bytes, max_bytes: int | None = MAX_ENVELOPE_BYTES, *, cast_timestamp: bool = True
) -> tuple[dict[str, Any], bool]:
    """``decode(raw, ...)``, and whether the envelope is plain: read by decode's fast path,
    so ``orjson.loads(raw)`` is the same dict but for ``attempts``, which it leaves absent
    or null where decode makes it 0. (PHP's reading and orjson's agree on such bytes: at
    most ``_SHALLOW_BYTES``, no run of 19 digits, fields already of the types PHP gives
    them.) The supervisor decodes each envelope at the claim and tells the handler process
    which ones are plain: it reads those with ``orjson.loads`` alone (``worker.message``).
    """
    if not raw:
        raise MalformedEnvelope("empty message")
    if max_bytes is not None and len(raw) > max_bytes:
        raise MalformedEnvelope(f"envelope of {len(raw)} bytes exceeds {max_bytes}")
    # What producers write, inline (it runs for every message claimed): a short document
    # with no run of 19 digits, which orjson reads as PHP does, and fields that need no
    # cast or coercion.
    # find, not "in": bytes' "in" first tries its operand as an integer and pays for the
    # TypeError (about 100 ns, per message).
    if (len(raw) <= _SHALLOW_BYTES
            and raw.translate(_DIGITS_AS_ZERO).find(_NINETEEN_DIGITS) < 0):
        try:
            envelope = orjson.loads(raw)
        except orjson.JSONDecodeError:
            envelope = None
        if type(envelope) is dict and _plain(envelope):
            return envelope, True
    return _decode_read(raw, cast_timestamp)


def decode_many(
    raws: Iterable[bytes], max_bytes: int | None = MAX_ENVELOPE_BYTES
) -> list[tuple[dict[str, Any], bool] | MalformedEnvelope]:
    """``decode_flagged(raw, max_bytes)`` of each of ``raws``, in order: what it returns, or
    the MalformedEnvelope it raises. For a batch claimed: its fast path runs here inline,
    one call per batch instead of one per message (about 10% of a message's decoding)."""
    results: list[tuple[dict[str, Any], bool] | MalformedEnvelope] = []
    append, loads, invalid = results.append, orjson.loads, orjson.JSONDecodeError
    table, needle = _DIGITS_AS_ZERO, _NINETEEN_DIGITS
    limit = _SHALLOW_BYTES if max_bytes is None else min(max_bytes, _SHALLOW_BYTES)
    for raw in raws:
        try:
            # decode_flagged's fast path, with its size checks folded into ``limit``
            if raw and len(raw) <= limit and raw.translate(table).find(needle) < 0:
                try:
                    envelope = loads(raw)
                except invalid:
                    envelope = None
                if type(envelope) is dict and _plain(envelope):
                    append((envelope, True))
                else:
                    append(_decode_read(raw, True))
            else:
                append(decode_flagged(raw, max_bytes))
        except MalformedEnvelope as malformed:
            append(malformed)
    return results


def _decode_read(raw: bytes, cast_timestamp: bool) -> tuple[dict[str, Any], bool]:
    """``decode_flagged`` past its size checks and fast path (for what that did not take)."""
    envelope, wide = _loads(raw)
    if type(envelope) is dict and _plain(envelope):
        return envelope, False  # what producers write: no cast or coercion to make
    if not isinstance(envelope, dict):
        raise MalformedEnvelope(f"envelope is a JSON {_json_type(envelope)}, not an object")
    for name in ("pid", "queue", "timestamp"):  # PHP: isset(), so null is missing too
        if envelope.get(name) is None:
            raise MalformedEnvelope(f"{name} is {'null' if name in envelope else 'missing'}")
    if cast_timestamp:
        envelope["timestamp"] = _int_cast(envelope["timestamp"], "timestamp" in wide)
    else:
        envelope["timestamp"] = _int(envelope["timestamp"], "timestamp", "timestamp" in wide)
    envelope["pid"] = _string(envelope["pid"], "pid")
    envelope["queue"] = _string(envelope["queue"], "queue")
    envelope["payload"] = _payload(envelope.get("payload"))
    attempts = envelope.get("attempts")
    envelope["attempts"] = 0 if attempts is None else _int(attempts, "attempts", "attempts" in wide)
    sequence = envelope.get("sequence")
    if sequence is not None:  # checked as PHP does, kept as it was (nothing here reads it)
        _int(sequence, "sequence", wide=False, exact=False)
    return envelope, False


def requeued(envelope: dict[str, Any], attempts: int, timestamp: int | None = None) -> bytes:
    """The envelope a retry or a recovery pushes back, in the fields and order of queue 5's
    ``retryPayload()``: the same pid, queue and payload, a new timestamp (now, unless
    given), the new attempts count, then ``key`` when the message has one. Other fields
    are dropped, as PHP drops them. Raises Unencodable where ``json_encode`` would throw."""
    fields = {
        "pid": envelope["pid"], "queue": envelope["queue"],
        "timestamp": int(time.time()) if timestamp is None else timestamp,
        "payload": envelope.get("payload") or [], "attempts": attempts,
    }
    if envelope.get("key") is not None:  # PHP: isset()
        fields["key"] = envelope["key"]
    return php_json(fields)

def _plain(envelope: dict[str, Any]) -> bool:
    """True (and ``attempts`` filled in) for the common envelope whose fields already have
    the types PHP would give them: string pid and queue, a 64-bit integer timestamp, an
    object payload, attempts absent, null or a 64-bit integer, no sequence."""
    timestamp, attempts = envelope.get("timestamp"), envelope.get("attempts")
    if not (type(envelope.get("pid")) is str and type(envelope.get("queue")) is str
            and type(timestamp) is int and _INT64_MIN <= timestamp <= _INT64_MAX
            and type(envelope.get("payload")) is dict and "sequence" not in envelope
            and (attempts is None or (type(attempts) is int
                                      and _INT64_MIN <= attempts <= _INT64_MAX))):
        return False
    envelope["attempts"] = attempts or 0
    return True


def _loads(raw: bytes) -> tuple[Any, frozenset[str]]:
    """``broker.phpjson.loads``: JSON PHP refuses is a malformed envelope."""
    try:
        return phpjson.loads(raw)
    except phpjson.InvalidJson as error:
        raise MalformedEnvelope(str(error)) from None


# --- PHP's conversions -----------------------------------------------------------------------


def _string(value: Any, name: str) -> str:
    """``string`` typed property, weak mode: scalars convert, arrays are a TypeError."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return php_float_string(value)
    raise MalformedEnvelope(f"{name} is a JSON {_json_type(value)}, not a string")


def _int_cast(value: Any, wide: bool) -> int:
    """``(int) $value`` (the timestamp), refusing what would not fit signed 64-bit."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return _fitting_double(value, "timestamp", wide)
    if isinstance(value, str):
        match = _NUMERIC_PREFIX.match(value)  # "12abc" is 12, "abc" is 0
        return 0 if match is None else _numeric(match, "timestamp", exact=True)
    return 1 if value else 0  # an array: 0 when empty, else 1


def _int(value: Any, name: str, wide: bool, exact: bool = True) -> int:
    """``int`` typed property, weak mode: bools, integral-enough floats and fully numeric
    strings convert; anything else is a TypeError. ``exact`` adds the project rule."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return _fitting_double(value, name, wide and exact)
    if isinstance(value, str):
        match = _NUMERIC_STRING.fullmatch(value)
        if match is None:
            raise MalformedEnvelope(f"{name} is a string that is not numeric")
        return _numeric(match, name, exact)
    raise MalformedEnvelope(f"{name} is a JSON {_json_type(value)}, not an integer")


def _fitting_double(value: float, name: str, wide: bool) -> int:
    if wide or math.isnan(value) or not -_TWO_63 <= value < _TWO_63:
        raise MalformedEnvelope(f"{name} is outside the signed 64-bit range")
    return int(value)  # toward zero, as PHP does (with a deprecation for a fraction)


def _numeric(match: re.Match[str], name: str, exact: bool) -> int:
    sign, mantissa, exponent = match.groups()
    if "." not in mantissa and exponent is None:  # an integer string
        digits = mantissa.lstrip("0")
        if len(digits) <= 19:
            value = int(sign + (digits or "0"))
            if _INT64_MIN <= value <= _INT64_MAX:
                return value
        if exact:
            raise MalformedEnvelope(f"{name} is outside the signed 64-bit range")
    # PHP reads it as a double (zend_strtod; Python's float() rounds the same way).
    return _fitting_double(float(sign + mantissa + (exponent or "")), name, wide=False)


def _payload(value: Any) -> dict[str, Any] | list[Any]:
    """``array`` typed property: a JSON object or array; null or missing is ``[]``."""
    if value is None or value == []:
        return {}
    if isinstance(value, dict | list):
        return value
    raise MalformedEnvelope(f"payload is a JSON {_json_type(value)}, not an object or array")


def php_float_string(value: float) -> str:
    """PHP's ``(string) $float`` with the default ``precision = 14`` (``zend_gcvt``)."""
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INF" if value > 0 else "-INF"
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return sign + "0"
    # 14 significant digits, correctly rounded: zend_dtoa mode 2, ndigit 14.
    mantissa, _, exponent = f"{abs(value):.13e}".partition("e")
    digits = mantissa[0] + mantissa[2:]
    whole_number = str(int(abs(value))) if value.is_integer() else ""
    # zend_dtoa drops trailing zeros, except on its exact path for integers below 1e15 when
    # a 15th digit of exactly 5 rounds down to even: 555129795735505.0 is "5.5512979573550E+14".
    if not (len(whole_number) == 15 and whole_number[14] == "5" and digits == whole_number[:14]):
        digits = digits.rstrip("0")
    point = int(exponent) + 1  # decpt: digits before the decimal point
    if (point < -3) if point < 0 else (point > 14):
        exp = point - 1
        return f"{sign}{digits[0]}.{digits[1:] or '0'}E{'-' if exp < 0 else '+'}{abs(exp)}"
    if point < 0:
        return f"{sign}0.{'0' * -point}{digits}"
    whole = digits[:point].ljust(point, "0") or "0"
    fraction = digits[point:]
    return f"{sign}{whole}.{fraction}" if fraction else f"{sign}{whole}"


def _json_type(value: Any) -> str:
    return {
        dict: "object", list: "array", str: "string", int: "number", float: "number",
        bool: "boolean", type(None): "null",
    }.get(type(value), type(value).__name__)


def _reseed_after_fork() -> None:
    random.seed(os.urandom(16))


os.register_at_fork(after_in_child=_reseed_after_fork)
