"""A single-producer single-consumer ring of variable-length records in shared memory.

The ring lives in a slice of an anonymous shared mapping (``mmap.mmap(-1, size)``) made
before forking, so the parent and a handler process see the same bytes. One side only
writes, the other only reads; nothing here takes a lock between processes.

Layout (all words native u64, each on its own 64-byte cache line)::

    [0]   write index   monotonic count of slots published by the writer
    [8]   mark          a value the writer publishes beside the records (the handler
                        process: the number of the delivery it reached; the supervisor:
                        the cut below which none may start; see ``mark``)
    [64]  read index    monotonic count of slots released by the reader
    [128] sleeping      non-zero while the reader is (about to be) blocked on the wake-up
                        fd: the number of that sleep, new each time (see below)
    [192] stop          non-zero once the parent asked the child to start nothing more
    [256] data          ``slots`` slots of ``slot_size`` bytes

A record is a u32 length followed by its bytes and occupies as many consecutive slots as
it needs. A record that would run past the end of the data area is preceded by a padding
marker that sends the reader back to slot 0, so every record is contiguous.

Wake-ups go through an eventfd that the writer writes only when the reader said it
sleeps: the Dekker pattern (see ``fence``), and once per sleep: the reader numbers its
sleeps, and a writer that woke sleep n (its eventfd is written, the reader will drain it
and read everything) does not write again for n. A reader that is slow to come round (the
supervisor's event loop in a Redis call) otherwise took one write per record, each a
system call of the handler process. A reader's sleep numbers only grow, and ``reset``
(before a new process takes the other side) forgets the one woken last.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import threading
from collections.abc import Iterable

_HEADER_BYTES = 256
_WRITE, _READ, _SLEEPING, _STOP = 0, 8, 16, 24  # u64 word indexes, 64 bytes apart
_MARK = 1  # on the writer's own line: the writer stores it, the reader only loads it
_LENGTH = struct.Struct("=I")
_PADDING = 0xFFFFFFFF  # a length no record has: "skip to slot 0"

_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """A full memory barrier (store -> load ordering), as far as Python can get one.

    The wake-up protocol is Dekker's: the reader stores ``sleeping = 1`` then loads the
    write index; the writer stores the write index then loads ``sleeping``. x86 may
    reorder a store with a later load, and then both sides miss each other: the reader
    sleeps on data that the writer never announces. Python has no fence instruction, but
    acquiring and releasing an uncontended ``threading.Lock`` runs atomic
    read-modify-write instructions (``sem_trywait``/``sem_post`` in CPython's pthread
    locks, a compare-and-swap in newer releases); on x86 those are ``lock``-prefixed and
    so full barriers.
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


