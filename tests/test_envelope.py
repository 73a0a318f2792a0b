"""The envelope codec: byte-compatible with PHP's json_encode when it writes, and accepting
exactly what a PHP queue-5 worker accepts when it reads (the truth table, made by PHP, is
tests/data/php_redis_decode.json)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import envelope, phpjson
from broker.envelope import MalformedEnvelope
from worker.message import Message

# Written by utopia-php/queue 1.x (PHP json_encode): "\/" escapes, [] for an empty payload.
PHP = (
    b'{"pid":"65f1c2a3b4c5d6.12345678","queue":"v1-stats-usage","timestamp":1710000000,'
    b'"payload":{"url":"https:\\/\\/example.com\\/a\\/b","n":1}}'
)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def with_fields(**fields: Any) -> bytes:
    """An envelope with pid "p", queue "q", timestamp 1 and ``fields`` (JSON texts)."""
    values = {"pid": '"p"', "queue": '"q"', "timestamp": "1", **fields}
    return ("{" + ",".join(f'"{k}":{v}' for k, v in values.items()) + "}").encode()


def test_php_envelope_decodes():
    decoded = envelope.decode(PHP)
    assert decoded["pid"] == "65f1c2a3b4c5d6.12345678"
    assert decoded["queue"] == "v1-stats-usage"
    assert decoded["timestamp"] == 1710000000
    assert decoded["payload"] == {"url": "https://example.com/a/b", "n": 1}
    assert decoded["attempts"] == 0


def test_empty_php_payload_becomes_a_dict():
    raw = b'{"pid":"p","queue":"q","timestamp":1,"payload":[],"attempts":4}'
    decoded = envelope.decode(raw)
    assert decoded["payload"] == {} and decoded["attempts"] == 4


def test_a_json_array_payload_stays_a_list():
    decoded = envelope.decode(with_fields(payload='[{"a":1},2]'))
    assert decoded["payload"] == [{"a": 1}, 2]


def test_unknown_fields_are_kept():
    raw = b'{"pid":"p","queue":"q","timestamp":1,"payload":{},"priority":true,"x":[1]}'
    decoded = envelope.decode(raw)
    assert decoded["priority"] is True and decoded["x"] == [1]


@pytest.mark.parametrize("key", ['"k"', "7", "null", '["a",{"b":1}]', "1.5", "false"])
def test_key_is_kept_as_it_was(key):
    decoded = envelope.decode(with_fields(key=key))
    assert decoded["key"] == json.loads(key) and type(decoded["key"]) is type(json.loads(key))


def test_values_come_out_as_php_sees_them():
    decoded = envelope.decode(
        b'{"pid":12,"queue":1.5,"timestamp":"1700000000.9 s","attempts":" 3 ","sequence":"4"}'
    )
    assert (decoded["pid"], decoded["queue"]) == ("12", "1.5")
    assert (decoded["timestamp"], decoded["attempts"]) == (1700000000, 3)
    assert decoded["sequence"] == "4"  # checked like PHP's ?int, kept as it was


def test_encode_writes_like_php():
    raw = envelope.encode({
        "pid": "p", "queue": "q", "timestamp": 1, "payload": {"url": "a/b"},
    })
    assert raw == b'{"pid":"p","queue":"q","timestamp":1,"payload":{"url":"a\\/b"}}'
    empty = envelope.encode({"pid": "p", "queue": "q", "timestamp": 1, "payload": {}})
    assert empty.endswith(b'"payload":[]}')


def test_php_envelope_round_trips_byte_for_byte():
    decoded = orjson.loads(PHP)
    assert envelope.encode(decoded) == PHP


def test_build_makes_a_fresh_php_shaped_pid():
    pid, raw = envelope.build("q", {"a": 1})
    assert re.fullmatch(r"[0-9a-f]{13}\d\.\d{8}", pid)
    decoded = envelope.decode(raw)
    assert decoded["pid"] == pid and decoded["queue"] == "q" and decoded["payload"] == {"a": 1}
    assert "attempts" not in orjson.loads(raw)  # producers leave it out, as PHP does
    assert envelope.build("q", {})[0] != pid
    with pytest.raises(TypeError):
        envelope.build("q", ["not", "a", "dict"])  # type: ignore[arg-type]


def test_requeued_reencodes():
    raw = envelope.requeued(envelope.decode(PHP), 3)
    decoded = envelope.decode(raw)
    assert decoded["attempts"] == 3 and decoded["payload"]["url"] == "https://example.com/a/b"
    assert b"\\/" in raw


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "empty message"),
        (b"{not json", "invalid JSON"),
        (b"\x00\xff\xfe\x80", "invalid JSON"),
        (b'{"pid":"p","queue":"q","timestamp":1e400', "invalid JSON"),
        (b"[1,2]", "JSON array, not an object"),
        (b'"text"', "JSON string, not an object"),
        (b"null", "JSON null, not an object"),
        (b'{"queue":"q","timestamp":1,"payload":{}}', "pid is missing"),
        (b'{"pid":null,"queue":"q","timestamp":1}', "pid is null"),
        (b'{"pid":["p"],"queue":"q","timestamp":1}', "pid is a JSON array, not a string"),
        (b'{"pid":"p","queue":{},"timestamp":1}', "queue is a JSON object, not a string"),
        (b'{"pid":"p","timestamp":1,"payload":{}}', "queue is missing"),
        (b'{"pid":"p","queue":"q","payload":{}}', "timestamp is missing"),
        (b'{"pid":"p","queue":"q","timestamp":null}', "timestamp is null"),
        (with_fields(timestamp="1e19"), "timestamp is outside the signed 64-bit range"),
        (with_fields(payload='"x"'), "payload is a JSON string, not an object or array"),
        (with_fields(payload="0"), "payload is a JSON number, not an object or array"),
        (with_fields(payload="false"), "payload is a JSON boolean, not an object or array"),
        (with_fields(attempts='"2x"'), "attempts is a string that is not numeric"),
        (with_fields(attempts='""'), "attempts is a string that is not numeric"),
        (with_fields(attempts="[2]"), "attempts is a JSON array, not an integer"),
        (with_fields(attempts="1e19"), "attempts is outside the signed 64-bit range"),
        (with_fields(attempts="9223372036854775808"), "attempts is outside the signed 64-bit"),
        (with_fields(sequence='"abc"'), "sequence is a string that is not numeric"),
        (with_fields(sequence="1e19"), "sequence is outside the signed 64-bit range"),
        (with_fields(pid='"\\ud800"'), "unpaired UTF-16 surrogate"),
        (with_fields(payload="[" * 511 + "]" * 511), "more than 511 nested levels"),
    ],
)
def test_malformed_envelopes_have_a_reason(raw, reason):
    with pytest.raises(MalformedEnvelope, match=re.escape(reason)):
        envelope.decode(raw)


def test_no_size_limit_unless_asked_for_one():
    raw = envelope.build("q", {"blob": "x" * 2000})[1]
    assert envelope.decode(raw, max_bytes=len(raw))
    with pytest.raises(MalformedEnvelope, match="exceeds"):
        envelope.decode(raw, max_bytes=len(raw) - 1)
    big = envelope.build("q", {"blob": "x" * (4 * 1024 * 1024)})[1]
    assert envelope.decode(big)["payload"]["blob"] == "x" * (4 * 1024 * 1024)  # as in PHP
    assert envelope.decode(big, max_bytes=None)


# --- signed 64-bit: every value a Python handler gets is the one written ---------------------


@pytest.mark.parametrize(
    "attempts",
    ["9223372036854775808", "-9223372036854775809", "18446744073709551616", "1" * 400,
     "1e19", "-1e19", "1e400", '"9223372036854775808"', '"-9223372036854775809"',
     '"99999999999999999999"', '"1e19"'],
)
def test_attempts_beyond_signed_64_bit_are_poison(attempts):
    # PHP throws on most of these; it would make -9223372036854775809 into INT64_MIN.
    with pytest.raises(MalformedEnvelope, match="outside the signed 64-bit range"):
        envelope.decode(with_fields(attempts=attempts))


@pytest.mark.parametrize("attempts", [INT64_MIN, -1, 0, 4294967296, INT64_MAX])
def test_attempts_anywhere_in_signed_64_bit_decode(attempts):
    assert envelope.decode(with_fields(attempts=str(attempts)))["attempts"] == attempts
    assert envelope.decode(with_fields(attempts=f'"{attempts}"'))["attempts"] == attempts


@pytest.mark.parametrize("timestamp", [INT64_MIN, -1, 0, 1710000000, INT64_MAX])
def test_timestamps_anywhere_in_signed_64_bit_decode(timestamp):
    assert envelope.decode(with_fields(timestamp=str(timestamp)))["timestamp"] == timestamp


# --- JSON depth: PHP's json_decode($raw, true) allows 511 nested arrays or objects -------------


@pytest.mark.parametrize("wide", [False, True], ids=["fast path", "reference path"])
@pytest.mark.parametrize(("levels", "accepted"), [(510, True), (511, False), (600, False),
                                                  (1023, False), (1100, False), (5000, False)])
def test_payload_nesting_is_limited_as_in_php(levels, accepted, wide):
    # The envelope is one level: a payload of 510 nested arrays makes 511. A wide integer
    # (PHP reads it as a double) sends the envelope through the reference parser.
    extra = ',"n":98765432109876543210' if wide else ""
    raw = b'{"pid":"p","queue":"q","timestamp":1%s,"payload":%s%s}' % (
        extra.encode(), b"[" * levels, b"]" * levels)
    if accepted:
        assert envelope.decode(raw)["payload"]
    else:
        with pytest.raises(MalformedEnvelope, match="invalid JSON"):
            envelope.decode(raw)


@pytest.mark.parametrize(("levels", "accepted"), [(510, True), (511, False)])
def test_object_nesting_is_limited_as_in_php(levels, accepted):
    raw = b'{"pid":"p","queue":"q","timestamp":1,"key":%s1%s}' % (
        b'{"a":' * levels, b"}" * levels)
    if accepted:
        assert envelope.decode(raw)["key"]["a"]
    else:
        with pytest.raises(MalformedEnvelope):
            envelope.decode(raw)


@pytest.mark.parametrize(
    "raw",
    [b"[" * 600 + b"1],[2" + b"]" * 600, b"[" * 600 + b"]" * 600 + b",{}",
     b"{}," + b"[" * 600 + b"]" * 600, b"[" * 600 + b"]" * 599],
)
def test_deep_documents_that_are_not_one_document_are_invalid(raw):
    with pytest.raises(MalformedEnvelope, match="invalid JSON"):
        envelope.decode(raw)


# --- PHP's (string) of a float: precision 14, "E+"/"E-" ----------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0, "0"), (-0.0, "-0"), (1.0, "1"), (1.5, "1.5"), (-1.5, "-1.5"), (0.1, "0.1"),
     (0.1 + 0.2, "0.3"), (1e14, "1.0E+14"), (99999999999999.0, "99999999999999"),
     (999999999999999.0, "1.0E+15"), (123456789012345.0, "1.2345678901234E+14"),
     (1e20, "1.0E+20"), (0.0001, "0.0001"), (1e-5, "1.0E-5"), (-1.5e-7, "-1.5E-7"),
     (2.0**63, "9.2233720368548E+18"), (5e-324, "4.9406564584125E-324"),
     (1.7976931348623157e308, "1.7976931348623E+308"), (math.inf, "INF"),
     (-math.inf, "-INF"), (math.nan, "NAN"),
     # zend_dtoa keeps the zeros when a 15th digit of exactly 5 rounds an integer down to even
     (555129795735505.0, "5.5512979573550E+14"), (450000000000005.0, "4.5000000000000E+14"),
     (100000000000015.0, "1.0000000000002E+14"), (100000000000001.0, "1.0E+14")],
)
def test_php_float_string(value, text):
    assert envelope.php_float_string(value) == text


# --- decode() returns an envelope or raises MalformedEnvelope, nothing else -------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)

any_json = st.recursive(
    st.none() | st.booleans() | st.text() | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers() | st.integers(-(2**65), 2**65) | st.sampled_from([
        "12", " 12 ", "12abc", "1e3", "1e19", "-9223372036854775809", "1.5", ".5", "1.", "",
        "abc", "\ud800", "0x1A", "\x0b7", "9223372036854775807", "INF",
    ]),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=10,
)
FIELDS = ("pid", "queue", "timestamp", "payload", "attempts", "sequence", "key")
envelopes = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=3), any_json, max_size=8)


def check_decode(raw: bytes) -> dict[str, Any] | None:
    """decode(raw), checking what comes out; None when it is poison."""
    try:
        decoded = envelope.decode(raw)
    except MalformedEnvelope:
        return None
    assert type(decoded["pid"]) is str and type(decoded["queue"]) is str
    for name in ("timestamp", "attempts"):
        assert type(decoded[name]) is int and INT64_MIN <= decoded[name] <= INT64_MAX
    assert isinstance(decoded["payload"], dict | list)
    # Whatever was accepted can be re-encoded for a retry, and decodes again.
    again = envelope.decode(envelope.requeued(decoded, 1, decoded["timestamp"]))
    assert (again["pid"], again["queue"], again["timestamp"], again["attempts"]) == (
        decoded["pid"], decoded["queue"], decoded["timestamp"], 1)
    return decoded


@settings(max_examples=500)
@given(raw=st.binary(max_size=200))
def test_decode_of_arbitrary_bytes_returns_or_raises_malformed(raw):
    check_decode(raw)


@pytest.mark.slow
@settings(max_examples=500)
@given(document=envelopes, ensure_ascii=st.booleans())
def test_decode_of_arbitrary_json_objects_returns_or_raises_malformed(document, ensure_ascii):
    check_decode(json.dumps(document, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass"))


def decode_or_none(raw: bytes) -> dict[str, Any] | None:
    try:
        return envelope.decode(raw)
    except MalformedEnvelope:
        return None


def reference_decode(raw: bytes) -> dict[str, Any] | None:
    """decode() with orjson out of the way: the reference parser only."""

    def refuse(_raw: bytes) -> Any:
        raise orjson.JSONDecodeError("refused", "", 0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(phpjson, "_orjson_loads", refuse)
        return decode_or_none(raw)


def mutate(raw: bytes, edits: list[tuple[int, int]]) -> bytes:
    data = bytearray(raw)
    for position, byte in edits:
        data[position % len(data)] = byte
    return bytes(data)


@pytest.mark.slow
@settings(max_examples=300)
@given(document=envelopes,
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(b'{}[]",:\\ 0e.-\xff')),
                      max_size=2))
def test_the_orjson_fast_path_agrees_with_the_reference_parser(document, edits):
    raw = mutate(json.dumps(document).encode(), edits)
    assert decode_or_none(raw) == reference_decode(raw)


@given(payload=st.dictionaries(st.text(), json_values, max_size=6), attempts=st.integers(0, 99))
def test_round_trip(payload, attempts):
    pid, raw = envelope.build("queue/with/slashes", payload)
    assert b"/" not in raw.replace(b"\\/", b"")
    first = envelope.decode(raw)
    decoded = envelope.decode(envelope.requeued(first, attempts, first["timestamp"]))
    assert decoded["pid"] == pid and decoded["queue"] == "queue/with/slashes"
    assert decoded["payload"] == (php_holds(payload) or {}) and decoded["attempts"] == attempts


# --- the truth table -------------------------------------------------------------------------
# tests/data/php_redis_decode.json: raw envelopes and what PHP 8.2 made of them, not written by
# hand: each went through the steps of queue 5's Broker\Redis::claim() in a real PHP (see
# php_redis_decode.php beside it, which produced them) -- json_decode, the isset() of pid,
# queue and timestamp, the (int) cast of the timestamp, then new Message() with Message's typed
# properties and PHP 8's coercive typing. A deprecation (a float with a fraction to int) does
# not throw, so it does not poison. Each row: the raw bytes, then None (PHP poisons it) or
# (pid, queue, timestamp, payload, attempts[, key]) as decode() must return them: PHP's
# values, with JSON object keys kept as strings ({"0": 1} is not turned into [1]) and an empty
# payload as {}; key, the envelope's own as json_decode left it, when it has one.

PHP_REDIS = json.loads((Path(__file__).parent / "data" / "php_redis_decode.json").read_text())
TRUTH_TABLE: list[tuple[bytes, tuple[Any, ...] | None]] = [
    (bytes.fromhex(row["in_hex"]) if "in_hex" in row else row["in"].encode(),
     None if row["php"] is None else tuple(row["php"]))
    for row in PHP_REDIS["rows"]
]
assert len(TRUTH_TABLE) == 1141, len(TRUTH_TABLE)  # a truncated file fails here, not quietly


def test_the_truth_table_was_made_by_php_8_2():
    assert PHP_REDIS["produced_by"].startswith("PHP 8.2")

# The only envelopes PHP accepts and decode() does not: a timestamp or attempts outside signed
# 64-bit, which PHP wraps, saturates or rounds to fit (each row holds the values PHP made of
# it). A handler must never see a timestamp or attempts that nobody wrote.
PHP_WRAPS_OR_SATURATES: list[tuple[bytes, tuple[Any, ...]]] = [
    (b'{"pid":"p","queue":"q","timestamp":9223372036854775808,"payload":{"a":1}}',
     ("p", "q", -9223372036854775808, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":-9223372036854775809,"payload":{"a":1}}',
     ("p", "q", -9223372036854775808, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":18446744073709551615,"payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":18446744073709551616,"payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":123456789012345678901234567890,"payload":{"a":1}}',
     ("p", "q", -4362897323387256832, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":-123456789012345678901234567890,"payload":{"a":1}}',
     ("p", "q", 4362897323387256832, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1' + b'0' * 400 + b',"payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":' + b'1' * 5000 + b',"payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1e20,"payload":{"a":1}}',
     ("p", "q", 7766279631452241920, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1e22,"payload":{"a":1}}',
     ("p", "q", 1864712049423024128, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1.7976931348623157e308,"payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1e308,"payload":{"a":1}}', ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1e400,"payload":{"a":1}}', ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":-1e400,"payload":{"a":1}}', ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":9.2233720368547758e18,"payload":{"a":1}}',
     ("p", "q", -9223372036854775808, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":-9.223372036854777e18,"payload":{"a":1}}',
     ("p", "q", 9223372036854773760, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":1.8446744073709552e19,"payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"9223372036854775808","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"-9223372036854775809","payload":{"a":1}}',
     ("p", "q", -9223372036854775808, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"' + b'9' * 20 + b'","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"1' + b'0' * 30 + b'","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"1e19","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"9.2233720368547758e18","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"1e400","payload":{"a":1}}', ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"-1e400","payload":{"a":1}}', ("p", "q", 0, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"9223372036854775807.0","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"' + b'9' * 20 + b'abc","payload":{"a":1}}',
     ("p", "q", 9223372036854775807, {"a": 1}, 0)),
    (b'{"pid":"p","queue":"q","timestamp":"1e400abc","payload":{"a":1}}',
     ("p", "q", 0, {"a": 1}, 0)),
    (
        b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1},"attempts":-922337203685477580' +
        b'9}',
     ("p", "q", 1, {"a": 1}, -9223372036854775808)),
    (
        b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1},"attempts":"-92233720368547758' +
        b'09"}',
     ("p", "q", 1, {"a": 1}, -9223372036854775808)),
]

def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down ("1" is not 1, 1 is not 1.0 nor True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def row_id(raw: bytes) -> str:
    return raw[:70].decode("ascii", "backslashreplace")


@pytest.mark.parametrize(("raw", "expected"), TRUTH_TABLE, ids=[row_id(r) for r, _ in TRUTH_TABLE])
def test_decode_agrees_with_php(raw, expected):
    if expected is None:
        with pytest.raises(MalformedEnvelope):
            envelope.decode(raw)
        return
    decoded = envelope.decode(raw)
    got = tuple(decoded[k] for k in ("pid", "queue", "timestamp", "payload", "attempts"))
    if len(expected) == 6:
        got += (decoded["key"],)
    assert same(got, expected), (got, expected)


@pytest.mark.parametrize(
    ("raw", "php"), PHP_WRAPS_OR_SATURATES, ids=[row_id(r) for r, _ in PHP_WRAPS_OR_SATURATES]
)
def test_what_php_would_wrap_or_saturate_is_poison(raw, php):
    with pytest.raises(MalformedEnvelope, match="outside the signed 64-bit range"):
        envelope.decode(raw)


# --- what we write: PHP's json_encode, byte for byte -----------------------------------------
# tests/data/php_json_encode.json: raw envelopes and the bytes PHP 8.2's json_encode wrote for
# the retryPayload() and the publish() envelope built from each (see php_json_encode.php
# beside it, which produced them). Floats of every shape, integers past 64 bits, non-ASCII
# and astral characters, "/", control characters, empty and list-keyed objects, attempts and
# key, and nesting from 250 to 512 levels.

PHP_ENCODE = json.loads((Path(__file__).parent / "data" / "php_json_encode.json").read_text())
ENCODE_ROWS = PHP_ENCODE["rows"]


def written(decoded: dict[str, Any], kind: str) -> bytes | str:
    """What we write for a decoded envelope (bytes), or the Unencodable reason."""
    try:
        if kind == "requeue":
            return envelope.requeued(decoded, decoded["attempts"] + 1, 1700000000)
        return envelope.encode({"pid": decoded["pid"], "queue": decoded["queue"],
                                "timestamp": 1700000000, "payload": decoded["payload"]})
    except envelope.Unencodable as error:
        return str(error)


@pytest.mark.parametrize("kind", ["requeue", "publish"])
@pytest.mark.parametrize("row", ENCODE_ROWS, ids=[r["in"][48:110] for r in ENCODE_ROWS])
def test_encode_agrees_with_php(row, kind):
    php = row["php"]
    if "decode" in php:  # nested deeper than json_decode allows
        with pytest.raises(MalformedEnvelope):
            envelope.decode(row["in"].encode())
        return
    ours = written(envelope.decode(row["in"].encode()), kind)
    if isinstance(php[kind], dict):  # json_encode threw (INF): so do we
        assert ours == "Inf and NaN cannot be JSON encoded", php[kind]
    else:
        assert ours == php[kind].encode()


def test_the_table_covers_what_the_issue_names():
    inputs = " ".join(row["in"] for row in ENCODE_ROWS)
    for needle in ("1e22", "1e-7", "-0.0", "1e308", "18446744073709551616", "\\ud83d\\ude00",
                   "\\u2028", "a/b", '{"0":"a"', '"a":{}', '"key":"k"', "[" * 512):
        assert needle in inputs, needle
    assert PHP_ENCODE["produced_by"].startswith("PHP 8.2")


json_leaves = (
    st.none() | st.booleans() | st.integers(INT64_MIN, INT64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 1e16, 1e17, 1e-4, 1e-5, 1e22, 5e-324, 1.5, 100.0])
    | st.text() | st.sampled_from(["a/b", "\x7f", "\u2028", "😀", "é", '"\\', "{}", '{"0":',
                                   "a:1.5", "x,e", "[1e5", "null", "{ }", '{"":'])
)
php_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=3) | st.sampled_from(["0", "1", "2"]), children,
                      max_size=4)
    | st.lists(children, max_size=3).map(lambda items: {str(i): v for i, v in enumerate(items)}),
    max_leaves=25,
)


@pytest.mark.slow
@settings(max_examples=1000)
@given(value=php_values)
def test_the_orjson_path_agrees_with_the_reference_writer(value):
    assert envelope.php_json(value) == phpjson._encode_like_php(value)


@given(value=php_values)
def test_what_we_write_reads_back_as_php_would_hold_it(value):
    raw = envelope.php_json({"pid": "p", "queue": "q", "timestamp": 1, "payload": [value]})
    assert raw.isascii() and b"/" not in raw.replace(b"\\/", b"")
    assert envelope.decode(raw)["payload"] == [php_holds(value)]


def php_holds(value: Any) -> Any:
    """The value as PHP's array would read back: an empty object is [], a "0".."n-1" keyed
    object a list, -0.0 is written "-0" and comes back the integer 0."""
    if isinstance(value, dict):
        if not value:
            return []
        if list(value) == [str(i) for i in range(len(value))]:
            return [php_holds(v) for v in value.values()]
        return {k: php_holds(v) for k, v in value.items()}
    if isinstance(value, list):
        return [php_holds(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e17:
        return int(Decimal(repr(value)))  # its shortest digits, as written
    return value


@pytest.mark.slow
@pytest.mark.parametrize("levels", range(250, 513))
def test_every_accepted_depth_is_written_back(levels):
    # The envelope is one level: a payload of up to 510 nested arrays decodes, and PHP's
    # json_encode writes up to 512. orjson alone stops at 255.
    for inner in (b"[1]", b'{"a":1}'):
        opened, closed = (b"[", b"]") if inner == b"[1]" else (b'{"a":', b"}")
        payload = opened * (levels - 1) + inner + closed * (levels - 1)
        raw = b'{"pid":"p","queue":"q","timestamp":1,"payload":%s}' % payload
        if levels > 510:
            with pytest.raises(MalformedEnvelope, match="nested levels"):
                envelope.decode(raw)
            continue
        again = envelope.requeued(envelope.decode(raw), 1, 2)
        assert again == b'{"pid":"p","queue":"q","timestamp":2,"payload":%s,"attempts":1}' % (
            payload)


def test_json_encode_depth_is_512_levels():
    value: Any = []
    for _ in range(511):
        value = [value]
    assert envelope.php_json(value) == b"[" * 512 + b"]" * 512
    with pytest.raises(envelope.Unencodable, match="more than 512 nested levels"):
        envelope.php_json([value])
    with pytest.raises(envelope.Unencodable, match="more than 512 nested levels"):
        envelope.build("q", {"deep": [value]})  # PHP's publish() would throw too


def test_requeued_writes_retry_payload_fields_in_php_order():
    decoded = envelope.decode(b'{"key":"k","attempts":4,"sequence":9,"payload":{"a":{}},'
                              b'"extra":1,"timestamp":1,"queue":"q","pid":"p"}')
    assert envelope.requeued(decoded, 5, 7) == (
        b'{"pid":"p","queue":"q","timestamp":7,"payload":{"a":[]},"attempts":5,"key":"k"}')


def test_an_infinite_number_is_accepted_but_cannot_be_written_back():
    decoded = envelope.decode(b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1e400}}')
    assert decoded["payload"]["a"] == math.inf  # PHP reads it as INF, and runs the job
    with pytest.raises(envelope.Unencodable, match="Inf and NaN"):
        envelope.requeued(decoded, 1)


# --- NATS: queue 5's Broker\Nats::pull() has no (int) cast of the timestamp ------------------
# tests/data/php_nats_decode.json: raw message bodies and what PHP 8.2 made of them going
# through pull()'s steps (see php_nats_decode.php beside it). Two rows differ on purpose: a
# timestamp PHP saturates to fit 64 bits is poison here too (the project rule above).

PHP_NATS = json.loads((Path(__file__).parent / "data" / "php_nats_decode.json").read_text())
NATS_ROWS = PHP_NATS["rows"]
PHP_SATURATES = {'"timestamp":-9223372036854775809,', '"timestamp":"-9223372036854775809",'}


@pytest.mark.parametrize("row", NATS_ROWS, ids=[r["in"][:70] for r in NATS_ROWS])
def test_nats_decode_agrees_with_php(row):
    raw = row["in"].encode()
    if row["php"] is None or any(s in row["in"] for s in PHP_SATURATES):
        with pytest.raises(MalformedEnvelope):
            envelope.decode_nats(raw)
        return
    decoded = envelope.decode_nats(raw)
    pid, queue, timestamp, payload, attempts = row["php"]
    got = (decoded["pid"], decoded["queue"], decoded["timestamp"], decoded["payload"] or [],
           decoded["attempts"])
    assert same(got, (pid, queue, timestamp, payload, attempts)), (got, row["php"])


@pytest.mark.parametrize("timestamp", ['"abc"', '""', "[]", "{}", '"12abc"', '" "', '"0x1A"'])
def test_what_redis_casts_nats_refuses(timestamp):
    raw = with_fields(timestamp=timestamp)
    assert envelope.decode(raw)["timestamp"] in (0, 12)  # Redis: (int) first, as PHP does
    with pytest.raises(MalformedEnvelope, match="timestamp is"):
        envelope.decode_nats(raw)


def test_the_nats_table_covers_the_issue():
    inputs = [row["in"] for row in NATS_ROWS]
    for timestamp in ('"abc"', '""', "[]", "{}"):
        assert f'"timestamp":{timestamp},' in " ".join(inputs)
    assert PHP_NATS["produced_by"].startswith("PHP 8.2")


@pytest.mark.parametrize("row", NATS_ROWS, ids=[r["in"][:70] for r in NATS_ROWS])
def test_the_queue5_nats_model_decodes_as_php(row):
    from tests.queue5_nats import constructs_message

    try:
        data = json.loads(row["in"])
    except ValueError:
        data = None
    runs = (isinstance(data, dict) and all(data.get(k) is not None
                                           for k in ("pid", "queue", "timestamp"))
            and constructs_message(data))
    assert runs is (row["php"] is not None)


@pytest.mark.parametrize("row", ENCODE_ROWS, ids=[r["in"][48:110] for r in ENCODE_ROWS])
def test_the_queue5_model_reads_and_writes_as_php(row):
    from tests import queue5

    php = row["php"]
    try:
        decoded = queue5.php_json_decode(row["in"].encode())
    except ValueError:
        assert "decode" in php
        return
    retry = {"pid": decoded["pid"], "queue": decoded["queue"], "timestamp": 1700000000,
             "payload": decoded.get("payload") or [],
             "attempts": (decoded.get("attempts") or 0) + 1}
    if decoded.get("key") is not None:
        retry["key"] = decoded["key"]
    if isinstance(php["requeue"], dict):  # INF
        return
    assert queue5.php_json_encode(retry) == php["requeue"]


# --- plain envelopes: what a handler process reads with orjson alone ---------------------------
# The supervisor flags an envelope plain when decode took its fast path; its handler process
# then builds the Message from orjson.loads(raw) without decode's checks. Both must give the
# same Message, value and type, whatever the envelope.


def message_fields(message: Message) -> tuple[Any, ...]:
    return (message.pid, message.queue, message.timestamp, message.attempts, message.payload)


def flagged_or_refused(raw: bytes, *max_bytes: int | None
                       ) -> tuple[dict[str, Any], bool] | MalformedEnvelope:
    """What decode_flagged returns for ``raw``, or the MalformedEnvelope it raises: either
    is an answer, to compare with decode_many's (which returns the refusal)."""
    try:
        return envelope.decode_flagged(raw, *max_bytes)
    except MalformedEnvelope as error:
        return error


