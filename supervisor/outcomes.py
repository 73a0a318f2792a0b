"""The handler processes' outcomes, read from their rings for the arbiter's data path.

Each handler process writes what became of its deliveries (started, done, failed, held,
skipped, taken back) and of itself (ready, init() failed) to its outcome ring, and wakes
us through the ring unless we left it unarmed. Those records become changes of the
buffer, the job counts the pool recycles by, and the metrics; what follows them (settle,
dispatch, receive) is the arbiter's (``outcomes_taken``), and so is the choice to leave a
ring unarmed until the settle call under way returns (``reads_after_settling``). Once
settled, an outcome is confirmed back to a handler that waits for that (on_success).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from broker.failure import Failure
from supervisor import exits
from supervisor.buffer import Buffer, Entry
from supervisor.dispatch import Dispatcher
from supervisor.handlers import HandlerPlace
from supervisor.metrics import Metrics
from supervisor.pool import HandlerPool
from supervisor.reporting import Reporter
from worker import protocol

log = logging.getLogger("supervisor")


class DataPath(Protocol):
    """What reading outcomes asks of the arbiter: whether it stops, what follows the
    outcomes read, whether a ring may wait for the settle call, and its way to stop."""

    stopping: bool
    room: asyncio.Event  # set when receiving may be due again

    def reads_after_settling(self) -> bool: ...

    def outcomes_taken(self) -> None: ...

    def running_dry(self) -> bool: ...

    def release_waiting(self) -> None: ...

    def request_stop(self, exit_code: int | None = None) -> None: ...


class HandlerOutcomes:
    """Reads the handler places' outcome rings, arms them again, confirms settlements."""

    def __init__(
        self,
        buffer: Buffer,
        places: list[HandlerPlace],
        dispatcher: Dispatcher,
        metrics: Metrics,
        pool: HandlerPool,
        reporter: Reporter,
        arbiter: DataPath,
        *,
        concurrent: bool,
        wants_confirm: bool,
    ) -> None:
        self.buffer = buffer
        self.places = places
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.pool = pool
        self.reporter = reporter
        self.arbiter = arbiter
        self.concurrent = concurrent  # async def: several deliveries run at once per process
        self.wants_confirm = wants_confirm  # the handler has on_success: tell it what settled
        #: Places whose outcome ring we did not arm (its process wakes nobody): the settle
        #: loop reads them when its call returns (see ``take_outcomes``).
        self.unarmed: dict[int, HandlerPlace] = {}

    # -- outcomes read -----------------------------------------------------------------------

    def handle_outcomes(self, place: HandlerPlace) -> None:
        """The place's process woke us: it wrote outcomes."""
        place.to_parent.clear_wakeup()
        self.take_outcomes(place)
        self.arbiter.outcomes_taken()

    def take_outcomes(self, place: HandlerPlace) -> bool:
        """Read the place's outcomes, then arm its ring, unless a settle call will read it
        when it returns (``reads_after_settling``): at prefetch 100 a process finishing
        jobs while a call is under way woke us every few jobs, each wake-up a turn of the
        loop and a system call on both sides, for outcomes that wait for that call anyway.
        True when there were any (``outcomes_taken`` is then due)."""
        ring, taken = place.to_parent, False
        while True:
            records = ring.get_many(1024)
            if records:
                self.handle_records(place, records)
                taken = True
            elif self.arbiter.reads_after_settling():
                self.unarmed[place.index] = place
                return taken
            elif ring.prepare_sleep():
                self.unarmed.pop(place.index, None)
                return taken

    def read_outcomes(self, place: HandlerPlace) -> None:
        while records := place.to_parent.get_many(1024):
            self.handle_records(place, records)

    def outcomes_waiting(self) -> bool:
        """Outcomes wait in a ring left unarmed (``take_unarmed`` has something to read)."""
        return any(place.to_parent.waiting for place in self.unarmed.values())

    def take_unarmed(self) -> None:
        """Read the rings left unarmed; each is armed again unless the next call follows."""
        taken = False
        for place in list(self.unarmed.values()):
            taken = self.take_outcomes(place) or taken
        if taken:  # at prefetch 1 usually none: the one job was in the call
            self.arbiter.outcomes_taken()

    def arm(self, place: HandlerPlace) -> None:
        """Declare ourselves asleep on the place's outcome ring, so its writer wakes us."""
        self.unarmed.pop(place.index, None)
        if not place.to_parent.prepare_sleep():
            asyncio.get_running_loop().call_soon(self.handle_outcomes, place)

    def handle_records(self, place: HandlerPlace, records: list[bytes]) -> None:
        """Outcome records, in ring order: DONE (one per job) in runs, each run taken in
        one go (``finish_done``); any other kind by itself, after the DONEs before it."""
        done, first = protocol.DONE, 0
        for index, record in enumerate(records):
            if record[0] != done:
                if index > first:
                    self.finish_done(place, records[first:index])
                self.handle_outcome(place, record)
                first = index + 1
        if first < len(records):
            self.finish_done(place, records[first:] if first else records)

    def finish_done(self, place: HandlerPlace, records: list[bytes]) -> None:
        """A run of DONE records, each a success (buffer, job count, metrics, recycling): one
        call per run instead of six per job."""
        ids, seconds = protocol.done_many(records)  # seconds: timed by the handler process
        self.buffer.finished_many(place.index, ids, in_order=not self.concurrent)
        if self.dispatcher.fair:  # rings sized from the pace of jobs (supervisor.dispatch)
            self.dispatcher.observe(seconds)
        self.metrics.handlers_done(seconds)
        self.pool.jobs_finished(place, len(ids))

    def handle_outcome(self, place: HandlerPlace, record: bytes) -> None:
        """One record of any kind but DONE (``handle_records`` takes those in runs)."""
        kind, delivery_id, data = protocol.decode(record)
        if kind == protocol.STARTED:
            self.buffer.started(place.index, delivery_id)
        elif kind == protocol.HELD:
            self.buffer.held(place.index, delivery_id)
        elif kind == protocol.FAILED:
            self.handle_failed(place, delivery_id, protocol.failure_data(data))
        elif kind == protocol.SKIPPED:
            self.buffer.skipped(place.index, delivery_id, in_order=not self.concurrent)
        elif kind == protocol.WITHDRAWN:  # taken back (supervisor.dispatch): never started
            self.buffer.withdrawn(place.index, delivery_id, data)  # type: ignore[arg-type]
            if self.arbiter.stopping:
                self.arbiter.release_waiting()
        elif kind == protocol.READY:
            place.became_ready()
            self.reporter.notify_ready_once()
            self.arbiter.room.set()  # its share of prefetch can be received now
        elif kind == protocol.INIT_FAILED:
            log.error("handler init() failed in process %s: %s", place.pid, data)
            self.arbiter.request_stop(exits.HANDLER_INIT)

    def handle_failed(self, place: HandlerPlace, delivery_id: int, failure: Failure) -> None:
        """FAILED: the delivery is finished with ``failure``, timed by its process (else
        here, when its start was seen: STARTED, or the mark)."""
        entry = self.buffer.finished(place.index, delivery_id, failure.summary, failure,
                                     in_order=not self.concurrent)
        if failure.seconds:
            self.metrics.handler_done(failure.seconds)
        elif entry.started_at:
            self.metrics.handler_done(time.monotonic() - entry.started_at)
        self.pool.jobs_finished(place, 1)

    def note_started(self, place: HandlerPlace) -> None:
        """A plain handler reports no start: its mark on the outcome ring names the delivery
        it runs (or ran last). Read when it matters: timeouts, the title, its death.
        Outcomes left for the settle loop are read first (a call that hangs or backs off
        leaves them unread no longer than a watch period)."""
        if place.index in self.unarmed and self.take_outcomes(place):
            self.arbiter.outcomes_taken()
        if self.concurrent or not place.to_parent.marked:
            return
        promoted = self.buffer.started_up_to(place.index, place.to_parent.marked,
                                             time.monotonic())
        # All it holds started (held for flush()): refill.
        if promoted and self.arbiter.running_dry():
            self.arbiter.room.set()

    # -- settled: told to the handler ---------------------------------------------------------

    def confirm(self, entry: Entry, committed: bool) -> None:
        """Tell the handler process its message is settled (it runs on_success if committed)."""
        if not self.wants_confirm or entry.place is None:
            return
        place = self.places[entry.place]
        if place.alive and not place.to_child.put(protocol.encode_confirm(entry.id, committed)):
            log.warning("ring of handler %d full: on_success of %s skipped", place.index,
                        entry.delivery.pid)
