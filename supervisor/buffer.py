"""The delivery buffer: every delivery this supervisor owns, and where it is.

Prefetch is accounting, not a queue size: a delivery counts from the moment it is received
until its settlement is confirmed by the broker (or the broker tells us it is no longer
ours). Waiting + in a ring + running + completed-but-unconfirmed <= prefetch, always.

Every change of a delivery's state is a method here, and each state has one place (the
containers are private: the arbiter and the settler ask and tell through methods):

    WAITING   -> the waiting line            (received, back from a dead handler, or taken
                                               back from a stalled one: ``take_back``; what
                                               came back waits ahead, ``came_back``)
    QUEUED    -> its handler's ring queue     (written to the ring, not started)
    RUNNING   -> its handler's running table  (the handler reported STARTED, or a plain
                                               handler's mark named it or a later one: see
                                               ``started_up_to``, ``_started_before``)
    COMPLETED -> the completed line           (outcome known, settlement not confirmed)
    SETTLING  -> the settling table           (in a settlement call right now)
    ABANDONED -> nowhere                      (its handler was killed at the stop deadline:
                                               still owned, handed to recovery at exit)

``check()`` verifies exactly that (tests call it after every step).

A delivery taken back from a handler's ring (``take_back``) is in the waiting line, and may
be in another ring or finished, while its DELIVER record still sits in the first ring: its
number there (``Entry.number`` was that) is kept per handler until the process reports it
WITHDRAWN (``withdrawn``), so that report is told from the one of a delivery the process
may have reached as the cut came (worker.protocol, "Taking back").
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter

from broker.base import Delivery
from broker.failure import Failure


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
    place: int | None = None  # the handler it was last given to (for on_success)
    number: int = 0  # its number in that handler's ring (worker.protocol, "Taking back")
    started_at: float = 0.0
    error: str | None = None  # None: succeeded; text: failed (reject)
    failure: Failure | None = None  # why it failed, as operators read it (with ``error``)
    release: bool = False  # completed as "never started": release, not commit/reject
    held: bool = False  # an async handler returned it to its event loop (HELD)
    settle_failures: int = 0
    uncertain: bool = False  # a settlement of it was uncertain once (counted once)

    def __repr__(self) -> str:
        return f"Entry({self.id}, {self.delivery.pid!r}, {self.state.value}, place={self.place})"

    @property
    def came_back(self) -> bool:
        """Waiting again after a handler's ring held it (taken back, withdrawn, its process
        gone): a ring numbered it, and a delivery never handed out has no number."""
        return self.state is State.WAITING and self.number != 0


class AccountingError(AssertionError):
    """The buffer was asked for a change that its accounting forbids: a bug, never a
    condition to live with (the supervisor stops with exit 4 and is restarted)."""


class Buffer:
    """The ledger. Handlers are named by their place's index (``HandlerPlace.index``)."""

    def __init__(self, prefetch: int, handlers: int) -> None:
        self.prefetch = prefetch
        self._entries: dict[int, Entry] = {}
        self._waiting: deque[Entry] = deque()
        self._completed: deque[Entry] = deque()
        self._settling: dict[int, Entry] = {}
        self._queued: list[deque[Entry]] = [deque() for _ in range(handlers)]
        self._running: list[dict[int, Entry]] = [{} for _ in range(handlers)]
        #: Per handler: numbers of the deliveries taken back from its ring whose records it
        #: has not reported WITHDRAWN yet.
        self._taken_back: list[set[int]] = [set() for _ in range(handlers)]
        self._written = [0] * handlers  # per handler: the number of the last DELIVER written
        self._next_id = 1

    # -- counts and queries ------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return len(self._entries)

    @property
    def room(self) -> int:
        return self.prefetch - len(self._entries)

    @property
    def waiting_count(self) -> int:
        """Deliveries waiting for a handler (not written to a ring)."""
        return len(self._waiting)

    @property
    def completed_count(self) -> int:
        """Deliveries whose outcome is known and that no settlement call holds now."""
        return len(self._completed)

    def nothing_to_settle(self) -> bool:
        """Nothing completed waits for settlement, and no settlement call is under way."""
        return not self._completed and not self._settling

    def load(self, place: int) -> int:
        """Deliveries given to handler ``place`` and not finished (queued or running)."""
        return len(self._queued[place]) + len(self._running[place])

    def queued_count(self, place: int) -> int:
        """Deliveries in handler ``place``'s ring not known to have started."""
        return len(self._queued[place])

    def running_count(self, place: int) -> int:
        """Deliveries handler ``place`` is known to run (or ran, the outcome unread)."""
        return len(self._running[place])

    def taken_back_count(self, place: int) -> int:
        """Records in handler ``place``'s ring taken back and not reported WITHDRAWN yet."""
        return len(self._taken_back[place])

    def unstarted(self, in_order: bool = False) -> int:
        """Deliveries waiting or queued in a ring, not started yet. ``in_order``: the
        handlers run their rings one delivery at a time and report no start, so the first
        queued one of a handler with nothing known to run is counted as running (it runs,
        or starts as soon as the process reads it)."""
        queued = sum(map(len, self._queued))
        if in_order:
            queued -= sum(1 for place, line in enumerate(self._queued)
                          if line and not self._running[place])
        return len(self._waiting) + queued

    def unsettled(self, place: int) -> bool:
        """Something given to handler ``place`` still waits for its on_success confirmation."""
        return any(entry.place == place for entry in self._entries.values())

    def running_in(self, place: int) -> list[Entry]:
        """What handler ``place`` is running, in the order it started them."""
        return list(self._running[place].values())

    def overdue(self, place: int, limit: float, now: float) -> set[int]:
        """Ids of the deliveries handler ``place`` has been running longer than ``limit``."""
        return {
            entry.id for entry in self._running[place].values() if now - entry.started_at > limit
        }

    def busy(self) -> tuple[int, int]:
        """(handlers running something, deliveries running in all)."""
        counts = [len(running) for running in self._running]
        return sum(1 for count in counts if count), sum(counts)

    def in_state(self, state: State, place: int | None = None) -> list[Entry]:
        """The deliveries in ``state`` in their place's order (QUEUED and RUNNING: of
        handler ``place``); for tests and inspection."""
        if state is State.WAITING:
            return list(self._waiting)
        if state is State.COMPLETED:
            return list(self._completed)
        if state is State.SETTLING:
            return list(self._settling.values())
        if state is State.QUEUED:
            return list(self._queued[_required(place)])
        if state is State.RUNNING:
            return list(self._running[_required(place)].values())
        return [entry for entry in self._entries.values() if entry.state is state]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    # -- received -> waiting -> queued ----------------------------------------------------

    def add(self, deliveries: Iterable[Delivery]) -> None:
        entries, waiting, next_id = self._entries, self._waiting, self._next_id
        for delivery in deliveries:  # once per job received: its lookups made once
            entries[next_id] = entry = Entry(next_id, delivery)
            waiting.append(entry)
            next_id += 1
        self._next_id = next_id
        if len(self._entries) > self.prefetch:
            raise AccountingError(f"{len(self._entries)} deliveries outstanding > prefetch")

    def came_back_count(self) -> int:
        """How many at the head of the waiting line came back from a handler's ring (they
        wait ahead of the ones never handed out: ``came_back``)."""
        count = 0
        for entry in self._waiting:
            if not entry.came_back:
                break
            count += 1
        return count

    def next_waiting(self, count: int) -> list[Entry]:
        """The first ``count`` waiting deliveries, left waiting (see ``queue``)."""
        return [self._waiting[index] for index in range(min(count, len(self._waiting)))]

    def queue(self, place: int, count: int) -> None:
        """The first ``count`` waiting deliveries were written to handler ``place``'s ring,
        numbered there on from the last one written (worker.protocol, "Taking back")."""
        waiting, queued, state = self._waiting, self._queued[place], State.QUEUED
        first = self._written[place] + 1
        for number in range(first, first + count):  # once per job dispatched
            entry = waiting.popleft()
            entry.state, entry.place, entry.number = state, place, number
            queued.append(entry)
        self._written[place] += count

    def written(self, place: int) -> int:
        """DELIVER records written to handler ``place``'s ring since its process began: the
        number of the last one."""
        return self._written[place]

    def take_back(self, place: int, reached: int, in_order: bool, at: float) -> list[Entry]:
        """Handler ``place``'s process was cut off at delivery number ``reached`` of its
        ring: the queued ones numbered above it never start there, and go back to the head
        of the waiting line in their order (their records are remembered until reported
        WITHDRAWN). The ones up to ``reached`` were reached: ``in_order`` (a plain handler,
        which reports no start) they are running; otherwise their STARTED is on its way,
        or (any it passed after the cut was stored) WITHDRAWN. Returns those taken back."""
        queued = self._queued[place]
        if in_order:
            self.started_up_to(place, reached, at)
        taken: list[Entry] = []
        while queued and queued[-1].number > reached:
            taken.append(queued.pop())
        taken.reverse()
        self._taken_back[place].update(entry.number for entry in taken)
        self._wait_again_in_order(taken)
        return taken

    def withdrawn(self, place: int, entry_id: int, number: int) -> Entry | None:
        """Handler ``place`` reported WITHDRAWN: it did not start delivery ``entry_id``,
        number ``number`` of its ring. One taken back already: nothing more to do (None).
        One it had reached when its mark was read at the cut (queued, or running if its mark
        was read): back to the head of the waiting line, returned, among the others that
        came back in the order they were received (``_wait_again_in_order``)."""
        taken = self._taken_back[place]
        if number in taken:
            taken.discard(number)
            return None
        entry = self._running[place].get(entry_id)
        if entry is not None and entry.number == number:
            del self._running[place][entry_id]
        else:
            queued = self._queued[place]
            if not queued or queued[0].id != entry_id or queued[0].number != number:
                raise AccountingError(
                    f"handler {place} withdrew delivery {entry_id} (number {number}), which "
                    "it neither holds nor was taken back from it")
            entry = queued.popleft()
        self._wait_again_in_order([entry])
        return entry

    def drop(self, entry: Entry) -> bool:
        """Another consumer recovered this delivery before it started: forget it. False when
        it is no longer waiting (then its result will be stale, and that is handled there)."""
        if entry.state is not State.WAITING or entry.id not in self._entries:
            return False
        self._waiting.remove(entry)
        del self._entries[entry.id]
        return True

    # -- what a handler reports ------------------------------------------------------------

    def started(self, place: int, entry_id: int) -> Entry:
        entry = self._next_queued(place, entry_id)
        self._run(place, entry, time.monotonic())
        return entry

    def started_up_to(self, place: int, number: int, at: float) -> list[Entry]:
        """A handler that runs its ring's deliveries one at a time, in order, marked
        delivery ``number`` of its ring as reached: it and the queued ones before it (held
        for ``flush()``, or finished with the outcome not read yet) are running (the one
        reached may yet come back SKIPPED or WITHDRAWN). Nothing when none is queued up to
        there (their start is known already, or they finished). ``at``: when we learnt it."""
        queued = self._queued[place]
        promoted: list[Entry] = []
        while queued and queued[0].number <= number:
            entry = queued.popleft()
            self._run(place, entry, at)
            promoted.append(entry)
        return promoted

    def held(self, place: int, entry_id: int) -> None:
        self._running_entry(place, entry_id).held = True

    def finished(
        self, place: int, entry_id: int, error: str | None, failure: Failure | None = None,
        in_order: bool = False,
    ) -> Entry:
        """An outcome. ``in_order``: the handler runs its ring's deliveries one at a time
        and reports no start, so the outcome may be of a queued one; the queued ones before
        it started then (a handler with ``flush()`` holds them: its FAILED of a later one
        comes ahead of their DONE)."""
        entry = self._running[place].pop(entry_id, None)
        queued = self._queued[place]
        if entry is None and in_order and queued and queued[0].id == entry_id:
            entry = queued.popleft()  # the usual no-op job: its start never seen, untimed
        elif entry is None:
            if not in_order:
                self._running_entry(place, entry_id)  # raises: not running there
            self._started_before(place, entry_id, time.monotonic())
            entry = self._next_queued(place, entry_id)  # its start never seen: untimed
        self._complete(entry, error=error, failure=failure)
        return entry

    def finished_many(self, place: int, entry_ids: Iterable[int], in_order: bool = False) -> None:
        """``finished(place, entry_id, None, in_order=in_order)`` for each of ``entry_ids``
        in turn (a run of successes, as the handler reported them). The usual case (the
        head of its queue, or running) is taken here, without a call per delivery."""
        running, queued = self._running[place], self._queued[place]
        completed, state = self._completed, State.COMPLETED
        entry: Entry | None
        for entry_id in entry_ids:
            if in_order and queued and queued[0].id == entry_id:
                entry = queued.popleft()  # the usual no-op job: its start never seen, untimed
            else:
                entry = running.pop(entry_id, None)
                if entry is None:  # anything else: as finished() does it, or raise as it does
                    self.finished(place, entry_id, None, in_order=in_order)
                    continue
            # _complete of a success, inline
            entry.state, entry.error, entry.release, entry.failure = state, None, False, None
            completed.append(entry)

    def skipped(self, place: int, entry_id: int, in_order: bool = False) -> Entry:
        """Never started (the stop began first): released, attempts unchanged.
        ``in_order``: as in ``finished``, the queued ones before it started (held), and it
        may be running already: a plain handler marks a delivery reached before it skips it.
        """
        entry = self._running[place].pop(entry_id, None) if in_order else None
        if entry is None:
            if in_order:
                self._started_before(place, entry_id, time.monotonic())
            entry = self._next_queued(place, entry_id)
        self._complete(entry, release=True)
        return entry

    def handler_gone(
        self, place: int, blamed: Iterable[Entry] = (), reason: str = "", abandon: bool = False,
        failure: Failure | None = None,
    ) -> None:
        """Handler ``place``'s process is gone. ``blamed`` running deliveries fail with
        ``reason`` (and ``failure``, its record); with ``abandon`` the rest of the running
        ones stay owned for recovery (killed at the stop deadline); otherwise they wait to
        run again, ahead of the deliveries it never started, in their order."""
        running = list(self._running[place].values())
        queued = list(self._queued[place])
        self._running[place].clear()
        self._queued[place].clear()
        self._taken_back[place].clear()  # its ring is emptied for the next process
        self._written[place] = 0
        failed = {entry.id for entry in blamed}
        for entry in running:
            if entry.id in failed:
                self._complete(entry, error=reason, failure=failure)
            elif abandon:
                entry.state = State.ABANDONED
        rerun = [] if abandon else [e for e in running if e.id not in failed]
        self._wait_again([*rerun, *queued])

    def release_waiting(self) -> int:
        """Everything waiting completes as "never started" (a stop began)."""
        count = len(self._waiting)
        while self._waiting:
            self._complete(self._waiting.popleft(), release=True)
        return count

    # -- completed -> settling -> settled ----------------------------------------------------

    def take_completed(self, limit: int) -> list[Entry]:
        completed = self._completed
        if len(completed) <= limit:  # the usual case: all of them, in one C-level copy
            batch = list(completed)
            completed.clear()
        else:
            batch = [completed.popleft() for _ in range(limit)]
        settling, state = self._settling, State.SETTLING
        for entry in batch:
            entry.state = state
            settling[entry.id] = entry
        return batch

    def retry_later(self, entries: Iterable[Entry]) -> None:
        """Settlement failed or is uncertain: the entries stay outstanding, to be settled again."""
        for entry in entries:
            self._settled(entry)
            entry.state = State.COMPLETED
            entry.settle_failures += 1
            self._completed.append(entry)

    def forget(self, entry: Entry) -> None:
        """The broker confirmed a settlement (or the delivery is no longer ours)."""
        self._settled(entry)
        del self._entries[entry.id]

    def forget_all(self, entries: Iterable[Entry]) -> None:
        """``forget`` for each of ``entries``: the usual end of a settlement call, every
        one confirmed (one loop here instead of two method calls per delivery)."""
        settling, owned = self._settling, self._entries
        for entry in entries:
            if settling.pop(entry.id, None) is not entry:
                raise AccountingError(f"{entry} settled but not in a settlement call")
            del owned[entry.id]

    # -- the accounting, checked ------------------------------------------------------------

    def check(self) -> None:
        """Raise AccountingError unless every entry is in exactly the place its state names."""
        seen: dict[int, State] = {}

        def locate(entries: Iterable[Entry], state: State, handler: int | None = None) -> None:
            for entry in entries:
                if entry.id in seen:
                    raise AccountingError(f"{entry} is {seen[entry.id].value} and {state.value}")
                if entry.state is not state or self._entries.get(entry.id) is not entry:
                    raise AccountingError(f"{entry} found among the {state.value} ones")
                if handler is not None and entry.place != handler:
                    raise AccountingError(f"{entry} found in handler {handler}")
                seen[entry.id] = state

        locate(self._waiting, State.WAITING)
        locate(self._completed, State.COMPLETED)
        locate(self._settling.values(), State.SETTLING)
        for place, queued in enumerate(self._queued):
            locate(queued, State.QUEUED, place)
            locate(self._running[place].values(), State.RUNNING, place)
            numbers = [entry.number for entry in queued]
            if numbers != sorted(set(numbers)) or self._taken_back[place] & set(numbers):
                raise AccountingError(f"handler {place}'s queue is numbered {numbers}, taken "
                                      f"back {sorted(self._taken_back[place])}")
        for entry in self._entries.values():
            if entry.id not in seen and entry.state is not State.ABANDONED:
                raise AccountingError(f"{entry} is in no place")
        if len(self._entries) > self.prefetch:
            raise AccountingError(f"{len(self._entries)} deliveries outstanding > prefetch")

    # -- helpers -----------------------------------------------------------------------------

    def _next_queued(self, place: int, entry_id: int) -> Entry:
        """A handler starts (or skips) its ring's records in the order they were written."""
        queued = self._queued[place]
        if not queued or queued[0].id != entry_id:
            head = queued[0].id if queued else None
            raise AccountingError(
                f"handler {place} reported delivery {entry_id}, next queued {head}"
            )
        return queued.popleft()

    def _started_before(self, place: int, entry_id: int, at: float) -> list[Entry]:
        """Handler ``place`` runs its ring in order and reached ``entry_id``: the queued
        ones before it started (``at``) and are running now. Nothing when ``entry_id`` is
        not queued there."""
        queued = self._queued[place]
        if not queued or queued[0].id == entry_id:  # the usual case: nothing before it
            return []
        if not any(entry.id == entry_id for entry in queued):
            return []
        promoted: list[Entry] = []
        while queued[0].id != entry_id:
            entry = queued.popleft()
            self._run(place, entry, at)
            promoted.append(entry)
        return promoted

    def _run(self, place: int, entry: Entry, at: float) -> None:
        """``entry``, off handler ``place``'s queue, started at ``at``: running there."""
        entry.state, entry.started_at = State.RUNNING, at
        self._running[place][entry.id] = entry

    def _running_entry(self, place: int, entry_id: int) -> Entry:
        entry = self._running[place].get(entry_id)
        if entry is None:
            raise AccountingError(
                f"handler {place} reported delivery {entry_id}, not running there"
            )
        return entry

    def _complete(
        self, entry: Entry, error: str | None = None, release: bool = False,
        failure: Failure | None = None,
    ) -> None:
        entry.state, entry.error, entry.release = State.COMPLETED, error, release
        if failure is None and error is not None:
            failure = Failure.from_text(error)
        entry.failure = failure
        self._completed.append(entry)

    def _wait_again(self, entries: list[Entry]) -> None:
        """Back at the head of the waiting line, keeping their order."""
        for entry in reversed(entries):
            entry.state, entry.place, entry.held = State.WAITING, None, False
            self._waiting.appendleft(entry)

    def _wait_again_in_order(self, entries: list[Entry]) -> None:
        """Back among those at the head of the waiting line that came back from a ring (ahead
        of the ones never handed out), in the order they were received. A process passing
        several deliveries between the supervisor's cut and its read of the mark reports
        each WITHDRAWN, one at a time: each put at the head, they waited reversed, the
        first of its slice last (the slice's head, as likely as not the job that hangs and
        made its process look stalled); and the rest of that slice, taken back at the cut,
        waited ahead of it."""
        if not entries:
            return
        for entry in entries:
            entry.state, entry.place, entry.held = State.WAITING, None, False
        waiting, last = self._waiting, max(entry.id for entry in entries)
        ahead: list[Entry] = []
        while waiting and waiting[0].came_back and waiting[0].id < last:
            ahead.append(waiting.popleft())
        waiting.extendleft(reversed(sorted([*ahead, *entries], key=attrgetter("id"))))

    def _settled(self, entry: Entry) -> None:
        if self._settling.pop(entry.id, None) is not entry:
            raise AccountingError(f"{entry} settled but not in a settlement call")


def _required(place: int | None) -> int:
    if place is None:
        raise ValueError("queued and running deliveries are per handler: name its place")
    return place