def flagged(raw: bytes) -> bool | None:
    """Whether decode_flagged calls raw plain (None: malformed), having checked that a plain
    envelope makes the same Message read either way, and that the flag changes nothing else."""
    answer = flagged_or_refused(raw)
    if isinstance(answer, MalformedEnvelope):
        [many] = envelope.decode_many([raw])  # as the Redis claim decodes a batch
        assert isinstance(many, MalformedEnvelope) and str(many) == str(answer)
        return None
    decoded, plain = answer
    assert same(decoded, envelope.decode(raw))
    assert same(envelope.decode_many([raw]), [(decoded, plain)])
    # As the NATS broker decodes at the claim: the same flag, when it accepts raw too.
    with contextlib.suppress(MalformedEnvelope):
        assert envelope.decode_flagged(raw, cast_timestamp=False)[1] is plain
    if plain:
        for attempts in (None, 0, -(2**63), 7):  # unknown: the envelope's own counts
            fast = Message.from_raw(raw, 1, attempts, plain=True)
            assert same(message_fields(fast), message_fields(Message.from_raw(raw, 1, attempts)))
    return plain


def mostly(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a value of the type PHP's Message wants, else any JSON value."""
    return st.integers(0, 4).flatmap(lambda n: right if n else any_json)


# Envelopes that are often plain and often one step from it: each field of the right type
# or of any other, optional fields present or not.
near_plain = st.fixed_dictionaries(
    {"pid": mostly(st.text(max_size=8)), "queue": mostly(st.text(max_size=8)),
     "timestamp": mostly(st.integers(INT64_MIN, INT64_MAX)),
     "payload": mostly(st.dictionaries(st.text(max_size=3), any_json, max_size=4))},
    optional={"attempts": mostly(st.none() | st.integers(INT64_MIN, INT64_MAX)),
              "sequence": any_json, "key": any_json, "x": any_json},
)


@pytest.mark.slow
@settings(max_examples=1000)
@given(document=near_plain | envelopes, ensure_ascii=st.booleans(),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(b'{}[]",:\\ 0e.-\xff9')),
                      max_size=2))
