"""The shared-memory ring: record framing, wrap-around, back-pressure and wake-ups."""

from __future__ import annotations

import mmap
import os
import struct
import time
import traceback
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.ring import Ring

HEADER = Ring.RECORD_HEADER


def make_ring(slots: int = 16, slot_size: int = 64) -> Ring:
    memory = mmap.mmap(-1, Ring.nbytes(slots, slot_size))
    return Ring(memoryview(memory), slots, slot_size, os.eventfd(0, os.EFD_NONBLOCK))


def wakeups(ring: Ring) -> int:
    """How many wake-ups the writer sent since the last call (reads the eventfd)."""
    try:
        return os.eventfd_read(ring.wake_fd)
    except BlockingIOError:
        return 0


@pytest.mark.parametrize("size", [0, 1, 64 - HEADER, 64, 640, 16 * 64 - HEADER])
def test_round_trip_of_one_record(size: int) -> None:
    ring = make_ring(16, 64)
    record = os.urandom(size)
    assert ring.put(record)
    assert ring.get() == record
    assert ring.get() is None


def test_waiting_says_whether_records_wait_without_reading_or_waking() -> None:
    ring = make_ring()
    assert not ring.waiting
    ring.put(b"one")
    assert wakeups(ring) == 0  # the reader never said it sleeps
    assert ring.prepare_sleep() is False  # a record waits: awake again
    assert ring.waiting and ring.waiting  # asking reads nothing
    assert ring.get_many(10) == [b"one"]
    assert not ring.waiting


def test_record_larger_than_the_ring_is_refused() -> None:
    ring = make_ring(4, 64)
    with pytest.raises(ValueError, match="exceeds the ring"):
        ring.put(b"x" * (4 * 64 - HEADER + 1))
    with pytest.raises(ValueError, match="exceeds the ring"):
        ring.put_many([b"ok", b"x" * 10_000])


def test_full_ring_refuses_then_accepts_after_a_get() -> None:
    ring = make_ring(4, 64)
    records = [bytes([n]) * 60 for n in range(4)]  # one slot each
    assert ring.put_many(records) == 4
    assert not ring.put(b"more")
    assert ring.get() == records[0]
    assert ring.put(b"more")
    assert ring.get_many(10) == [*records[1:], b"more"]


def test_put_many_stops_at_the_first_record_that_does_not_fit() -> None:
    ring = make_ring(8, 64)
    records = [b"a" * 100, b"b" * 100, b"c" * 100, b"d" * 100, b"e"]  # 2 slots each
    assert ring.put_many(records) == 4
    assert ring.get_many(2) == records[:2]
    assert ring.put_many(records[4:]) == 1
    assert ring.get_many(10) == [*records[2:4], b"e"]


def test_multi_slot_records_wrap_around_to_slot_zero() -> None:
    ring = make_ring(8, 64)
    for round_number in range(50):
        first = bytes([round_number]) * 150  # 3 slots: positions move around the ring
        second = bytes([round_number + 1]) * 300  # 5 slots: often needs padding
        assert ring.put(first)
        assert ring.get() == first
        assert ring.put(second)
        assert ring.get() == second


def test_a_record_that_needs_the_whole_ring_fits_after_padding() -> None:
    ring = make_ring(8, 64)
    whole = b"w" * (8 * 64 - HEADER)
    assert ring.put(b"x")
    assert ring.get() == b"x"
    # Not room at slot 1; the padding is published so the reader can free slot 0.
    assert not ring.put(whole)
    assert ring.get() is None
    assert ring.put(whole)
    assert ring.get() == whole


def test_stop_request_and_reset() -> None:
    ring = make_ring()
    assert not ring.stop_requested
    ring.request_stop()
    assert ring.stop_requested
    ring.put(b"left over")
    ring.reset()
    assert not ring.stop_requested
    assert ring.get() is None


def test_writer_wakes_the_reader_only_when_it_sleeps() -> None:
    ring = make_ring()
    for _ in range(10):
        assert ring.put(b"job")
    assert ring.put_many([b"a", b"b"]) == 2
    assert wakeups(ring) == 0  # the reader never said it sleeps
    ring.get_many(100)

    assert ring.prepare_sleep()
    assert ring.put_many([b"a", b"b", b"c"]) == 3
    assert wakeups(ring) == 1  # one wake-up for the whole batch
    ring.clear_wakeup()
    ring.get_many(100)

    ring.put(b"awake again")
    assert wakeups(ring) == 0


