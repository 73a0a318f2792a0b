"""JSON as PHP reads and writes it, for the job envelope (``broker.envelope``).

Writing (``php_json``): the bytes PHP's ``json_encode`` with its default flags writes for the
same value: ``/`` as ``\\/``, non-ASCII as ``\\uXXXX`` (astral characters as surrogate
pairs), floats as ``serialize_precision = -1`` formats them (``1`` for ``1.0``, ``1.0e+25``,
``-0``), an empty object as ``[]`` (PHP decodes ``{}`` and ``[]`` to one empty array), an
object keyed ``"0"``..``"n-1"`` in order as a list (PHP's array is a list then), up to 512
nested levels, and no INF/NAN. ``tests/data/php_json_encode.json`` is PHP's truth table for it.

Reading (``loads``): what ``json_decode($raw, true, 512, JSON_THROW_ON_ERROR)`` accepts and
the values it makes (an integer outside signed 64-bit is a double, 511 levels at most, no
unpaired surrogate escape); whatever throws there raises ``InvalidJson``.

orjson is the fast path both ways; a reference writer and reader in Python take what it
cannot (or would not) do as PHP does.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import orjson

#: PHP's ``json_decode`` default depth is 512, and it counts the level inside the innermost
#: array or object too: 511 nested arrays/objects decode, 512 are a JSON error.
MAX_NESTING = 511

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

#: Runs of 19 digits or more: a JSON integer outside signed 64-bit is one, above this.
#: PHP reads such an integer as a double; orjson does not always: the reference path does.
_LONG_DIGITS = re.compile(rb"[0-9]{19,}")
_INT64_MAX_DIGITS = str(2**63 - 1).encode()
# The same test, first, at memchr speed (the regex costs 6 ns a byte): digits as "0".
DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x2E for byte in range(256))
NINETEEN_DIGITS = b"0" * 19

_SURROGATE = re.compile("[\ud800-\udfff]")


class Unencodable(ValueError):
    """A value PHP's ``json_encode`` refuses too (INF or NAN, more than 512 nested levels);
    ``str(error)`` is the reason."""


class InvalidJson(ValueError):
    """Bytes PHP's ``json_decode`` refuses (it throws a JsonException); ``str(error)`` is the
    reason."""


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


# --- JSON, as PHP's json_decode($raw, true, 512, JSON_THROW_ON_ERROR) reads it ---------------


def loads(raw: bytes) -> tuple[Any, frozenset[str]]:
    """The decoded JSON and the top-level keys whose value is an integer literal outside
    signed 64-bit (PHP reads it as a double: a float here, but see ``decode``).

    orjson is the fast path. It agrees with PHP on every document it accepts that has no
    integer outside signed 64-bit (orjson keeps one up to 2**64 - 1 an int) and is nested
    at most 511 deep; everything else, and everything orjson refuses (such as ``1e400``,
    which PHP reads as INF), goes through ``_loads_like_php``.
    """
    if NINETEEN_DIGITS not in raw.translate(DIGITS_AS_ZERO) or not any(
        len(run) > 19 or run > _INT64_MAX_DIGITS for run in _LONG_DIGITS.findall(raw)
    ):
        try:
            if len(raw) <= SHALLOW_BYTES:  # too short to nest too deep: the usual case
                return orjson.loads(raw), _NO_WIDE
            return _orjson_loads(raw), _NO_WIDE
        except orjson.JSONDecodeError:
            pass
    return _loads_like_php(raw)


_NO_WIDE: frozenset[str] = frozenset()
#: A document this short cannot open MAX_NESTING + 1 levels and close them again.
SHALLOW_BYTES = 2 * MAX_NESTING


def _orjson_loads(raw: bytes) -> Any:
    # Deeper nesting needs MAX_NESTING + 1 opening brackets and as many closing ones.
    if len(raw) <= SHALLOW_BYTES or raw.count(b"[") + raw.count(b"{") <= MAX_NESTING:
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
        raise InvalidJson(f"invalid JSON: {error}") from None
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
            raise InvalidJson(f"invalid JSON: more than {MAX_NESTING} nested levels")
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
        raise InvalidJson("invalid JSON: single unpaired UTF-16 surrogate")
