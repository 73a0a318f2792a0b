"""The job envelope, byte-compatible with what `utopia-php/queue` writes and reads.

When we write (publish, retry, recovery), the bytes are what PHP's ``json_encode`` with its
default flags writes for the same value (``php_json``): ``/`` as ``\\/``, non-ASCII as
``\\uXXXX`` (astral characters as surrogate pairs), floats as ``serialize_precision = -1``
formats them (``1`` for ``1.0``, ``1.0e+25``, ``-0``), an empty object as ``[]`` (PHP decodes
``{}`` and ``[]`` to one empty array), an object keyed ``"0"``..``"n-1"`` in order as a list
(PHP's array is a list then), up to 512 nested levels, and no INF/NAN.
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
never a made-up value. ``tests/test_envelope.py`` holds the truth table, produced by PHP.
Anything malformed is reported with a reason and never handed on.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import os
import random
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

#: The default size limit of ``decode``: none, as in PHP. A caller may still pass one.
MAX_ENVELOPE_BYTES: int | None = None

#: PHP's ``json_decode`` default depth is 512, and it counts the level inside the innermost
#: array or object too: 511 nested arrays/objects decode, 512 are a JSON error.
MAX_NESTING = 511

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_TWO_63 = 2.0**63  # (double) ZEND_LONG_MAX: a double fits a PHP int iff -2**63 <= d < 2**63

#: Runs of 19 digits or more: a JSON integer outside signed 64-bit is one, above this.
#: PHP reads such an integer as a double; orjson does not always: the reference path does.
_LONG_DIGITS = re.compile(rb"[0-9]{19,}")
_INT64_MAX_DIGITS = str(2**63 - 1).encode()
# The same test, first, at memchr speed (the regex costs 6 ns a byte): digits as "0".
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x2E for byte in range(256))
_NINETEEN_DIGITS = b"0" * 19

# PHP's numeric strings (``is_numeric_string``): whitespace, sign, digits with an optional
# fraction (either side of the point may be empty, not both) and exponent, whitespace.
_PHP_SPACE = " \t\n\r\v\f"
_NUMBER = r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?"
_NUMERIC_STRING = re.compile(f"[{_PHP_SPACE}]*{_NUMBER}[{_PHP_SPACE}]*", re.ASCII)
_NUMERIC_PREFIX = re.compile(f"[{_PHP_SPACE}]*{_NUMBER}", re.ASCII)
_SURROGATE = re.compile("[\ud800-\udfff]")


class MalformedEnvelope(ValueError):
    """The bytes are not a valid job envelope; ``str(error)`` is the reason."""


class Unencodable(ValueError):
    """A value PHP's ``json_encode`` refuses too (INF or NAN, more than 512 nested levels);
    ``str(error)`` is the reason."""


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


# --- JSON, as PHP's json_encode($value) writes it -------------------------------------------

#: json_encode's default depth: 512 nested arrays are written, 513 are an error.
MAX_ENCODE_NESTING = 512


def php_json(value: Any) -> bytes:
    """``json_encode($value)`` (default flags) of the PHP value ``value`` decodes to.

    orjson writes it and a few byte-level passes turn its output into PHP's; values it
    cannot take (more than 255 levels, which orjson refuses) and objects keyed ``"0"``..
    (rare) go through ``_encode_like_php``, the reference writer.
    """
    try:
        out = orjson.dumps(value)
    except TypeError:  # nested too deep for orjson, or a type it does not know
        return _encode_like_php(value)
    # One pass makes a short view of the bytes for the checks below; a regex over the
    # bytes or a walk of the value costs more, on every publish.
    view = out.translate(_VIEW, _UNVIEWED)
    if b'{"":' in view and b'{"0":' in out:  # maybe an object PHP holds as a list
        return _encode_like_php(value)
    if b"null" in view:  # orjson writes INF and NAN as null; json_encode throws
        _check_finite(value)
    if b":." in view or b":e" in view or b"{}" in view or type(value) is float:
        out = orjson.dumps(_as_php_writes(value))  # maybe a float or an empty object
    out = out.replace(b"/", b"\\/")  # "/" only occurs inside strings
    if not out.isascii():  # nor does anything non-ASCII
        out = out.decode().encode("ascii", _ESCAPE)
    return out


# The view keeps the bytes that matter, with those before a value (":", ",", "[") made ":"
# and digits and signs dropped: a float (it always has a "." or an exponent) shows as ":."
# or ":e", an empty object as "{}", {"0": as {"": (and {"pid": as {"p":), null as itself.
# Strings can look the same: the exact pass then changes nothing.
_VIEW = bytes(0x3A if byte in b":,[" else byte for byte in range(256))
_UNVIEWED = bytes(byte for byte in range(256) if byte not in b':,[.e{}"nulp')
_EMPTY = orjson.Fragment(b"[]")


def _as_php_writes(value: Any) -> Any:
    """``value`` with each float and empty object replaced by the bytes json_encode writes
    for it (orjson copies a Fragment as it is). Only for what orjson could write: at most
    255 levels, so recursion is safe."""
    if isinstance(value, dict):
        return {key: _as_php_writes(item) for key, item in value.items()} if value else _EMPTY
    if isinstance(value, list | tuple):
        return [_as_php_writes(item) for item in value]
    if isinstance(value, float):
        return orjson.Fragment(php_json_float(value).encode())
    return value


def php_json_float(value: float) -> str:
    """A float as json_encode writes it (``smart_str_append_double``, serialize_precision
    -1): the shortest digits that read back the same, exponent form below 1e-4 or from
    1e17 (``1.0e+25``, ``1.5e-7``), no ``.0`` on a whole number."""
    if not math.isfinite(value):
        raise Unencodable("Inf and NaN cannot be JSON encoded")
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    text = repr(value)  # the shortest round-trip digits, as zend_gcvt's mode 0
    sign = "-" if text[0] == "-" else ""
    mantissa, _, exponent = text.lstrip("-").partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    point = len(whole) + int(exponent or 0)  # decpt: digits before the decimal point
    significant = digits.lstrip("0")
    point -= len(digits) - len(significant)
    digits = significant.rstrip("0")
    if point < -3 or point > 17:
        exp = point - 1
        return f"{sign}{digits[0]}.{digits[1:] or '0'}e{'-' if exp < 0 else '+'}{abs(exp)}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    fraction = digits[point:]
    return sign + digits[:point].ljust(point, "0") + (f".{fraction}" if fraction else "")


def _check_finite(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is float and not math.isfinite(item):
            raise Unencodable("Inf and NaN cannot be JSON encoded")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _escape_non_ascii(error: UnicodeError) -> tuple[str, int]:
    """Codec error handler: what json_encode writes for characters outside ASCII."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    units = error.object[error.start:error.end].encode("utf-16-be")
    return "".join(
        f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2)
    ), error.end