def test_a_sleeping_reader_is_woken_once_however_many_puts_come_before_it_wakes() -> None:
    ring = make_ring()
    assert ring.prepare_sleep()
    for _ in range(5):  # separate puts (one per job) while the reader has not come round
        assert ring.put(b"outcome")
    assert wakeups(ring) == 1
    ring.clear_wakeup()
    assert len(ring.get_many(100)) == 5
    assert ring.prepare_sleep()  # its next sleep is a new one: woken again
    ring.put(b"next")
    ring.put(b"and next")
    assert wakeups(ring) == 1
    ring.clear_wakeup()
    ring.get_many(100)
    assert ring.wait(0.01) is False  # a sleep that timed out: the next wait is another
    ring.put(b"after a timeout")
    assert ring.wait(5) is True
    assert ring.get() == b"after a timeout"


def test_reset_forgets_the_sleep_woken_last_for_a_new_reader() -> None:
    memory = mmap.mmap(-1, Ring.nbytes(16, 64))
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    writer, reader = Ring(memoryview(memory), 16, 64, fd), Ring(memoryview(memory), 16, 64, fd)
    assert reader.prepare_sleep()
    writer.put(b"to the first reader")
    assert wakeups(writer) == 1
    # The reader process dies; its replacement starts from the same copy of the ring
    # object (forked from the fork server), so it numbers its first sleep as the dead one
    # did. The supervisor resets the ring before it starts.
    writer.reset()
    replacement = Ring(memoryview(memory), 16, 64, fd)
    assert replacement.prepare_sleep()
    writer.put(b"to the replacement")
    assert wakeups(writer) == 1


def test_prepare_sleep_refuses_when_data_waits() -> None:
    ring = make_ring()
    ring.put(b"waiting")
    assert not ring.prepare_sleep()
    ring.put(b"more")
    assert wakeups(ring) == 0  # refusing left the reader awake
    assert ring.wait(0) is True


def test_wait_times_out_on_an_empty_ring() -> None:
    ring = make_ring()
    assert ring.wait(0.01) is False
    ring.put(b"after")
    assert wakeups(ring) == 0


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=8 * 32 - HEADER).map(lambda n: ("put", n)),
            st.integers(min_value=1, max_value=5).map(lambda n: ("get", n)),
        ),
        max_size=120,
    )
)
def test_ring_behaves_like_a_bounded_queue(steps: list[tuple[str, int]]) -> None:
    ring = make_ring(8, 32)
    model: deque[bytes] = deque()
    counter = 0
    for action, number in steps:
        if action == "put":
            counter += 1
            record = counter.to_bytes(4, "little")[: number] + b"z" * max(0, number - 4)
            if ring.put(record):
                model.append(record)
            elif not model:
                # Refused on an empty ring: only the wrap padding was placed; now it fits.
                assert ring.get() is None
                assert ring.put(record)
                model.append(record)
        else:
            expected = [model.popleft() for _ in range(min(number, len(model)))]
            assert ring.get_many(number) == expected
    assert ring.get_many(1000) == list(model)


# -- two processes -----------------------------------------------------------------

COUNT = 100_000
LOST_WAKEUP = 20.0  # seconds: a wait this long means a wake-up was missed


def record_for(index: int) -> bytes:
    """Deterministic records of 4 to ~700 bytes, so many span slots and wrap."""
    return struct.pack("<I", index) + bytes([index & 0xFF]) * (index * 7919 % 700)


def echo_child(requests: Ring, replies: Ring) -> int:
    """Read COUNT records, check them, and send each back; returns an exit code."""
    expected = 0
    outgoing: list[bytes] = []
    while expected < COUNT:
        records = requests.get_many(64)
        if not records:
            if not requests.wait(LOST_WAKEUP) and os.getppid() == 1:
                return 3
            continue
        for record in records:
            if record != record_for(expected):
                return 2
            expected += 1
        outgoing.extend(records)
        while outgoing:
            sent = replies.put_many(outgoing)
            del outgoing[:sent]
            if outgoing:
                time.sleep(0.0001)  # full: the parent drains it
    return 0


@pytest.mark.slow
def test_two_processes_pass_records_both_ways_with_wakeups() -> None:
    requests, replies = make_ring(64, 64), make_ring(64, 64)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = echo_child(requests, replies)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        sent = received = 0
        while received < COUNT:
            placed = requests.put_many(record_for(n) for n in range(sent, min(sent + 32, COUNT)))
            sent += placed
            replies_now = replies.get_many(256)
            for record in replies_now:
                assert record == record_for(received)
                received += 1
            if not placed and not replies_now:
                # Sleeps only if the child has not answered meanwhile; the child always
                # has work here, so sleeping through the whole timeout is a lost wake-up.
                began = time.monotonic()
                if not replies.wait(LOST_WAKEUP):
                    assert time.monotonic() - began < LOST_WAKEUP, "lost wake-up"
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