class Ring:
    """One direction of traffic between two processes; see the module docstring."""

    RECORD_HEADER = _LENGTH.size

    __slots__ = ("_data", "_poller", "_sleeps", "_slot_size", "_slots", "_woken", "_words",
                 "wake_fd")

    @staticmethod
    def nbytes(slots: int, slot_size: int) -> int:
        """Bytes of shared memory one ring needs (a multiple of 64, so rings can sit
        back to back in one mapping and stay aligned)."""
        _check_geometry(slots, slot_size)
        return _HEADER_BYTES + -(-slots * slot_size // 64) * 64

    def __init__(self, buffer: memoryview, slots: int, slot_size: int, wake_fd: int) -> None:
        needed = Ring.nbytes(slots, slot_size)
        buffer = memoryview(buffer).cast("B")
        if len(buffer) < needed:
            raise ValueError(f"ring needs {needed} bytes, buffer has {len(buffer)}")
        # Native u64 words are read and written with single aligned 8-byte accesses,
        # so the other process never sees a torn index.
        self._words = buffer[:_HEADER_BYTES].cast("Q")
        self._data = buffer[_HEADER_BYTES : _HEADER_BYTES + slots * slot_size]
        self._slots = slots
        self._slot_size = slot_size
        self._poller: select.poll | None = None
        self._sleeps = 0  # reader: its sleeps so far (the next one is numbered one more)
        self._woken = 0  # writer: the number of the reader's sleep it woke last
        self.wake_fd = wake_fd

    @property
    def capacity(self) -> int:
        """Bytes of its data area (a record, with its length, takes whole slots of it)."""
        return self._slots * self._slot_size

    # -- writer side ---------------------------------------------------------------

    def put(self, record: bytes) -> bool:
        """Publish one record; False (nothing visible) when there is no room yet.

        The common case (it fits before the end of the data area) is written here at once:
        a handler process publishes each outcome so, one per job."""
        words = self._words
        write = words[_WRITE]
        size = len(record)
        slots, slot_size = self._slots, self._slot_size
        needed = -(-(size + _LENGTH.size) // slot_size)
        position = write % slots
        if position + needed > slots or needed > slots - (write - words[_READ]):
            return self.put_many((record,)) == 1  # it wraps, or there is no room yet
        offset = position * slot_size
        _LENGTH.pack_into(self._data, offset, size)
        self._data[offset + _LENGTH.size : offset + _LENGTH.size + size] = record
        self._publish(write + needed)
        return True

    def put_many(self, records: Iterable[bytes]) -> int:
        """Publish records in order until one does not fit; returns how many fitted.

        They become visible together, with one fence and at most one wake-up.
        """
        words = self._words
        start = write = words[_WRITE]
        read = words[_READ]
        data, slots, slot_size = self._data, self._slots, self._slot_size
        header, pack_length = _LENGTH.size, _LENGTH.pack_into
        placed = 0
        for record in records:
            # _place's common case inline (the supervisor writes a batch of DELIVER records
            # so, one per job; a call per record cost as much again): it fits, unwrapped.
            size = len(record)
            needed = -(-(size + header) // slot_size)
            position = write % slots
            if position + needed <= slots and needed <= slots - (write - read):
                offset = position * slot_size
                pack_length(data, offset, size)
                data[offset + header : offset + header + size] = record
                write += needed
            else:
                write, fitted = self._place(record, write, read)
                if not fitted:
                    break
            placed += 1
        if write != start:
            self._publish(write)
        return placed

    def _publish(self, write: int) -> None:
        """Make everything up to ``write`` visible, and wake the reader if it sleeps."""
        words = self._words
        words[_WRITE] = write
        fence()
        sleeping = words[_SLEEPING]
        if sleeping and sleeping != self._woken:  # asleep, and not woken yet
            os.eventfd_write(self.wake_fd, 1)
            self._woken = sleeping

    def _place(self, record: bytes, write: int, read: int) -> tuple[int, bool]:
        """Copy ``record`` in at ``write`` without publishing it: (new write index, fitted).

        When the record must wrap but does not fit yet, the padding alone is placed: it
        lets the reader move to slot 0, which is the only way room can appear there.
        """
        size = len(record)
        needed = -(-(size + _LENGTH.size) // self._slot_size)
        if needed > self._slots:
            raise ValueError(
                f"record of {size} bytes exceeds the ring ({self._slots} x {self._slot_size})"
            )
        position = write % self._slots
        free = self._slots - (write - read)
        if position + needed > self._slots:
            padding = self._slots - position
            if padding > free:
                return write, False
            _LENGTH.pack_into(self._data, position * self._slot_size, _PADDING)
            write += padding
            free -= padding
            position = 0
        if needed > free:
            return write, False
        offset = position * self._slot_size
        _LENGTH.pack_into(self._data, offset, size)
        self._data[offset + _LENGTH.size : offset + _LENGTH.size + size] = record
        return write + needed, True

    def mark(self, value: int) -> None:
        """Publish ``value`` beside the records: one store, no record, no wake-up. The
        reader sees it at once, and after the writer died (the memory outlives it)."""
        self._words[_MARK] = value

    # -- reader side ---------------------------------------------------------------

    @property
    def marked(self) -> int:
        """The writer's last ``mark`` (0 until it marked something, and after ``reset``)."""
        return self._words[_MARK]

    def get(self) -> bytes | None:
        """The next record, or None when none is waiting (never blocks)."""
        records = self.get_many(1)
        return records[0] if records else None

    def get_many(self, limit: int) -> list[bytes]:
        """Up to ``limit`` waiting records, oldest first; the room is released once."""
        words = self._words
        start = read = words[_READ]
        write = words[_WRITE]
        data, slots, slot_size = self._data, self._slots, self._slot_size
        records: list[bytes] = []
        while read != write and len(records) < limit:
            position = read % slots
            offset = position * slot_size
            (size,) = _LENGTH.unpack_from(data, offset)
            if size == _PADDING:
                read += slots - position
                continue
            begin = offset + _LENGTH.size
            records.append(data[begin : begin + size].tobytes())
            read += -(-(size + _LENGTH.size) // slot_size)
        if read != start:
            # Copies are made above, before the room is handed back to the writer.
            words[_READ] = read
        return records

    def wait(self, timeout: float | None = None) -> bool:
        """Block until data is waiting or ``timeout`` seconds pass; True if data waits.

        For a process that may block (the handler process). May return early.
        """
        if not self.prepare_sleep():
            return True
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.wake_fd, select.POLLIN)
        try:
            self._poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        finally:
            self.clear_wakeup()
        return self._words[_WRITE] != self._words[_READ]

    def prepare_sleep(self) -> bool:
        """Declare the reader asleep; False (and awake again) if data is already waiting.

        For an asyncio reader: on True, wait for ``wake_fd`` to become readable, then call
        ``clear_wakeup`` and read; on False, read again now.
        """
        words = self._words
        self._sleeps += 1
        words[_SLEEPING] = self._sleeps
        fence()
        if words[_WRITE] != words[_READ]:
            words[_SLEEPING] = 0
            return False
        return True

    @property
    def waiting(self) -> bool:
        """Records are waiting to be read (never blocks, reads nothing)."""
        return self._words[_WRITE] != self._words[_READ]

    @property
    def asleep(self) -> bool:
        """The reader declared itself asleep (``prepare_sleep``): the writer's next record
        wakes it."""
        return self._words[_SLEEPING] != 0

    def clear_wakeup(self) -> None:
        """Consume a pending wake-up and declare the reader awake."""
        _drain(self.wake_fd)
        self._words[_SLEEPING] = 0

    # -- shared state --------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """The parent asked the reader of this ring to start nothing more (it comes without
        a wake-up: the reader looks at it between records)."""
        return self._words[_STOP] != 0

    def request_stop(self) -> None:
        """Set by the parent, on the ring it writes to the child; cleared by ``reset``."""
        self._words[_STOP] = 1

    def reset(self) -> None:
        """Empty the ring and clear its words (only while neither side is using it): a new
        process on the other side starts afresh, its sleeps numbered from where its copy
        of this object was, so the sleep woken last is forgotten too."""
        for word in (_WRITE, _MARK, _READ, _SLEEPING, _STOP):
            self._words[word] = 0
        self._woken = 0
        _drain(self.wake_fd)


def _drain(wake_fd: int) -> None:
    # Nothing to read after a timeout or a spurious wake-up.
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(wake_fd)


def _check_geometry(slots: int, slot_size: int) -> None:
    if slots < 1:
        raise ValueError(f"a ring needs at least one slot, not {slots}")
    if slot_size < 8 or slot_size % 8:
        raise ValueError(f"slot_size must be a multiple of 8 and at least 8, not {slot_size}")
