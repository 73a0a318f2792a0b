"""The DELIVER record on a real ring: every attempts value an envelope may carry (any signed
64-bit integer, as PHP's ``int``), and "unknown", arrive as they were sent."""

from __future__ import annotations

import mmap
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker import envelope
from supervisor.config import SupervisorConfig
from worker import protocol
from worker.ring import Ring

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def make_ring(slots: int = 16, slot_size: int = 64) -> Ring:
    memory = mmap.mmap(-1, Ring.nbytes(slots, slot_size))
    return Ring(memoryview(memory), slots, slot_size, os.eventfd(0, os.EFD_NONBLOCK))


def through_ring(record: bytes, ring: Ring | None = None) -> bytes | None:
    ring = ring or make_ring()
    assert ring.put(record)
    return ring.get()


@pytest.mark.parametrize(
    "attempts", [0, 1, 4294967295, 4294967296, INT64_MAX, -1, INT64_MIN, None],
)
def test_deliver_round_trips_every_attempts_value(attempts: int | None) -> None:
    _, raw = envelope.build("q", {"n": 1})
    record = through_ring(protocol.encode_deliver(42, raw, attempts))
    assert protocol.decode(record) == (protocol.DELIVER, 42, (attempts, raw))


def test_unknown_is_not_a_value_attempts_can_take() -> None:
    # No attempts value is reserved to mean "unknown": the flag byte says it.
    raw = b"{}"
    unknown = protocol.encode_deliver(1, raw, None)
    assert all(protocol.encode_deliver(1, raw, n) != unknown
               for n in (0, -1, INT64_MIN, INT64_MAX, 0xFFFFFFFF))


def test_a_batch_of_deliver_records_is_each_one_encoded_alone() -> None:
    _, raw = envelope.build("q", {"n": 1})
    batch = [(7, raw, 0, True), (8, raw, INT64_MAX, False), (9, b"{}", INT64_MIN, True)]
    assert protocol.encode_delivers(batch) == [protocol.encode_deliver(*d) for d in batch]
    with pytest.raises(ValueError, match="outside the signed 64-bit range"):
        protocol.encode_delivers([(7, raw, 0, True), (8, raw, INT64_MAX + 1, False)])


@pytest.mark.parametrize("attempts", [0, 5, INT64_MAX, INT64_MIN])
def test_plain_travels_in_the_flag_byte_and_changes_nothing_else(attempts: int) -> None:
    _, raw = envelope.build("q", {"n": 1})
    plain = through_ring(protocol.encode_deliver(3, raw, attempts, plain=True))
    other = through_ring(protocol.encode_deliver(3, raw, attempts))
    assert protocol.deliver_plain(plain) and not protocol.deliver_plain(other)
    # decode leaves the flag out: a reader that ignores it decodes the envelope fully.
    assert protocol.decode(plain) == protocol.decode(other) == (
        protocol.DELIVER, 3, (attempts, raw))
    # The handler process's loop reads the head in one call.
    assert protocol.unpack_deliver(plain) == (
        protocol.DELIVER, 3, protocol.KNOWN | protocol.PLAIN, attempts)
    assert plain[protocol.DELIVER_OVERHEAD:] == raw


def test_plain_goes_only_with_known_attempts() -> None:
    # An older handler process took any non-zero flag byte for "attempts known": plain
    # without them would read as attempts 0. Unknown attempts drop the flag (always safe).
    raw = envelope.build("q", {"n": 1})[1]
    record = protocol.encode_deliver(1, raw, None, plain=True)
    assert record == protocol.encode_deliver(1, raw, None)
    assert not protocol.deliver_plain(record)
    assert protocol.decode(record) == (protocol.DELIVER, 1, (None, raw))


def test_a_record_of_an_older_supervisor_is_not_plain() -> None:
    # Its flag byte was 0 or 1 (attempts known); the same bytes as today without plain.
    raw = b'{"pid":"p","queue":"q","timestamp":1,"payload":{"a":1}}'
    head = protocol.DELIVER.to_bytes(1, "little") + (9).to_bytes(8, "little")
    older = head + b"\x01" + (4).to_bytes(8, "little", signed=True) + raw
    assert older == protocol.encode_deliver(9, raw, 4)
    assert not protocol.deliver_plain(older)
    assert protocol.decode(older) == (protocol.DELIVER, 9, (4, raw))


@pytest.mark.parametrize("attempts", [INT64_MAX + 1, INT64_MIN - 1, 2**64])
def test_attempts_outside_signed_64_bit_are_refused_by_name(attempts: int) -> None:
    with pytest.raises(ValueError, match="outside the signed 64-bit range"):
        protocol.encode_deliver(1, b"{}", attempts)


@given(attempts=st.integers(INT64_MIN, INT64_MAX))
def test_every_attempts_that_decode_accepts_can_be_delivered(attempts: int) -> None:
    raw = b'{"pid":"p","queue":"q","timestamp":1,"attempts":%d}' % attempts
    decoded = envelope.decode(raw)
    record = through_ring(protocol.encode_deliver(7, raw, decoded["attempts"]))
    kind, delivery_id, (sent, body) = protocol.decode(record)
    assert (kind, delivery_id, sent, body) == (protocol.DELIVER, 7, attempts, raw)
    assert envelope.decode(body)["attempts"] == attempts


@pytest.mark.parametrize("position", range(16))
def test_the_largest_envelope_fits_an_empty_ring_wherever_it_stands(position: int) -> None:
    # With max_envelope_bytes = 0 (no limit of its own, as in PHP), the ring sets the limit:
    # a DELIVER of the largest envelope the broker hands on fits an empty ring at once.
    config = SupervisorConfig(ring_slots=16, ring_slot_size=64, max_envelope_bytes=0)
    ring = make_ring(16, 64)
    for _ in range(position):  # move the indexes: an empty ring at slot `position`
        assert ring.put(b"x" * 10) and ring.get() == b"x" * 10
    raw = b"x" * config.envelope_limit()
    record = protocol.encode_deliver(1, raw, 3)
    assert ring.put(record)
    assert protocol.decode(ring.get()) == (protocol.DELIVER, 1, (3, raw))
    with pytest.raises(envelope.MalformedEnvelope, match="exceeds"):
        envelope.decode(b"x" * (config.envelope_limit() + 1), config.envelope_limit())


def test_done_carries_the_handlers_seconds_beside_what_decode_returns() -> None:
    done = protocol.encode_done(5, 1.25)
    assert protocol.decode(done) == (protocol.DONE, 5, None)
    assert protocol.done_fields(done) == (5, 1.25)
    older = done[:9]  # a DONE from an older handler process: no seconds
    assert protocol.decode(older) == (protocol.DONE, 5, None)
    assert protocol.done_fields(older) == (5, 0.0)
    # Several at once, as the supervisor reads a run of them; an older one among them too.
    assert protocol.done_many([done, protocol.encode_done(6, 0.5)]) == ((5, 6), (1.25, 0.5))
    assert protocol.done_many([done, older]) == ((5, 5), (1.25, 0.0))


def test_the_mark_is_the_writers_last_value_until_reset() -> None:
    ring = make_ring()
    assert ring.marked == 0
    ring.mark(41)
    ring.put(b"x")
    ring.mark(42)
    assert ring.marked == 42 and ring.get() == b"x"  # beside the records, not one of them
    ring.reset()
    assert ring.marked == 0
