"""The envelope codec: byte-compatible with PHP's json_encode, strict about what it accepts."""

from __future__ import annotations

import re

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker import envelope
from broker.envelope import MalformedEnvelope

# Written by utopia-php/queue 1.x (PHP json_encode): "\/" escapes, [] for an empty payload.
PHP = (
    b'{"pid":"65f1c2a3b4c5d6.12345678","queue":"v1-stats-usage","timestamp":1710000000,'
    b'"payload":{"url":"https:\\/\\/example.com\\/a\\/b","n":1}}'
)


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


def test_unknown_fields_are_kept():
    raw = b'{"pid":"p","queue":"q","timestamp":1,"payload":{},"priority":true,"x":[1]}'
    decoded = envelope.decode(raw)
    assert decoded["priority"] is True and decoded["x"] == [1]


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


def test_with_attempts_reencodes():
    raw = envelope.with_attempts(envelope.decode(PHP), 3)
    decoded = envelope.decode(raw)
    assert decoded["attempts"] == 3 and decoded["payload"]["url"] == "https://example.com/a/b"
    assert b"\\/" in raw


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "empty message"),
        (b"{not json", "invalid JSON"),
        (b"\x00\xff\xfe\x80", "invalid JSON"),
        (b"[1,2]", "JSON array, not an object"),
        (b'"text"', "JSON string, not an object"),
        (b"null", "JSON null, not an object"),
        (b'{"queue":"q","timestamp":1,"payload":{}}', "pid is missing"),
        (b'{"pid":"","queue":"q","timestamp":1,"payload":{}}', "pid is empty"),
        (b'{"pid":1,"queue":"q","timestamp":1,"payload":{}}', "pid is a JSON number"),
        (b'{"pid":"p","timestamp":1,"payload":{}}', "queue is missing"),
        (b'{"pid":"p","queue":null,"timestamp":1,"payload":{}}', "queue is a JSON null"),
        (b'{"pid":"p","queue":"q","payload":{}}', "timestamp is missing"),
        (b'{"pid":"p","queue":"q","timestamp":"1","payload":{}}', "timestamp is a JSON string"),
        (b'{"pid":"p","queue":"q","timestamp":1.5,"payload":{}}', "timestamp is a JSON number"),
        (b'{"pid":"p","queue":"q","timestamp":true,"payload":{}}', "timestamp is a JSON boolean"),
        (b'{"pid":"p","queue":"q","timestamp":1}', "payload is a JSON null"),
        (b'{"pid":"p","queue":"q","timestamp":1,"payload":[1]}', "payload is a JSON array"),
        (b'{"pid":"p","queue":"q","timestamp":1,"payload":"x"}', "payload is a JSON string"),
        (b'{"pid":"p","queue":"q","timestamp":1,"payload":{},"attempts":-1}', "attempts"),
        (b'{"pid":"p","queue":"q","timestamp":1,"payload":{},"attempts":"2"}', "attempts"),
    ],
)
def test_malformed_envelopes_have_a_reason(raw, reason):
    with pytest.raises(MalformedEnvelope, match=re.escape(reason)):
        envelope.decode(raw)


def test_size_limit():
    raw = envelope.build("q", {"blob": "x" * 2000})[1]
    assert envelope.decode(raw, max_bytes=len(raw))
    with pytest.raises(MalformedEnvelope, match="exceeds"):
        envelope.decode(raw, max_bytes=len(raw) - 1)
    big = envelope.build("q", {"blob": "x" * (1024 * 1024)})[1]
    with pytest.raises(MalformedEnvelope, match="exceeds"):
        envelope.decode(big)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


@given(payload=st.dictionaries(st.text(), json_values, max_size=6), attempts=st.integers(0, 99))
def test_round_trip(payload, attempts):
    pid, raw = envelope.build("queue/with/slashes", payload)
    assert b"/" not in raw.replace(b"\\/", b"")
    decoded = envelope.decode(envelope.with_attempts(envelope.decode(raw), attempts))
    assert decoded["pid"] == pid and decoded["queue"] == "queue/with/slashes"
    assert decoded["payload"] == payload and decoded["attempts"] == attempts