def test_a_plain_envelope_makes_the_same_message_read_with_orjson_alone(
    document, ensure_ascii, edits
):
    raw = json.dumps(document, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    flagged(raw)
    flagged(mutate(raw, edits))


@pytest.mark.slow
@settings(max_examples=300)
@given(payload=st.dictionaries(st.text(), json_values, max_size=6))
def test_what_producers_write_is_plain_when_short(payload):
    _, raw = envelope.build("q", payload)
    # Plain unless long, with a run of 19 digits, or with a payload PHP writes as an array.
    assert flagged(raw) is (len(raw) <= 2 * envelope.MAX_NESTING
                            and not re.search(rb"[0-9]{19}", raw)
                            and type(orjson.loads(raw)["payload"]) is dict)


@pytest.mark.parametrize(("raw", "expected"), TRUTH_TABLE, ids=[row_id(r) for r, _ in TRUTH_TABLE])
def test_every_truth_table_row_reads_the_same_when_plain(raw, expected):
    assert (flagged(raw) is None) is (expected is None)


@pytest.mark.parametrize("raw", [
    PHP, with_fields(payload='{"a":1}'), with_fields(payload='{"a":1}', attempts="null"),
    with_fields(payload='{"a":[1.5,null,"\\u00e9"]}', attempts="-3", key='"k"', extra="[]"),
    with_fields(timestamp=str(10**18 - 1), payload='{"a":1}', attempts=str(1 - 10**18)),
    with_fields(payload='{"n":123456789012345678}'),  # 18 digits: orjson reads it as PHP does
])
def test_these_are_plain(raw):
    assert flagged(raw) is True


@pytest.mark.parametrize("raw", [
    with_fields(payload='{"n":1234567890123456789}'),  # 19 digits: decode's reference path
    with_fields(timestamp=str(INT64_MAX), payload='{"a":1}'),  # in range, 19 digits all the same
    with_fields(payload='{"f":0.12345678901234567890}'),
    with_fields(payload='{"s":"%s"}' % ("x" * 1100)),  # longer than the fast path reads
    with_fields(pid="12", payload='{"a":1}'),  # "12" for PHP, 12 for orjson
    with_fields(queue="1.5", payload='{"a":1}'),
    with_fields(timestamp='"5"', payload='{"a":1}'),
    with_fields(timestamp="1.5", payload='{"a":1}'),
    with_fields(timestamp="true", payload='{"a":1}'),
    with_fields(payload="[]"), with_fields(payload="[1]"), with_fields(payload="null"),
    with_fields(),  # no payload
    with_fields(payload='{"a":1}', attempts='"2"'),
    with_fields(payload='{"a":1}', attempts="2.0"),
    with_fields(payload='{"a":1}', attempts="false"),
    with_fields(payload='{"a":1}', sequence="3"),
    with_fields(payload='{"a":1}', sequence="null"),
])
def test_envelopes_decode_changes_or_reads_slowly_are_not_plain(raw):
    assert flagged(raw) is False


@pytest.mark.slow
@pytest.mark.parametrize("max_bytes", [None, 0, 1, 60, 120, 1021, 1022, 1023, 5000])
def test_decode_many_is_decode_flagged_of_each_in_order(max_bytes):
    # The truth table and the edges of decode_flagged's fast path, in one batch: empty,
    # malformed, wide, long (in and past the fast path's 1022 bytes), under and over a limit.
    raws = [raw for raw, _ in TRUTH_TABLE] + [
        b"", b"{", PHP, with_fields(payload='{"n":1234567890123456789}'),
        with_fields(payload='{"s":"%s"}' % ("x" * (1022 - 56))),
        with_fields(payload='{"s":"%s"}' % ("x" * 1100)),
    ]
    assert len({len(raw) for raw in raws[-2:]}) == 2 and len(raws[-2]) == 1022
    many = envelope.decode_many(raws, max_bytes)
    assert len(many) == len(raws)
    for raw, result in zip(raws, many, strict=True):
        expected = flagged_or_refused(raw, max_bytes)
        if isinstance(expected, MalformedEnvelope):
            assert isinstance(result, MalformedEnvelope) and str(result) == str(expected), raw
        else:
            assert same(result, expected), raw
