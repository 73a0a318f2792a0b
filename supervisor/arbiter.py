"""The supervisor's event loop: receive, dispatch, collect outcomes, settle, renew, stop.

One asyncio loop owns every broker call. Handler processes are forked by the fork server
(started before this loop existed) and talk to us only through their two rings:

    broker -> buffer -> ring -> handler -> ring -> settlement -> broker

Signals only set flags and events; the shutdown reads top to bottom in ``shutdown``.
The handler processes' lifecycle (replacements, recycling, reload, the kill at the
deadline) is the handler pool's (supervisor.pool); their outcome rings are read, and
settlements confirmed back to them, by supervisor.outcomes; readiness, the title, the
progress line and the queue gauges are the reporter's (supervisor.reporting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from broker.base import (
    MAX_BATCH,
    Broker,
    BrokerError,
    BrokerRefused,
    Leased,
    PushesArrivals,
    Received,
    RecordsRunning,
    ReservesAhead,
    WatchesConnection,
)
from supervisor import eager, exits, logs, running, systemd
from supervisor.buffer import Buffer, Entry
from supervisor.config import Config
from supervisor.dispatch import Dispatcher
from supervisor.handlers import HandlerPlace
from supervisor.metrics import Metrics
from supervisor.outage import Outage, unreachable
from supervisor.outcomes import HandlerOutcomes
from supervisor.pool import HandlerPool
from supervisor.reporting import Reporter
from supervisor.settlement import Settler
from worker.forkserver import Spawner
from worker.handler import Handler, Shape

log = logging.getLogger("supervisor")

TERM_GRACE = 2.0  # seconds between SIGTERM and SIGKILL to handlers at the deadline
SETTLE_ROUND = 5.0  # the last settlement round at stop may take this long
WATCH_PERIOD = 0.25  # handler timeouts, recycling and the process title
RETRY_EVERY = 5.0  # the longest pause between receives while the broker cannot be reached


class Arbiter:
    def __init__(
        self,
        config: Config,
        broker: Broker,
        places: list[HandlerPlace],
        forkserver: Spawner,
        handler: Handler | Shape,
        notifier: systemd.Notifier | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.notifier = notifier or systemd.Notifier(None)
        self.metrics = metrics or Metrics()
        self.connected = False
        self.broker = broker
        self.places = places
        self.buffer = Buffer(config.job.prefetch, len(places))
        self.wants_confirm = handler.wants_confirm
        # async def: several deliveries run at once in each process (worker.aio).
        self.concurrent = handler.is_async
        #: The handler processes' lifecycle: replaced, recycled, reloaded, killed, stopped.
        self.pool = HandlerPool(config, places, forkserver,
                                handler if isinstance(handler, Shape) else handler.shape,
                                self.buffer, self.metrics, self, concurrent=self.concurrent)
        slots = config.job.tasks_per_process if self.concurrent else 1
        self.capacity = len(places) * slots
        #: Fair hand-out to the handler places (a handler with flush() gets slices).
        self.dispatcher = Dispatcher(self.buffer, places, slots=slots,
                                     fill=handler.flushes, in_order=not self.concurrent,
                                     on_taken_back=self.metrics.taken_back)
        self.fair_look: asyncio.TimerHandle | None = None  # see ``dispatch``
        #: The broker's reachability, told once each way (``down``, ``outages``: readable).
        self.outage = Outage(config.broker.safe_url, lambda: self.buffer.outstanding,
                             retry_every=RETRY_EVERY, lease=self.lease())
        #: READY and STATUS to systemd, /readyz, the title, the progress line, the gauges.
        self.reporter = Reporter(config, broker, self.buffer, places, self.metrics,
                                 self.notifier, self.outage, self, concurrent=self.concurrent)
        #: The outcome rings read (buffer, job counts, metrics); settlements confirmed back.
        self.outcomes = HandlerOutcomes(self.buffer, places, self.dispatcher, self.metrics,
                                        self.pool, self.reporter, self, concurrent=self.concurrent,
                                        wants_confirm=self.wants_confirm)
        self.settler = Settler(broker, self.buffer,
                               self.outcomes.confirm if self.wants_confirm else None, self.metrics,
                               self.opened, self.outage)
        self.exit_code = exits.OK
        self.stopping = False
        self.killing = False  # the deadline passed (or a second signal): no more waiting
        # Set after the first renewal was tried: on Redis it registers this supervisor's
        # owner-token prefix, so no delivery of ours exists that recovery cannot tell for ours.
        self.first_renewal = asyncio.Event()
        self.closed = False  # the background loops end (even if a client swallows a cancel)
        self.stop_requested = asyncio.Event()
        self.room = asyncio.Event()  # set when receiving may be due again (see receive_due)
        #: Once prefetch was full, receive again when this much of it is free (or the
        #: handlers are about to run dry): a slow handler then costs one receive per batch
        #: instead of one per job.
        self.refill_at = max(1, min(MAX_BATCH, self.buffer.prefetch // 4))
        self.topped_up = False  # prefetch was full since the last refill began
        self.settle_wanted = asyncio.Event()
        self.settle_in_flight = False  # the settle loop's call (one at a time) is under way
        #: Settlement calls that may run at once (several on JetStream: see settle_loop).
        self.settle_calls = asyncio.Semaphore(broker.settle_concurrency)
        #: A broker that can reserve, in a settle call's write, the room it frees (Redis).
        ahead = broker if isinstance(broker, ReservesAhead) else None
        self.reserve_ahead: Callable[[int], bool] | None = (
            ahead.reserve_ahead if ahead is not None else None)
        #: The most one receive takes: see ``batch_limit``.
        self.batch = batch_limit(self.buffer.prefetch, ahead is not None and ahead.reserves_ahead)
        #: A broker that is pushed what it pulled (NATS): see ``take_arrivals``.
        self.arrivals = broker if isinstance(broker, PushesArrivals) else None
        self.ahead_settling: asyncio.Event | None = None  # a settle call reserving ahead runs
        #: The room asked for by the receive under way (0: none). Its deliveries are not
        #: counted yet: take_arrivals must not fill that room, reserve_for must not ask again.
        self.receiving = 0
        self.progress = asyncio.Event()  # any outcome or settlement: the stop sequence re-checks
        self.tasks: list[asyncio.Task[Any]] = []
        self.settling: set[asyncio.Task[Any]] = set()  # settlement calls in flight
        self.settle_failures = 0  # in a row: the back-off before the next try
        #: The last error of each broker-facing loop still failing (receive, sample): while
        #: any is, /readyz says the broker is unreachable.
        self.broker_trouble: dict[str, str] = {}
        #: What each handler process runs: slow-job warnings, metrics, the broker's copy.
        self.running = running.RunningJobs(
            config, places, self.buffer, self.metrics, concurrent=self.concurrent,
            write=broker.publish_running if isinstance(broker, RecordsRunning) else None)

    # -- the whole life ------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_stop_signal, sig)
        pool, outcomes = self.pool, self.outcomes
        loop.add_signal_handler(signal.SIGHUP, self.guarded(pool.handle_reload_signal))
        loop.add_reader(pool.forkserver.events_fd, self.guarded(pool.handle_forkserver_events))
        for place in self.places:
            loop.add_reader(place.to_parent.wake_fd, self.guarded(outcomes.handle_outcomes), place)
            outcomes.arm(place)
            pool.forkserver.spawn(place.index)
        try:
            await self.broker.connect()
        except (BrokerError, OSError) as error:
            log.error("cannot connect to the broker: %s", error)
            refused = isinstance(error, BrokerRefused)
            self.exit_code, self.stopping = (exits.REFUSED if refused else exits.BROKER), True
            await self.pool.stop_children(deadline=time.monotonic() + 5)
            return self.exit_code
        log.info(
            "consuming %s on %s with %d handler processes, prefetch %d",
            self.config.job.queue, self.config.broker.safe_url, len(self.places),
            self.buffer.prefetch,
        )
        notice = running.timeout_notice(self.config.job)
        if notice:
            log.info("%s", logs.Explanation(notice))
        self.connected = True
        self.outage.lease = self.lease()  # an adopted NATS consumer's ack wait is known now
        if isinstance(self.broker, WatchesConnection):  # it tells when its connection breaks
            self.outage.by_connection = True
            self.broker.watch_connection(self.outage.connection_lost, self.outage.connection_back)
        if self.arrivals is not None:  # a broker that is pushed what it pulled (NATS)
            self.arrivals.on_arrival(self.guarded(self.take_arrivals))
        self.reporter.notify_ready_once()
        reporter = self.reporter
        self.tasks = [
            self.start_task(coro)
            for coro in (
                self.receive_loop(), self.settle_loop(), self.renew_loop(),
                self.maintenance_loop(), self.watch_loop(),
                reporter.keepalive_loop(), reporter.progress_loop(), reporter.sample_loop(),
                self.running.watch(lambda: self.closed),
            )
        ]
        await self.stop_requested.wait()
        await self.shutdown()
        return self.exit_code

    def lease(self) -> float:
        """How long an unrenewed delivery stays ours (an adopted NATS consumer may hold
        deliveries for less than our lease)."""
        own = self.broker.lease if isinstance(self.broker, Leased) else math.inf
        return min(self.config.supervisor.lease, own)

    def broker_failed(self, error: Exception, began: float, line: str, *args: object) -> None:
        """A broker call failed: an outage is told once, by ``self.outage``; anything else
        (a refusal, a key of the wrong type) is this loop's own error line."""
        if unreachable(error):
            self.outage.lost(error, began)
        else:
            log.error(line, *args, error)

    # -- a failure nobody expected: one log line with the traceback, then a bounded stop ----

    def start_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=getattr(coro, "__name__", None))
        task.add_done_callback(self.task_ended)
        return task

    def task_ended(self, task: asyncio.Task[Any]) -> None:
        """A background loop that raised would leave us alive and useless: stop instead."""
        if task.cancelled() or task.exception() is None:
            return
        self.fail(f"{task.get_name()} died", task.exception())

    def guarded(self, callback: Callable[..., None]) -> Callable[..., None]:
        """A loop callback (readers) whose unexpected exception stops us instead of being
        printed by asyncio and repeated at every wake-up."""

        def run_guarded(*args: object) -> None:
            try:
                callback(*args)
            except Exception as error:
                self.fail(f"{callback.__name__} failed", error)

        return run_guarded

    def fail(self, what: str, error: BaseException | None) -> None:
        log.error("%s: stopping (exit %d) so that the service is restarted", what,
                  exits.BROKEN, exc_info=error)
        if not self.stopping:
            self.request_stop(exits.BROKEN)
        elif self.exit_code == exits.OK:
            self.exit_code = exits.BROKEN

    def handle_stop_signal(self, sig: int) -> None:
        if self.stopping:
            log.warning("second %s: killing handlers now", signal.Signals(sig).name)
            self.killing = True
            self.progress.set()
            return
        log.info("%s received: stopping", signal.Signals(sig).name)
        self.request_stop()

    def request_stop(self, exit_code: int | None = None) -> None:
        if exit_code is not None:
            self.exit_code = exit_code
        self.stopping = True
        self.metrics.readiness(self.reporter.not_ready())
        self.stop_requested.set()
        self.room.set()

    # -- receive and dispatch --------------------------------------------------------------

    async def receive_loop(self) -> None:
        failures = 0
        await self.first_renewal.wait()
        while not self.stopping:
            if not self.receive_due():
                self.room.clear()
                await self.room.wait()
                continue
            if self.ahead_settling is not None:  # the room it makes, and reserved: see reserve_for
                await self.ahead_settling.wait()
                continue
            room = self.receiving = min(self.receive_room(), self.batch)
            began, timed = self.outage.now(), time.perf_counter()
            try:
                # Timed without metrics.timed: a generator context manager costs, per receive.
                received = await self.broker.receive(room, self.config.broker.block_timeout)
                self.metrics.broker_call("receive", time.perf_counter() - timed)
            except (BrokerError, OSError) as error:
                self.metrics.broker_call("receive", time.perf_counter() - timed)
                failures += 1
                self.broker_trouble["receive"] = str(error)
                self.broker_failed(error, began, "receive failed (%d in a row): %s", failures)
                await asyncio.sleep(min(0.1 * 2**failures, RETRY_EVERY))
                continue
            finally:
                self.receiving = 0
            self.outage.back(began)
            failures = 0
            self.broker_trouble.pop("receive", None)
            self.took(received)

    def took(self, received: Received) -> None:
        """What a receive brought: the poisoned told, the deliveries buffered and dispatched."""
        for poisoned in received.poisoned:
            if poisoned.malformed:
                logs.log_malformed(log, self.config.job.queue, poisoned.reason)
                self.metrics.malformed()
            else:
                log.warning("dead-lettered without running: %s", poisoned.reason)
        if received.deliveries:
            self.metrics.received(len(received.deliveries))
            self.metrics.waited(received.deliveries)
            self.buffer.add(received.deliveries)
            self.dispatch()

    def take_arrivals(self) -> None:
        """The broker read pulled messages (NATS: those a settle call's pull ahead asked
        for). When a receive is due and none is in flight, they are taken here, in the
        turn they were read, and dispatched: the receive loop, woken for a receive of its
        own, would cost a turn of the event loop more before the handler gets its job (at
        prefetch 1, one per job). The broker gives them only when that takes no request
        and no wait; otherwise the receive loop's receive does it."""
        arrivals = self.arrivals
        if (arrivals is None or self.stopping or self.receiving
                or not self.first_renewal.is_set() or not self.receive_due()):
            return
        room = min(self.receive_room(), self.batch)
        received = arrivals.receive_nowait(room)
        if received is not None:
            self.metrics.broker_call("receive", 0.0)  # counted as the receive it replaces
            self.took(received)

    def receive_due(self) -> bool:
        """Filling up to prefetch; once full, room for a batch again (or for anything when
        the handlers are about to run dry)."""
        room = self.receive_room()
        if room <= 0:
            self.topped_up = True
            return False
        if self.refill_waits(room):
            return False
        self.topped_up = False
        return True

    def refill_waits(self, room: int) -> bool:
        """Prefetch was full and less than a batch is free, while the handlers still have
        started work: the receive waits for more room."""
        return self.topped_up and room < self.refill_at and not self.running_dry()

    def wake_receiver(self) -> None:
        """Wake the receive loop if ``receive_due`` would now say yes. Only the loop (and
        take_arrivals, receiving in its stead) changes ``topped_up``, so this is the answer
        it would find: a wake-up that finds no receive due would cost a turn of the event
        loop, and at prefetch 1 every read of a job's outcomes made one before the
        settlement made the one needed."""
        if self.room.is_set():
            return
        room = self.receive_room()
        if room > 0 and not self.refill_waits(room):
            self.room.set()

    def receive_room(self, freed: int = 0) -> int:
        """Room in prefetch for the handler processes that take work now: none is taken for
        one not ready (its init() still retried, or a replacement starting), where it would
        wait on us instead of on a queue another consumer reads. ``freed``: once that many
        more are settled."""
        room = self.buffer.room + freed
        if room <= 0:  # full (at prefetch 1, most of the time): no share can be more
            return room
        accepting = sum(place.accepting for place in self.places)
        share = -(-self.buffer.prefetch * accepting // len(self.places))
        return min(room, share - self.buffer.outstanding + freed)

    def running_dry(self) -> bool:
        """No more deliveries waiting to start than the handlers can run at once."""
        return self.buffer.unstarted(in_order=not self.concurrent) <= self.capacity

    def dispatch(self) -> None:
        """Hand waiting deliveries to the handler processes, taking back from a stalled one
        what it has not started (supervisor.dispatch). While a process holds deliveries it
        could stall on, a timer makes sure the next look comes when it would be stalled,
        even if no outcome comes meanwhile."""
        dispatcher = self.dispatcher
        if self.stopping:
            return
        if not dispatcher.fair:  # one handler process: most outcomes leave nothing waiting
            if self.buffer.waiting_count:
                dispatcher.dispatch()
            return
        dispatcher.dispatch()
        if self.fair_look is None:
            delay = dispatcher.next_look()
            if delay is not None:
                self.fair_look = asyncio.get_running_loop().call_later(
                    delay, self.guarded(self.look_again))

    def look_again(self) -> None:
        self.fair_look = None
        self.dispatch()

    # -- outcomes from handler processes (read by supervisor.outcomes) -----------------------

    def outcomes_taken(self) -> None:
        """Outcomes were read: settle them, refill the handlers, receive if they run dry."""
        if self.buffer.completed_count:
            self.settle_soon()
        self.progress.set()
        self.dispatch()
        if self.running_dry():
            self.wake_receiver()

    def reads_after_settling(self) -> bool:
        """The settle loop reads the unarmed rings once its call returns: one is under way,
        or completions wait for the next (one call at a time only: JetStream's run in tasks
        of their own), and nothing else waits on outcomes: no delivery waits for room in a
        ring, and the receive is under way or due, or has no room to take (else the
        handlers running dry would start it). Never while stopping (the stop waits on
        outcomes, not on calls)."""
        return (self.broker.settle_concurrency == 1 and not self.stopping and not self.closed
                and (self.settle_in_flight or self.buffer.completed_count > 0)
                and not self.buffer.waiting_count
                and (self.receiving > 0 or self.room.is_set() or self.ahead_settling is not None
                     or self.receive_room() <= 0))

    # -- settlement, renewal, maintenance ---------------------------------------------------

    async def settle_loop(self) -> None:
        """Settle what has completed as soon as a settlement call may start.

        With one call at a time (Redis), completions gather while it runs and the next
        call takes them all; a broker whose calls are many independent requests (JetStream)
        allows several, so one lost reply holds back nothing that completed after it.
        """
        calls, outcomes = self.settle_calls, self.outcomes
        try:
            while not self.closed:
                await self.settle_wanted.wait()
                self.settle_wanted.clear()
                while self.buffer.completed_count:
                    await calls.acquire()
                    batch = self.buffer.take_completed(MAX_BATCH)
                    if not batch:
                        calls.release()
                        break
                    if self.broker.settle_concurrency == 1:  # no task of its own to make
                        if await self.settle_batch(batch, calls) and outcomes.outcomes_waiting():
                            # The call reserved ahead: the receive loop claims that first
                            # (its turn is next), so Redis runs the claim while this loop
                            # reads outcomes and builds the next call, not after.
                            await asyncio.sleep(0)
                        outcomes.take_unarmed()  # what completed during the call: the next one
                        continue
                    self.settling_task(asyncio.create_task(self.settle_batch(batch, calls)))
        finally:  # no call comes round any more (closed, or this loop died): arm them all
            self.settle_in_flight = False
            for place in list(outcomes.unarmed.values()):
                outcomes.arm(place)

    def settle_soon(self) -> None:
        """Completions wait: settle them. Where calls run in tasks of their own (JetStream)
        and one may start now, it starts here, in the turn the outcomes were read, up to
        its first wait (its acks written: ``eager``): the settle loop, woken to make its
        task, and the task's first turn would come after whatever the loop has queued
        (at prefetch 1, per job). Otherwise the settle loop does it."""
        calls = self.settle_calls
        if self.broker.settle_concurrency == 1 or calls.locked() or self.closed:
            self.settle_wanted.set()
            return
        batch = self.buffer.take_completed(MAX_BATCH)
        if batch:
            task = eager.start(self.settle_acquired(batch))
            if task is not None:
                self.settling_task(task)

    async def settle_acquired(self, batch: list[Entry]) -> None:
        """settle_batch with a permit taken first (free when settle_soon looked: no wait)."""
        await self.settle_calls.acquire()
        await self.settle_batch(batch, self.settle_calls)

    def settling_task(self, task: asyncio.Task[Any]) -> None:
        settling, task_ended = self.settling, self.task_ended

        # One callback, not two: there is one per job at prefetch 1.
        def ended(task: asyncio.Task[Any]) -> None:
            try:
                task_ended(task)
            finally:
                settling.discard(task)

        settling.add(task)
        task.add_done_callback(ended)

    async def settle_batch(self, batch: list[Entry], calls: asyncio.Semaphore) -> bool:
        """One settlement call. True when it reserved ahead: the receive loop claims that
        reservation now."""
        ahead = self.reserve_for(len(batch))
        try:
            self.settle_in_flight = self.broker.settle_concurrency == 1
            try:
                ok = await self.settler.settle(batch)
            finally:
                self.settle_in_flight = False
            self.ahead_settled(ahead)
            self.opened()
            for place in self.places:
                self.pool.retire_if_idle(place)
            if ok:
                self.settle_failures = 0
            else:  # the broker is unhappy: back off before trying those again
                self.settle_failures += 1
                await asyncio.sleep(min(0.05 * 2**self.settle_failures, 2.0))
        finally:
            calls.release()
            self.ahead_settled(ahead)
        if self.buffer.completed_count:
            self.settle_wanted.set()
        return ahead is not None

    def reserve_for(self, freed: int) -> asyncio.Event | None:
        """This settle call makes room for a receive: the broker reserves it in the call's
        own write (``reserve_ahead``), and the receive loop's next receive waits for the
        call (the room and the reservation come with its reply) and claims at once. The
        room is what the next receive will ask for once ``freed`` are settled, less what
        the receive under way asked for (it may take what is free now). Not when the loop
        was woken to receive that room itself, nor before the first renewal (it registers
        our reservations' token prefix), nor while stopping. The event the loop waits on."""
        ahead = self.reserve_ahead
        if (ahead is None or self.stopping or not self.first_renewal.is_set()
                or self.ahead_settling is not None or (self.room.is_set() and not self.receiving)):
            return None
        room = self.receive_room(freed) - self.receiving
        if room <= 0 or self.refill_waits(room) or not ahead(min(room, self.batch)):
            return None
        self.ahead_settling = asyncio.Event()
        return self.ahead_settling

    def ahead_settled(self, ahead: asyncio.Event | None) -> None:
        """The settle call that reserved ahead returned: the receive waiting for its room
        and reservation goes on (before any back-off of a failed call)."""
        if ahead is not None and self.ahead_settling is ahead:
            self.ahead_settling = None
            ahead.set()

    def opened(self) -> None:
        """Settlements were confirmed: room for receiving, progress for the stop sequence."""
        self.wake_receiver()
        self.progress.set()

    async def renew_loop(self) -> None:
        period = self.lease() / 3
        while not self.closed:
            # First right away: on Redis that also writes this supervisor's record, which
            # `status` and `drain` find it by.
            entries = list(self.buffer)
            began = self.outage.now()
            try:
                with self.metrics.timed("extend"):
                    owned = await self.broker.extend([entry.delivery for entry in entries])
            except (BrokerError, OSError) as error:
                self.broker_failed(error, began, "renewal of %d deliveries failed: %s",
                                   len(entries))
            else:
                self.outage.back(began)
                for entry, still_ours in zip(entries, owned, strict=True):
                    if not still_ours:
                        self.drop_lost(entry)
            self.first_renewal.set()
            await asyncio.sleep(period)

    def drop_lost(self, entry: Entry) -> None:
        """Another consumer recovered this delivery: never start it; a result will be stale."""
        if self.buffer.drop(entry):
            log.warning("delivery %s is no longer ours; dropped before it started",
                        entry.delivery.pid)
            self.room.set()

    async def maintenance_loop(self) -> None:
        while not self.closed:
            began = self.outage.now()
            try:
                with self.metrics.timed("maintain"):
                    report = await self.broker.maintain()
            except (BrokerError, OSError) as error:
                self.broker_failed(error, began, "maintenance failed: %s")
            else:
                self.outage.back(began)
                if report.total:
                    log.info(
                        "recovered %d deliveries (%d from expired reservations, %d whose claim "
                        "lapsed, %d legacy)", report.total, report.expired_reservations,
                        report.dead_consumers, report.legacy,
                    )
            await asyncio.sleep(self.config.supervisor.maintenance_interval)

    # -- watching handler processes -----------------------------------------------------------

    async def watch_loop(self) -> None:
        while not self.closed:
            self.pool.enforce_limits()
            self.reporter.update_title()
            self.metrics.beat()  # /healthz: this loop goes round
            self.metrics.readiness(self.reporter.not_ready())
            await asyncio.sleep(WATCH_PERIOD)

    # -- stopping ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop receiving, release what never started, let running handlers finish, settle.

        Handlers still running get SIGTERM ``TERM_GRACE`` before the deadline and SIGKILL at
        it; what they held ``abandon`` requeues (attempts + 1), as recovery would.
        """
        deadline = time.monotonic() + self.config.supervisor.shutdown_deadline
        self.notifier.stopping()
        self.reporter.update_title()
        self.broker.stop_waiting()  # an idle receive returns at once
        receiving = self.task("receive_loop")
        if receiving is not None:
            # A receive in flight is allowed to finish (it may hold claimed deliveries).
            await asyncio.wait({receiving}, timeout=self.config.broker.block_timeout + 1)
            receiving.cancel()
        settling = self.task("settle_loop")
        if settling is not None and settling.done():  # it died: what completed still settles
            self.tasks.append(self.start_task(self.settle_loop()))
        for place in self.places:
            place.request_stop()  # start nothing more: report SKIPPED instead
        self.release_waiting()
        grace = min(TERM_GRACE, self.config.supervisor.shutdown_deadline / 5)
        await self.wait_until(self.nothing_in_handlers, deadline - grace)
        if not self.nothing_in_handlers():
            self.pool.signal_busy(signal.SIGTERM)
            await self.wait_until(self.nothing_in_handlers, deadline)
        if not self.nothing_in_handlers():
            self.killing = True
            self.pool.signal_busy(signal.SIGKILL)
        await self.settle_remaining()
        await self.pool.stop_children(deadline=max(deadline, time.monotonic() + 1))
        self.closed = True
        for task in (*self.tasks, *self.settling):
            task.cancel()
        await asyncio.wait([*self.tasks, *self.settling], timeout=2)
        owned = self.buffer.outstanding
        if owned:
            log.warning("%d deliveries still owned at exit (their handlers were killed): "
                        "requeuing them, attempts + 1", owned)
        with contextlib.suppress(BrokerError, OSError):
            # Requeued now (a queue-5 worker would wait out its reapAfter for them); the
            # record goes too, which tells `status` and recovery that this supervisor is gone.
            await self.broker.abandon([entry.delivery for entry in self.buffer])
            await self.broker.close()
        log.info("stopped after %.1fs: %s; %d handed to recovery",
                 self.config.supervisor.shutdown_deadline - (deadline - time.monotonic()),
                 self.metrics.summary(), owned)

    def release_waiting(self) -> None:
        self.buffer.release_waiting()
        self.settle_wanted.set()

    def nothing_in_handlers(self) -> bool:
        return not self.killing and all(
            not place.alive or self.buffer.load(place.index) == 0 for place in self.places
        )

    def all_settled(self) -> bool:
        return self.buffer.nothing_to_settle()

    async def settle_remaining(self) -> None:
        """One last settlement round (bounded by SETTLE_ROUND) for everything completed."""
        self.release_waiting()
        bound = time.monotonic() + SETTLE_ROUND
        await self.wait_until(self.all_settled, bound, interruptible=False)

    async def wait_until(
        self, condition: Callable[[], bool], deadline: float, interruptible: bool = True
    ) -> None:
        """Wait for ``condition`` until ``deadline``; a second signal ends the wait early."""
        while not condition() and (remaining := deadline - time.monotonic()) > 0:
            if interruptible and self.killing:
                return
            self.progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.progress.wait(), min(remaining, 0.5))

    def task(self, name: str) -> asyncio.Task[Any] | None:
        return next((task for task in self.tasks if task.get_name() == name), None)


#: Batches in flight at full prefetch where a settle call reserves ahead (Redis).
BATCHES_IN_FLIGHT = 2


def batch_limit(prefetch: int, reserves_ahead: bool) -> int:
    """The most one receive takes: where a settle call reserves ahead, half of prefetch.

    There the receive after a settle call claims what it reserved before the outcomes that
    completed meanwhile are read (see ``settle_loop``), so one settle call tends to cover
    one whole batch and reserve its room as the next: batch sizes carry over from cycle to
    cycle and drift apart (89 and 11 at prefetch 100). The small batch then overlaps
    nothing. At half of prefetch or less, two batches of about half take turns: the
    handlers run one while Redis settles and claims the other.
    """
    if not reserves_ahead:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, -(-prefetch // BATCHES_IN_FLIGHT)))

