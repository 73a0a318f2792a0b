"""The delivery buffer: every delivery this supervisor owns, and where it is.

Prefetch is accounting, not a queue size: a delivery counts from the moment it is received
until its settlement is confirmed by the broker (or the broker tells us it is no longer
ours). Waiting + in a ring + running + completed-but-unconfirmed <= prefetch, always.

Every change of a delivery's state is a method here, and each state has one place:

    WAITING   -> the waiting line            (received, or back from a dead handler)
    QUEUED    -> its handler's ring queue     (written to the ring, not started)
    RUNNING   -> its handler's running table  (the handler reported STARTED)
    COMPLETED -> the completed line           (outcome known, settlement not confirmed)
    SETTLING  -> the settling table           (in a settlement call right now)
    ABANDONED -> nowhere                      (its handler was killed at the stop deadline:
                                               still owned, handed to recovery at exit)

``check()`` verifies exactly that (tests call it after every step).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from broker.base import Delivery


class State(enum.Enum):
    WAITING = "waiting"
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    SETTLING = "settling"
    ABANDONED = "abandoned"


@dataclass(slots=True, eq=False)
class Entry:
    """One delivery and what became of it so far."""

    id: int
    delivery: Delivery
    state: State = State.WAITING
    slot: int | None = None  # the handler it was last given to (for on_success)
    started_at: float = 0.0
    error: str | None = None  # None: succeeded; text: failed (reject)
    release: bool = False  # completed as "never started": release, not commit/reject
    held: bool = False  # an async handler returned it to its event loop (HELD)
    settle_failures: int = 0

    def __repr__(self) -> str:
        return f"Entry({self.id}, {self.delivery.pid!r}, {self.state.value}, slot={self.slot})"


class BufferError(AssertionError):
    """The buffer was asked for a change that its accounting forbids: a bug, never a
    condition to live with (the supervisor stops with exit 4 and is restarted)."""


class Buffer:
    def __init__(self, prefetch: int, handlers: int) -> None:
        self.prefetch = prefetch
        self.entries: dict[int, Entry] = {}
        self.waiting: deque[Entry] = deque()
        self.completed: deque[Entry] = deque()
        self.settling: dict[int, Entry] = {}
        self.queued: list[deque[Entry]] = [deque() for _ in range(handlers)]
        self.running: list[dict[int, Entry]] = [{} for _ in range(handlers)]
        self._next_id = 1

    # -- counts ------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return len(self.entries)

    @property
    def room(self) -> int:
        return self.prefetch - len(self.entries)

    def load(self, slot: int) -> int:
        """Deliveries given to handler ``slot`` and not finished (queued or running)."""
        return len(self.queued[slot]) + len(self.running[slot])

    def unstarted(self) -> int:
        """Deliveries waiting or queued in a ring, not started yet."""
        return len(self.waiting) + sum(map(len, self.queued))

    def unsettled(self, slot: int) -> bool:
        """Something given to handler ``slot`` still waits for its on_success confirmation."""
        return any(entry.slot == slot for entry in self.entries.values())

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    # -- received -> waiting -> queued ----------------------------------------------------

    def add(self, deliveries: Iterable[Delivery]) -> None:
        for delivery in deliveries:
            entry = Entry(self._next_id, delivery)
            self._next_id += 1
            self.entries[entry.id] = entry
            self.waiting.append(entry)
        if len(self.entries) > self.prefetch:
            raise BufferError(f"{len(self.entries)} deliveries outstanding > prefetch")

    def next_waiting(self, count: int) -> list[Entry]:
        """The first ``count`` waiting deliveries, left waiting (see ``queue``)."""
        return [self.waiting[index] for index in range(min(count, len(self.waiting)))]

    def queue(self, slot: int, count: int) -> None:
        """The first ``count`` waiting deliveries were written to handler ``slot``'s ring."""
        for _ in range(count):
            entry = self.waiting.popleft()
            entry.state, entry.slot = State.QUEUED, slot
            self.queued[slot].append(entry)

    def drop(self, entry: Entry) -> bool:
        """Another consumer recovered this delivery before it started: forget it. False when
        it is no longer waiting (then its result will be stale, and that is handled there)."""
        if entry.state is not State.WAITING or entry.id not in self.entries:
            return False
        self.waiting.remove(entry)
        del self.entries[entry.id]
        return True

    # -- what a handler reports ------------------------------------------------------------

    def started(self, slot: int, entry_id: int) -> Entry:
        entry = self._next_queued(slot, entry_id)
        entry.state, entry.started_at = State.RUNNING, time.monotonic()
        self.running[slot][entry_id] = entry
        return entry

    def held(self, slot: int, entry_id: int) -> None:
        self._running(slot, entry_id).held = True

    def finished(self, slot: int, entry_id: int, error: str | None) -> Entry:
        entry = self._running(slot, entry_id)
        del self.running[slot][entry_id]
        self._complete(entry, error=error)
        return entry

    def skipped(self, slot: int, entry_id: int) -> Entry:
        """Never started (the stop began first): released, attempts unchanged."""
        entry = self._next_queued(slot, entry_id)
        self._complete(entry, release=True)
        return entry

    def handler_gone(
        self, slot: int, blamed: Iterable[Entry] = (), reason: str = "", abandon: bool = False
    ) -> None:
        """Handler ``slot``'s process is gone. ``blamed`` running deliveries fail with
        ``reason``; with ``abandon`` the rest of the running ones stay owned for recovery
        (killed at the stop deadline); otherwise they wait to run again, ahead of the
        deliveries it never started, in their order."""
        running = list(self.running[slot].values())
        queued = list(self.queued[slot])
        self.running[slot].clear()
        self.queued[slot].clear()
        failed = {entry.id for entry in blamed}
        for entry in running:
            if entry.id in failed:
                self._complete(entry, error=reason)
            elif abandon:
                entry.state = State.ABANDONED
        rerun = [] if abandon else [e for e in running if e.id not in failed]
        self._wait_again([*rerun, *queued])

    def release_waiting(self) -> int:
        """Everything waiting completes as "never started" (a stop began)."""
        count = len(self.waiting)
        while self.waiting:
            self._complete(self.waiting.popleft(), release=True)
        return count

    # -- completed -> settling -> settled ----------------------------------------------------

    def take_completed(self, limit: int) -> list[Entry]:
        batch: list[Entry] = []
        while self.completed and len(batch) < limit:
            entry = self.completed.popleft()
            entry.state = State.SETTLING
            self.settling[entry.id] = entry
            batch.append(entry)
        return batch

    def retry_later(self, entries: Iterable[Entry]) -> None:
        """Settlement failed or is uncertain: the entries stay outstanding, to be settled again."""
        for entry in entries:
            self._settled(entry)
            entry.state = State.COMPLETED
            entry.settle_failures += 1
            self.completed.append(entry)

    def forget(self, entry: Entry) -> None:
        """The broker confirmed a settlement (or the delivery is no longer ours)."""
        self._settled(entry)
        del self.entries[entry.id]

    # -- the accounting, checked ------------------------------------------------------------

    def check(self) -> None:
        """Raise BufferError unless every entry is in exactly the place its state names."""
        places: dict[int, State] = {}

        def place(entries: Iterable[Entry], state: State, slot: int | None = None) -> None:
            for entry in entries:
                if entry.id in places:
                    raise BufferError(f"{entry} is {places[entry.id].value} and {state.value}")
                if entry.state is not state or self.entries.get(entry.id) is not entry:
                    raise BufferError(f"{entry} found among the {state.value} ones")
                if slot is not None and entry.slot != slot:
                    raise BufferError(f"{entry} found in handler {slot}")
                places[entry.id] = state

        place(self.waiting, State.WAITING)
        place(self.completed, State.COMPLETED)
        place(self.settling.values(), State.SETTLING)
        for slot, queued in enumerate(self.queued):
            place(queued, State.QUEUED, slot)
            place(self.running[slot].values(), State.RUNNING, slot)
        for entry in self.entries.values():
            if entry.id not in places and entry.state is not State.ABANDONED:
                raise BufferError(f"{entry} is in no place")
        if len(self.entries) > self.prefetch:
            raise BufferError(f"{len(self.entries)} deliveries outstanding > prefetch")

    # -- helpers -----------------------------------------------------------------------------

    def _next_queued(self, slot: int, entry_id: int) -> Entry:
        """A handler starts (or skips) its ring's records in the order they were written."""
        queued = self.queued[slot]
        if not queued or queued[0].id != entry_id:
            head = queued[0].id if queued else None
            raise BufferError(f"handler {slot} reported delivery {entry_id}, next queued {head}")
        return queued.popleft()

    def _running(self, slot: int, entry_id: int) -> Entry:
        entry = self.running[slot].get(entry_id)
        if entry is None:
            raise BufferError(f"handler {slot} reported delivery {entry_id}, not running there")
        return entry

    def _complete(self, entry: Entry, error: str | None = None, release: bool = False) -> None:
        entry.state, entry.error, entry.release = State.COMPLETED, error, release
        self.completed.append(entry)

    def _wait_again(self, entries: list[Entry]) -> None:
        """Back at the head of the waiting line, keeping their order."""
        for entry in reversed(entries):
            entry.state, entry.slot, entry.held = State.WAITING, None, False
            self.waiting.appendleft(entry)

    def _settled(self, entry: Entry) -> None:
        if self.settling.pop(entry.id, None) is not entry:
            raise BufferError(f"{entry} settled but not in a settlement call")