_ESCAPE = "php-json-escape"
codecs.register_error(_ESCAPE, _escape_non_ascii)


def _encode_like_php(value: Any) -> bytes:
    """The reference writer: PHP's json_encode rules, in Python, without recursion (512
    levels would take more frames than Python allows)."""
    parts: list[str] = []
    # Open containers: their (key or None, item) pairs still to write and closing bracket.
    frames: list[tuple[Iterator[tuple[str | None, Any]], str]] = [(iter([(None, value)]), "")]
    while frames:
        items, closer = frames[-1]
        entry = next(items, None)
        if entry is None:  # every item written, each followed by ","
            frames.pop()
            if closer:
                parts[-1] = closer
                parts.append(",")
            continue
        key, item = entry
        if key is not None:
            parts += (_php_string(key), ":")
        if isinstance(item, dict | list | tuple):
            if len(frames) > MAX_ENCODE_NESTING:  # an empty one counts too
                raise Unencodable(f"more than {MAX_ENCODE_NESTING} nested levels")
            if item:
                frames.append(_open(item, parts))
            else:
                parts += ("[]", ",")  # PHP has one empty array for {} and []
        else:
            parts += (_scalar(item), ",")
    return "".join(parts[:-1]).encode("ascii")


def _open(
    value: dict[str, Any] | list[Any] | tuple[Any, ...], parts: list[str]
) -> tuple[Iterator[tuple[str | None, Any]], str]:
    if isinstance(value, dict):
        if not all(type(key) is str for key in value):
            raise TypeError("Dict key must be str")
        if not _php_list(value):
            parts.append("{")
            return iter(value.items()), "}"
        value = list(value.values())
    parts.append("[")
    return zip(itertools.repeat(None), value), "]"


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return _php_string(value)
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, int):
        if not _INT64_MIN <= value < 2**64:  # as orjson: PHP has no wider integer
            raise TypeError("Integer exceeds 64-bit range")
        return str(int(value))
    if isinstance(value, float):
        return php_json_float(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _php_list(value: dict[str, Any]) -> bool:
    """PHP turned this object into a list: its keys are "0".."n-1" in order."""
    return all(key == str(index) for index, key in enumerate(value))


def _php_string(text: str) -> str:
    # Python escapes DEL (0x7f) as \u007f; PHP writes it as it is.
    if "\x7f" in text:
        quoted = '"' + "\x7f".join(_ascii_json(part)[1:-1] for part in text.split("\x7f")) + '"'
    else:
        quoted = _ascii_json(text)
    return quoted.replace("/", "\\/")


_ascii_json = json.encoder.encode_basestring_ascii


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


# --- JSON, as PHP's json_decode($raw, true, 512, JSON_THROW_ON_ERROR) reads it ---------------


def _loads(raw: bytes) -> tuple[Any, frozenset[str]]:
    """The decoded JSON and the top-level keys whose value is an integer literal outside
    signed 64-bit (PHP reads it as a double: a float here, but see ``decode``).

    orjson is the fast path. It agrees with PHP on every document it accepts that has no
    integer outside signed 64-bit (orjson keeps one up to 2**64 - 1 an int) and is nested
    at most 511 deep; everything else, and everything orjson refuses (such as ``1e400``,
    which PHP reads as INF), goes through ``_loads_like_php``.
    """
    if _NINETEEN_DIGITS not in raw.translate(_DIGITS_AS_ZERO) or not any(
        len(run) > 19 or run > _INT64_MAX_DIGITS for run in _LONG_DIGITS.findall(raw)
    ):
        try:
            if len(raw) <= _SHALLOW_BYTES:  # too short to nest too deep: the usual case
                return orjson.loads(raw), _NO_WIDE
            return _orjson_loads(raw), _NO_WIDE
        except orjson.JSONDecodeError:
            pass
    return _loads_like_php(raw)


_NO_WIDE: frozenset[str] = frozenset()
#: A document this short cannot open MAX_NESTING + 1 levels and close them again.
_SHALLOW_BYTES = 2 * MAX_NESTING


def _orjson_loads(raw: bytes) -> Any:
    # Deeper nesting needs MAX_NESTING + 1 opening brackets and as many closing ones.
    if len(raw) <= _SHALLOW_BYTES or raw.count(b"[") + raw.count(b"{") <= MAX_NESTING:
        return orjson.loads(raw)
    # orjson refuses more than 1024 nested levels: inside _PAD arrays, that is PHP's 511.
    # (Walking the result instead would cost a millisecond on a payload of many objects.)
    value = orjson.loads(_PAD_OPEN + raw + _PAD_CLOSE)
    for _ in range(_PAD):
        # A level of more than one item means raw was not one document ("[1],[2]").
        if len(value) != 1:
            raise orjson.JSONDecodeError("not a single JSON document", "", 0)
        value = value[0]
    return value


_PAD = 1024 - MAX_NESTING
_PAD_OPEN, _PAD_CLOSE = b"[" * _PAD, b"]" * _PAD


class _WideInt(float):
    """A JSON integer literal outside signed 64-bit, read as PHP reads it: a double."""

    __slots__ = ()


def _parse_int(text: str) -> int | float:
    digits = text.lstrip("-").lstrip("0")
    if len(digits) <= 19:
        value = int(text)
        if _INT64_MIN <= value <= _INT64_MAX:
            return value
    return _WideInt(text)  # correctly rounded, like PHP's zend_strtod


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_PHP_JSON = json.JSONDecoder(parse_int=_parse_int, parse_constant=_refuse_constant)


def _loads_like_php(raw: bytes) -> tuple[Any, frozenset[str]]:
    """The reference reader: Python's json module, told what PHP's parser does differently
    (no NaN/Infinity, no unpaired surrogate escapes, 511 levels, wide integers as doubles).
    """
    try:
        # Strict UTF-8 (no BOM, no surrogates, no overlongs), as PHP's scanner checks it.
        text = bytes(raw).decode("utf-8")
        value = _PHP_JSON.decode(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError ...
        raise MalformedEnvelope(f"invalid JSON: {error}") from None
    wide = frozenset(
        k for k, v in value.items() if type(v) is _WideInt
    ) if isinstance(value, dict) else frozenset()
    return _as_php_reads(value), wide


def _as_php_reads(value: Any) -> Any:
    """Check the depth and the strings, and turn ``_WideInt`` into plain floats (in place)."""
    if type(value) is _WideInt:
        return float(value)
    if isinstance(value, str):
        _check_string(value)
        return value
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if not isinstance(container, dict | list):
            continue
        if depth > MAX_NESTING:
            raise MalformedEnvelope(f"invalid JSON: more than {MAX_NESTING} nested levels")
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in items:
            if isinstance(key, str):
                _check_string(key)
            if isinstance(item, str):
                _check_string(item)
            elif type(item) is _WideInt:
                container[key] = float(item)
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1))
    return value


def _check_string(text: str) -> None:
    if _SURROGATE.search(text):
        raise MalformedEnvelope("invalid JSON: single unpaired UTF-16 surrogate")


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
