"""Fair hand-out: which handler process gets which waiting delivery, and taking back what a
stalled process has not started.

Batches come from the broker, deliveries reach handler processes through rings, and a ring
holding several deliveries lets a process go from one job to the next without waiting for
the supervisor: with no-op jobs that is most of the speed. But a delivery in a ring waits
behind whatever its process runs. The rule (SPEC §7, "Fair hand-out"): no delivery waits in
one process's ring behind a running job while another process could run it.

The options weighed, and what this module does:

- Hand out on completion only (Sidekiq, BullMQ: a ring of one). Fair, but every job then
  waits for a round trip through the supervisor; with jobs of microseconds that costs most
  of the throughput.
- Shallow rings sized from measured job time. What waits behind a running job is then a few
  milliseconds of work (``RING_BUDGET``) at most: deep rings for no-op jobs, a ring of one
  (hand out on completion) for jobs of ten milliseconds or more. Alone it fails the mixed
  queue: a 500 ms job among 1 ms ones still holds the few queued behind it, and a job that
  hangs holds them for ever.
- Taking back what a process has not started. The ring is ours: the supervisor writes a
  cut, the process reads it before it starts each delivery, and both sides order their
  store and load so that at least one sees the other (worker.protocol, "Taking back"). A
  process that has started nothing for ``stall_after`` while holding unstarted deliveries
  (a job longer than the pace predicted, a hang, a frozen process) gets nothing more, and
  what it holds unstarted goes back to the head of the waiting line for the others.

This does both: rings sized from the pace of recent jobs, so that what a slow job can hold
up is small, and taking back, so that a slow job holds it up for ``stall_after`` at most.
``stall_after`` is 50 ms, or eight typical jobs when that is longer: a process is judged
stalled only by its own pace, and a take-back costs no more than writing the deliveries to
another ring. A handler with ``flush()`` keeps its slices (a process is filled before the
next gets any, so what it holds is made durable in one ``flush()``); the rule is the same for
a slice whose process is stalled. What comes back from a ring (taken back, or withdrawn as
the cut came) waits in the order it was received and is handed on as a slice of its own: to
a plain process that holds nothing (until there is one, nothing else is handed out), to the
least loaded async one. Behind a plain process's slice under way, a job that hangs (what
made its process look stalled) would hold that slice's successes, kept for its
``flush()``, as long as it runs. An async process is saturated when all its task slots are
busy or a delivery waits in it; it is stalled when saturated and it started nothing for
``stall_after``. With one handler process there is nobody else to run anything: its ring is
as deep as prefetch allows, as before, and nothing is ever taken back.

Nothing is lost or run twice: a taken-back delivery's record stays in the old ring until
that process reads and withdraws it (reported WITHDRAWN); the ledger keeps its number there
(``Buffer.take_back``). A process killed meanwhile leaves nothing to reconcile: its ring is
emptied with it, and what it held is accounted for as for any dead process.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

from supervisor.buffer import Buffer
from supervisor.handlers import HandlerPlace
from worker import protocol
from worker.ring import fence

log = logging.getLogger("supervisor.dispatch")

#: Seconds of work that may wait in a ring behind each task slot's running job: the time
#: the supervisor has to refill a ring before its process runs dry, on a loaded machine.
RING_BUDGET = 0.005
#: A saturated process that started nothing for this long (s) or STALL_JOBS typical jobs,
#: whichever is longer, is stalled: it gets nothing more, and what it holds unstarted is
#: taken back for the others.
STALL_MIN, STALL_JOBS = 0.05, 8
#: A handler with ``flush()``: each process is given at least this many (or its fair
#: share of prefetch, if more) before the next gets any, so a small prefetch is not cut into
#: flushes of 2-8 (see ``plan``).
FLUSH_BATCH = 16
#: The pace: at most one sample of handler seconds this often (s), each weighing this much.
SAMPLE_EVERY, SAMPLE_WEIGHT = 0.01, 0.1


class Pace:
    """The typical job's handler seconds, as recent successes timed them.

    A geometric moving average of the median of sampled batches of outcomes: a rare slow job
    moves it little (1% of 500 ms jobs among 1 ms ones leave it near 1 ms), a change of the
    whole workload moves it within a few dozen samples. At most one sample per
    ``SAMPLE_EVERY``: the supervisor's cost per job stays what it was."""

    def __init__(self) -> None:
        self._log: float | None = None  # log of the typical seconds; None: nothing seen yet
        self._next = 0.0

    @property
    def typical(self) -> float | None:
        """Seconds of a typical job, or None before any success was timed."""
        return None if self._log is None else math.exp(self._log)

    def observe(self, seconds: Sequence[float], now: float) -> None:
        """A run of successes, each timed by its handler process (0.0: untimed)."""
        if now < self._next or not seconds:
            return
        self._next = now + SAMPLE_EVERY
        median = sorted(seconds)[len(seconds) // 2]
        sample = math.log(max(median, 1e-6))
        self._log = sample if self._log is None else self._log + SAMPLE_WEIGHT * (
            sample - self._log)


class Dispatcher:
    """Hands the buffer's waiting deliveries to the handler places (``dispatch``) and takes
    back from a stalled one. ``slots``: deliveries one process runs at once (an async
    handler's tasks_per_process, else 1); ``fill``: the handler has ``flush()`` (slices);
    ``in_order``: a plain handler, whose process reports no start (its mark tells)."""

    def __init__(
        self, buffer: Buffer, places: list[HandlerPlace], *, slots: int, fill: bool,
        in_order: bool, clock: Callable[[], float] = time.monotonic,
        on_taken_back: Callable[[int], None] = lambda count: None,
    ) -> None:
        self.buffer = buffer
        self.places = places
        self.slots = slots
        self.fill = fill
        self.in_order = in_order
        self.clock = clock
        self.pace = Pace()
        self.fair = len(places) > 1  # one process: nobody to hand anything else to
        self.share = -(-buffer.prefetch // len(places))  # prefetch's fair share per process
        self.taken_back = 0  # deliveries taken back so far
        self.on_taken_back = on_taken_back  # told how many, each time (the metrics)
        count = len(places)
        self._mark = [0] * count  # per place: its mark as last read
        self._progress_at = [0.0] * count  # per place: when its mark last moved (or it began)

    def observe(self, seconds: Sequence[float]) -> None:
        """A run of successes, each timed by its process: the pace of jobs."""
        self.pace.observe(seconds, self.clock())

    # -- how deep, and who is stalled -----------------------------------------------------------

    def depth(self) -> int:
        """The most one process holds (queued and running): its share of prefetch (with
        ``flush()``: at least FLUSH_BATCH), and with several processes no more than its
        slots plus RING_BUDGET of work behind them at the typical pace."""
        depth = max(self.share, FLUSH_BATCH) if self.fill else self.share
        typical = self.pace.typical
        if not self.fair or typical is None:
            return depth
        behind = math.floor(self.slots * RING_BUDGET / typical) if typical > 0 else depth
        return max(1, min(depth, self.slots + behind))

    def stall_after(self) -> float:
        """Seconds without a start after which a saturated process is stalled."""
        typical = self.pace.typical or 0.0
        return max(STALL_MIN, STALL_JOBS * typical)

    def saturated(self, place: HandlerPlace) -> bool:
        """Whatever it is given now waits: a delivery of its ring is not known to have
        started, or all its task slots run one (a plain handler: it holds anything)."""
        buffer, index = self.buffer, place.index
        return (buffer.queued_count(index) > 0
                or buffer.running_count(index) >= self.slots)

    def look(self, now: float) -> None:
        """Read every process's mark: one that moved since last time made progress now."""
        marks, progress_at = self._mark, self._progress_at
        for place in self.places:
            mark = place.to_parent.marked
            if mark != marks[place.index]:
                marks[place.index], progress_at[place.index] = mark, now

    def stalled(self, place: HandlerPlace, now: float, after: float) -> bool:
        """Saturated, and it started nothing for ``after`` seconds (``look`` first)."""
        return (place.alive and now - self._progress_at[place.index] >= after
                and self.saturated(place))

    # -- handing out ---------------------------------------------------------------------------

    def dispatch(self) -> None:
        """Take back what waits where it should not (``rebalance``), then move waiting
        deliveries into the rings of the ready processes: see ``plan``."""
        buffer = self.buffer
        if not self.fair:
            if buffer.waiting_count and self.places[0].accepting:
                self._hand_out(self.places, 0.0)
            return
        now = self.clock()
        ready = self.rebalance(now)
        if buffer.waiting_count and ready:
            self._hand_out(ready, now)

    def rebalance(self, now: float) -> list[HandlerPlace]:
        """Take back all a process has not started when it is stalled, or when it holds
        more than ``depth`` (rings filled before the pace of jobs was known, or slower jobs
        now) while another could start something at once; only when some ready process is
        not stalled (else what is taken back would only wait elsewhere). The ready ones
        that are not stalled are returned: they get what waits."""
        self.look(now)
        after = self.stall_after()
        stalled = [place for place in self.places if self.stalled(place, now, after)]
        ready = [place for place in self.places if place.accepting and place not in stalled]
        if not ready:
            return ready
        if stalled:
            for place in stalled:
                self.take_back(place, now)
        if any(not self.saturated(place) for place in ready):  # one could start at once
            depth = self.depth()
            for place in self.places:
                if place.alive and self.buffer.load(place.index) > depth:
                    self.take_back(place, now)
        return ready

    def _hand_out(self, ready: list[HandlerPlace], now: float) -> None:
        buffer, depth = self.buffer, self.depth()
        came_back = self.fill and self.fair and buffer.came_back_count() > 0
        if came_back and (self._hand_back(ready, depth, now) or not buffer.waiting_count):
            return
        loads = [buffer.load(place.index) for place in ready]
        counts = plan(loads, depth, buffer.waiting_count, self.fill)
        for place, count in zip(ready, counts, strict=True):
            if count:
                self._write(place, count, now)

    def _hand_back(self, ready: list[HandlerPlace], depth: int, now: float) -> bool:
        """With ``flush()``: what came back from a ring (taken back, withdrawn) starts a
        slice, not the slice under way that ``plan`` fills first. A plain process runs its
        slice in order and holds each success for the ``flush()`` its empty ring brings:
        behind them, a delivery that came back from a stalled process (the head of its
        slice, withdrawn as the cut came, may well be the job that hangs) would hold them,
        and their room in prefetch, as long as it runs. So a plain handler's go only to a
        process that holds nothing, and wait (with what is behind them in the line) for
        one; an async process runs them beside its others: the least loaded first.
        True when some still wait for a process that holds nothing."""
        buffer = self.buffer
        for place in sorted(ready, key=lambda place: buffer.load(place.index)):  # stable
            load = buffer.load(place.index)
            count = min(buffer.came_back_count(), depth - load)
            if count <= 0 or (self.in_order and load):
                break
            if self._write(place, count, now) < count:
                break  # a full ring: the rest waits for the next dispatch, at the head
        return self.in_order and buffer.came_back_count() > 0

    def _write(self, place: HandlerPlace, count: int, now: float) -> int:
        """The first ``count`` waiting deliveries to ``place``'s ring; returns how many it
        took (a full ring takes fewer: the rest waits for the next dispatch)."""
        buffer = self.buffer
        if self.fair and not self.saturated(place):
            self._progress_at[place.index] = now  # its wait for a start begins now
        entries = buffer.next_waiting(count)
        records = protocol.encode_delivers([
            (e.id, (delivery := e.delivery).raw, delivery.attempts, delivery.plain)
            for e in entries
        ])
        written = place.to_child.put_many(records)
        buffer.queue(place.index, written)
        return written

    def take_back(self, place: HandlerPlace, now: float) -> int:
        """Cut off ``place``'s ring at what is written now: its process starts nothing
        written before the cut that it has not reached. The cut is stored, then the mark
        read (worker.protocol, "Taking back"): what lies beyond the mark goes back to the
        waiting line. Returns how many."""
        if not self.buffer.queued_count(place.index):
            return 0
        place.to_child.mark(self.buffer.written(place.index) + 1)
        fence()
        reached = place.to_parent.marked
        taken = self.buffer.take_back(place.index, reached, self.in_order, now)
        if taken:
            self.taken_back += len(taken)
            self.on_taken_back(len(taken))
            log.debug("took back %d deliveries handler %d had not started (it reached number "
                      "%d of its ring)", len(taken), place.index, reached)
        return len(taken)

    def next_look(self) -> float | None:
        """Seconds until a process holding deliveries not known to have started would be
        stalled, if it starts nothing meanwhile (the arbiter sets a timer: ``dispatch`` is due then
        even when no outcome comes). None: no process could stall now, or those that could
        are stalled already (an outcome or a new process brings the next look)."""
        now, after = self.clock(), self.stall_after()
        due = [self._progress_at[place.index] + after - now for place in self.places
               if place.alive and self.buffer.queued_count(place.index)
               and now - self._progress_at[place.index] < after]
        return max(min(due), 0.001) if due else None

def plan(loads: list[int], depth: int, waiting: int, fill: bool) -> list[int]:
    """How many of ``waiting`` deliveries each ready handler gets (``loads``: what each holds
    now, queued or running), none to hold more than ``depth``.

    Spread (``fill`` false): each next delivery to the least loaded, the first on a tie, so
    every process starts work at once. Fill (a handler with ``flush()``): the most loaded
    with room first, the first on a tie, up to ``depth``, then the next: what one process
    holds is flushed together once its ring is empty, so spreading a batch would cut it into
    several flushes, each paying the store's write and sync."""
    if len(loads) == 1:  # the usual single process: one slice, nothing to choose
        return [max(0, min(depth - loads[0], waiting))]
    counts = [0] * len(loads)
    if fill:  # slices, not a choice per delivery
        # sorted() is stable: on a tie the first place keeps its turn.
        for index in sorted(range(len(loads)), key=lambda i: -loads[i]):
            counts[index] = max(0, min(depth - loads[index], waiting))
            waiting -= counts[index]
        return counts
    share = list(loads)
    for _ in range(waiting):
        index = min(range(len(share)), key=share.__getitem__)
        if share[index] >= depth:
            break
        share[index] += 1
        counts[index] += 1
    return counts
