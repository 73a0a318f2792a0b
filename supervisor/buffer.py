"""The delivery buffer: every delivery this supervisor owns, and where it is.

Prefetch is accounting, not a queue size: a delivery counts from the moment it is received
until its settlement is confirmed by the broker (or the broker tells us it is no longer
ours). Waiting + in a ring + running + completed-but-unconfirmed <= prefetch, always.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from broker.base import Delivery


class State(enum.Enum):
    WAITING = "waiting"  # received, not yet written to a handler's ring
    QUEUED = "queued"  # in a handler's ring, not yet started
    RUNNING = "running"  # a handler reported STARTED
    COMPLETED = "completed"  # outcome known, settlement not yet confirmed
    SETTLING = "settling"  # in a settlement call right now


@dataclass(slots=True, eq=False)
class Entry:
    id: int
    delivery: Delivery
    state: State = State.WAITING
    slot: int | None = None
    started_at: float = 0.0
    error: str | None = None  # None: succeeded; text: failed (reject)
    release: bool = False  # completed as "never started": release instead of commit/reject
    settle_failures: int = 0


@dataclass(slots=True)
class Buffer:
    prefetch: int
    entries: dict[int, Entry] = field(default_factory=dict)
    waiting: deque[Entry] = field(default_factory=deque)
    completed: deque[Entry] = field(default_factory=deque)
    _next_id: int = 1

    @property
    def outstanding(self) -> int:
        return len(self.entries)

    @property
    def room(self) -> int:
        return self.prefetch - len(self.entries)

    def add(self, deliveries: Iterable[Delivery]) -> None:
        for delivery in deliveries:
            entry = Entry(self._next_id, delivery)
            self._next_id += 1
            self.entries[entry.id] = entry
            self.waiting.append(entry)
        if len(self.entries) > self.prefetch:  # a bug, never a condition to live with
            raise AssertionError(f"{len(self.entries)} deliveries outstanding > prefetch")

    def requeue_front(self, entries: list[Entry]) -> None:
        """Put entries back at the head of the waiting line, keeping their order."""
        for entry in reversed(entries):
            entry.state, entry.slot = State.WAITING, None
            self.waiting.appendleft(entry)

    def start(self, entry: Entry) -> None:
        entry.state, entry.started_at = State.RUNNING, time.monotonic()

    def complete(self, entry: Entry, error: str | None = None, release: bool = False) -> None:
        entry.state, entry.error, entry.release = State.COMPLETED, error, release
        self.completed.append(entry)

    def take_completed(self, limit: int) -> list[Entry]:
        batch: list[Entry] = []
        while self.completed and len(batch) < limit:
            entry = self.completed.popleft()
            entry.state = State.SETTLING
            batch.append(entry)
        return batch

    def retry_later(self, entries: Iterable[Entry]) -> None:
        """Settlement failed or is uncertain: the entries stay outstanding, to be settled again."""
        for entry in entries:
            entry.state = State.COMPLETED
            entry.settle_failures += 1
            self.completed.append(entry)

    def forget(self, entry: Entry) -> None:
        """The broker confirmed a settlement (or the delivery is no longer ours)."""
        self.entries.pop(entry.id, None)

    def take_waiting(self) -> list[Entry]:
        entries = list(self.waiting)
        self.waiting.clear()
        return entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())
