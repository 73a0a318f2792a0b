"""The handler places: one per handler process the job runs, each with its two rings and
the process now running in it (replacements take the same place).

The rings live in one anonymous shared mapping created before the fork server, so every
child (including replacements) finds its place's rings at the same address.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from worker import protocol
from worker.ring import Ring


@dataclass(slots=True, eq=False)
class HandlerPlace:
    """Handler process number ``index``: its rings, and the process now in it (if any).

    The deliveries it holds are the buffer's (queued and running, by ``index``); the place
    owns only its process: signalling it, asking it to exit, retiring it, counting its jobs
    and the replacements that died before they were ready.
    """

    index: int
    to_child: Ring
    to_parent: Ring
    pid: int | None = None
    retiring: bool = False  # recycling: take no more work, exit once empty
    exit_sent: bool = False
    kill_reason: str | None = None  # why we killed it (e.g. handler timeout), for the reject
    overdue: set[int] = field(default_factory=set)  # running ids past the timeout we killed for
    #: How a signal reaches the process (tests of the core in one process replace it).
    send_signal: Callable[[int, int], None] = os.kill
    _ready: bool = field(default=False, init=False)
    _jobs: int = field(default=0, init=False)  # deliveries finished by the current process
    #: Processes of this place in a row that died before they were ready.
    _early_deaths: int = field(default=0, init=False)

    @property
    def alive(self) -> bool:
        return self.pid is not None

    @property
    def ready(self) -> bool:
        """The current process reported READY (its handler's init() returned)."""
        return self._ready

    @property
    def accepting(self) -> bool:
        """Ready for new work: started, not recycling, not asked to exit."""
        return self._ready and not self.retiring and not self.exit_sent

    def started(self, pid: int) -> None:
        self.pid = pid

    def became_ready(self) -> None:
        """The process reported READY: the run of early deaths is over."""
        self._ready, self._early_deaths = True, 0

    def job_finished(self, count: int = 1) -> int:
        """The process finished ``count`` deliveries; returns how many it finished so far."""
        self._jobs += count
        return self._jobs

    def died_early(self) -> int:
        """A process died before it was ready; returns how many did in a row."""
        self._early_deaths += 1
        return self._early_deaths

    def kill(self, sig: int, reason: str | None = None, overdue: set[int] | None = None) -> None:
        """Signal the process (if there is one); ``reason`` fails what it was running."""
        if reason is not None:
            self.kill_reason, self.overdue = reason, overdue or set()
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                self.send_signal(self.pid, sig)

    def request_stop(self) -> None:
        """The job stops: the process starts nothing more (it reports SKIPPED instead)."""
        self.to_child.request_stop()

    def request_exit(self) -> bool:
        """Ask the process to exit once it read everything before (sent once)."""
        if self.alive and not self.exit_sent:
            self.exit_sent = self.to_child.put(protocol.encode_exit())
        return self.exit_sent

    def retire(self) -> None:
        """Recycle the process: it gets no more work and exits once idle."""
        self.retiring = True

    def gone(self) -> None:
        """The process is gone: forget it and make the rings empty for a replacement."""
        self.pid, self.kill_reason, self._jobs = None, None, 0
        self._ready = self.retiring = self.exit_sent = False
        self.overdue = set()
        self.to_child.reset()
        self.to_parent.reset()


class RingMemoryError(Exception):
    """The shared memory of the rings could not be allocated; the message says how much."""


def make_places(count: int, ring_slots: int, slot_size: int) -> list[HandlerPlace]:
    """Shared memory and wake-up descriptors for ``count`` handler processes (before forking).

    ``ring_slots`` and ``slot_size`` are the rings' cells (``Ring``). Raises RingMemoryError
    when the machine refuses the memory (ENOMEM, an address-space limit)."""
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
    places = []
    for index in range(count):
        base = 2 * index * ring_bytes
        rings = [
            Ring(view[at : at + ring_bytes], ring_slots, slot_size, os.eventfd(0, os.EFD_NONBLOCK))
            for at in (base, base + ring_bytes)
        ]
        places.append(HandlerPlace(index, rings[0], rings[1]))
    return places
