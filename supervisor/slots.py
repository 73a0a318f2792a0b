"""One object per handler process: its rings, its pid, and the deliveries it holds.

The rings live in one anonymous shared mapping created before the fork server, so every
child (including replacements) finds its slot's rings at the same place.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from dataclasses import dataclass, field

from supervisor.buffer import Entry
from worker.ring import Ring


@dataclass(slots=True, eq=False)
class Slot:
    index: int
    to_child: Ring
    to_parent: Ring
    pid: int | None = None
    ready: bool = False
    retiring: bool = False  # recycling: take no more work, exit once empty
    exit_sent: bool = False
    jobs: int = 0  # deliveries finished by the current process
    kill_reason: str | None = None  # why we killed it (e.g. handler timeout), for the reject
    early_deaths: int = 0  # processes of this slot in a row that died before they were ready
    queued: deque[Entry] = field(default_factory=deque)  # in the ring, in order
    running: dict[int, Entry] = field(default_factory=dict)  # started, outcome not yet seen
    returned: set[int] = field(default_factory=set)  # running ids reported HELD (async only)
    overdue: set[int] = field(default_factory=set)  # running ids past the timeout we killed for

    @property
    def load(self) -> int:
        return len(self.queued) + len(self.running)

    @property
    def alive(self) -> bool:
        return self.pid is not None

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def clear(self) -> None:
        """The process is gone: forget its state and make its rings empty for a replacement."""
        self.pid, self.kill_reason, self.jobs = None, None, 0
        self.ready = self.retiring = self.exit_sent = False
        self.queued.clear()
        self.running.clear()
        self.returned.clear()
        self.overdue.clear()
        self.to_child.reset()
        self.to_parent.reset()


class RingMemoryError(Exception):
    """The shared memory of the rings could not be allocated; the message says how much."""


def make_slots(count: int, ring_slots: int, slot_size: int) -> list[Slot]:
    """Shared memory and wake-up descriptors for ``count`` handler processes (before forking).

    Raises RingMemoryError when the machine refuses the memory (ENOMEM, an address-space
    limit)."""
    ring_bytes = Ring.nbytes(ring_slots, slot_size)
    size = 2 * count * ring_bytes
    try:
        memory = mmap.mmap(-1, size)  # anonymous and shared: nobody else can open it
    except (OSError, MemoryError, OverflowError) as error:
        reason = getattr(error, "strerror", None) or repr(error)
        raise RingMemoryError(
            f"the handler rings need {size:,} bytes of shared memory (2 rings x {count} "
            f"handler processes x {ring_bytes:,} bytes), which could not be allocated ({reason})"
        ) from error
    view = memoryview(memory)
    slots = []
    for index in range(count):
        base = 2 * index * ring_bytes
        rings = [
            Ring(view[at : at + ring_bytes], ring_slots, slot_size, os.eventfd(0, os.EFD_NONBLOCK))
            for at in (base, base + ring_bytes)
        ]
        slots.append(Slot(index, rings[0], rings[1]))
    return slots
