"""The handler pool: the handler processes' lifecycle, beside the arbiter's data path.

One process per handler place (supervisor.handlers), forked by the fork server. The pool
starts nothing itself: it reads the fork server's events (a process started or exited, a
reload's import ended) and decides what follows: a replacement, now or after a growing
pause when processes die before they are ready (gunicorn's arbiter, without the data);
recycling after ``max_jobs_per_process`` or ``max_rss_mb``; the kill at ``handler_timeout``;
SIGHUP's reload (supervisor.reload); and, at stop, the signals at the deadline and the exit
of every process. What the processes hold is the buffer's: the arbiter reads their outcome
rings and settles; the pool tells the buffer only when a process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Protocol

import psutil

from supervisor import blame, exits, failures
from supervisor.buffer import Buffer
from supervisor.config import CANCEL_GRACE, Config
from supervisor.handlers import HandlerPlace
from supervisor.metrics import Metrics
from supervisor.reload import CODE_EVENTS, HandlerCode
from supervisor.running import run_seconds as running_seconds
from worker.forkserver import SERVER_PLACE, Event, Spawner, status_text
from worker.handler import Shape
from worker.process import CHILD_INIT_FAILED

log = logging.getLogger("supervisor")

#: A place whose processes die this many times in a row before they are ready stops us (exit 4,
#: which systemd restarts); before that each replacement waits RESPAWN_DELAY * 2**n (<= 10 s).
MAX_EARLY_DEATHS, RESPAWN_DELAY = 5, 0.5
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, read straight from /proc (cheap enough per job)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except FileNotFoundError:
        return psutil.Process(pid).memory_info().rss


class OutcomeRings(Protocol):
    """The handler processes' outcome rings as the pool reads them (supervisor.outcomes)."""

    def read_outcomes(self, place: HandlerPlace) -> None: ...

    def arm(self, place: HandlerPlace) -> None: ...

    def note_started(self, place: HandlerPlace) -> None: ...


class DataPath(Protocol):
    """What the pool asks of the arbiter: whether it stops, its way to stop or fail, the
    outcome rings it reads, and the events its loops wait on."""

    stopping: bool
    progress: asyncio.Event  # the stop sequence re-checks
    settle_wanted: asyncio.Event

    def request_stop(self, exit_code: int | None = None) -> None: ...

    def fail(self, what: str, error: BaseException | None) -> None: ...

    def guarded(self, callback: Callable[..., None]) -> Callable[..., None]: ...

    @property
    def outcomes(self) -> OutcomeRings: ...

    def release_waiting(self) -> None: ...

    async def wait_until(
        self, condition: Callable[[], bool], deadline: float, interruptible: bool = True
    ) -> None: ...


class HandlerPool:
    """The handler processes of one job: replaced, recycled, reloaded, killed, stopped."""

    def __init__(
        self,
        config: Config,
        places: list[HandlerPlace],
        forkserver: Spawner,
        shape: Shape,
        buffer: Buffer,
        metrics: Metrics,
        arbiter: DataPath,
        *,
        concurrent: bool,
    ) -> None:
        self.config = config
        self.places = places
        self.forkserver = forkserver
        #: The handler code its processes run, reloaded on SIGHUP.
        self.code = HandlerCode(forkserver, shape)
        self.buffer = buffer
        self.metrics = metrics
        self.arbiter = arbiter
        self.concurrent = concurrent  # async def: several deliveries at once per process
        self.abandoning = False  # handlers were signalled at stop: what they ran stays owned

    # -- processes started and gone ----------------------------------------------------------

    def handle_forkserver_events(self) -> None:
        for event in self.forkserver.read_events():
            if event.kind in CODE_EVENTS:
                self.code_event(event)
                continue
            if event.place == SERVER_PLACE:  # a server died: no more handlers
                asyncio.get_running_loop().remove_reader(self.forkserver.events_fd)
                server = (f"handler server {event.pid} (code generation {event.generation})"
                          if event.generation else f"fork server {event.pid}")
                log.error("%s exited (%s): stopping", server, status_text(event.status))
                self.arbiter.request_stop(exits.BROKEN)
                self.lose_all_handlers()
                continue
            place = self.places[event.place]
            if event.kind == "started":
                place.started(event.pid)
                if self.code.outdated(event.generation):  # spawned before a reload adopted
                    place.retire()
            elif event.kind == "exited":
                self.handle_child_exit(place, event.pid, event.status)

    def handle_child_exit(self, place: HandlerPlace, pid: int, status: int | None) -> None:
        # What it wrote before it died counts (a DONE or HELD not read yet would otherwise
        # make a finished delivery look running): the ring outlives the process.
        try:
            self.arbiter.outcomes.read_outcomes(place)
        except Exception as error:  # a bug; the accounting below must still run
            if self.arbiter.stopping:  # already failing: one "stopping" line is enough
                log.error("outcomes of handler process %d unreadable: %r", pid, error)
            else:
                self.arbiter.fail("reading a dead handler's outcomes failed", error)
        expected, was_ready = place.exit_sent, place.ready
        failure = (failures.timed_out(place.kill_reason, pid) if place.kill_reason
                   else failures.lost(pid, status))
        reason = place.kill_reason or f"worker lost: {failure.message}"
        self.arbiter.outcomes.note_started(place)  # the mark outlives the process, as the ring does
        running = self.buffer.running_in(place.index)
        blamed = blame.blamed(running, concurrent=self.concurrent, overdue=place.overdue)
        place.gone()
        self.arbiter.outcomes.arm(place)
        if self.abandoning:
            # Stopped at the deadline: what was running stays owned and is recovered later.
            self.buffer.handler_gone(place.index, abandon=True)
        else:
            # Blamed deliveries count an attempt; the rest run again unchanged (see blame).
            self.buffer.handler_gone(place.index, blamed, failure.summary, failure=failure)
            # Timed out or lost: a failed run, timed here (no process timed it).
            self.metrics.handlers_done(running_seconds(blamed, time.monotonic()))
            replaced = ("" if self.arbiter.stopping or status == CHILD_INIT_FAILED
                        else "; a new handler process takes its place")
            if running:
                pids = ", ".join(entry.delivery.pid for entry in blamed[:5])
                more = f" and {len(blamed) - 5} more" if len(blamed) > 5 else ""
                log.error("%s while handling %s%s: that run failed (the job's outcome line "
                          "says what follows)%s", reason, pids, more, replaced)
            elif not expected and not self.arbiter.stopping and was_ready:
                log.error("%s%s", reason, replaced)
        if self.arbiter.stopping:  # nothing is dispatched any more: what came back is released
            self.arbiter.release_waiting()
        elif status == CHILD_INIT_FAILED:
            # init() failed: that repeats in every new process, so halt (gunicorn does too).
            log.error("handler process %d failed to start (%s): halting", pid, reason)
            self.arbiter.request_stop(exits.HANDLER_INIT)
        elif not was_ready and not expected:  # asked to exit (a reload): replaced at once
            self.respawn_later(place, pid, reason)
        else:
            if not expected:
                self.metrics.child_restart()
            self.forkserver.spawn(place.index)
        self.arbiter.settle_wanted.set()
        self.arbiter.progress.set()

    def respawn_later(self, place: HandlerPlace, pid: int, reason: str) -> None:
        """Killed before it was ready (the OOM killer, a stray kill during a respawn): not
        a reason to halt for good. Replaced after a growing pause; if it keeps dying, stop
        with an exit code systemd restarts, so the whole service starts afresh."""
        deaths = place.died_early()
        if deaths >= MAX_EARLY_DEATHS:
            log.error("handler process %d died before it was ready, %d times in a row (%s): "
                      "stopping", pid, deaths, reason)
            self.arbiter.request_stop(exits.BROKEN)
            return
        delay = min(RESPAWN_DELAY * 2 ** (deaths - 1), 10.0)
        log.error("handler process %d died before it was ready (%s): another in %.1fs",
                  pid, reason, delay)
        self.metrics.child_restart()
        asyncio.get_running_loop().call_later(delay, self.arbiter.guarded(self.respawn), place)

    def respawn(self, place: HandlerPlace) -> None:
        if not self.arbiter.stopping and not place.alive:
            self.forkserver.spawn(place.index)

    def lose_all_handlers(self) -> None:
        """The fork server is gone and its children with it (they follow it by PDEATHSIG;
        killed here too, to be sure): no exit event will come for them. What they held goes
        back unblamed (they did not fail), so the stop need not wait for them."""
        for place in self.places:
            if not place.alive:
                continue
            place.kill(signal.SIGKILL)
            place.gone()
            self.buffer.handler_gone(place.index)
        self.arbiter.release_waiting()
        self.arbiter.progress.set()

    # -- timeouts and recycling --------------------------------------------------------------

    def enforce_limits(self) -> None:
        job = self.config.job
        now = time.monotonic()
        # A plain handler is killed at its timeout; an async one cancelled itself by then.
        limit = job.handler_timeout + (CANCEL_GRACE if self.concurrent else 0.0)
        for place in self.places:
            if not place.alive:
                continue
            self.arbiter.outcomes.note_started(place)
            overdue = (
                self.buffer.overdue(place.index, limit, now) if job.handler_timeout else set()
            )
            if overdue and not place.kill_reason:
                log.error("handler %d exceeded handler_timeout %ss: killing process %d",
                          place.index, job.handler_timeout, place.pid)
                reason = f"handler timeout after {job.handler_timeout}s" + (
                    f" (not cancelled within {CANCEL_GRACE:g}s)" if self.concurrent else "")
                place.kill(signal.SIGKILL, reason, overdue)
                continue
            self.retire_if_idle(place)

    def jobs_finished(self, place: HandlerPlace, count: int) -> None:
        """Its process finished ``count`` more deliveries: time to recycle it?"""
        jobs = place.job_finished(count)
        job = self.config.job
        if ((job.max_jobs_per_process or job.max_rss_mb) and not place.retiring
                and self.should_recycle(place, jobs)):
            place.retire()  # before the next dispatch, so it gets nothing more

    def should_recycle(self, place: HandlerPlace, jobs: int) -> bool:
        """After its process finished its ``jobs``-th delivery."""
        job = self.config.job
        if job.max_jobs_per_process and jobs >= job.max_jobs_per_process:
            log.info("recycling handler %d after %d jobs", place.index, jobs)
            return True
        if job.max_rss_mb and place.pid:
            with contextlib.suppress(psutil.Error, OSError):
                rss_mb = rss_bytes(place.pid) / 2**20
                if rss_mb > job.max_rss_mb:
                    log.info("recycling handler %d at %.0f MiB RSS", place.index, rss_mb)
                    return True
        return False

    def retire_if_idle(self, place: HandlerPlace) -> None:
        """A recycled handler exits once nothing of it is queued, running or unconfirmed."""
        if place.retiring and place.alive and not place.exit_sent and self.idle(place):
            place.request_exit()

    def idle(self, place: HandlerPlace) -> bool:
        """Nothing of this handler is queued, running or waiting for its confirmation."""
        return self.buffer.load(place.index) == 0 and not self.buffer.unsettled(place.index)

    # -- SIGHUP: new code --------------------------------------------------------------------

    def handle_reload_signal(self) -> None:
        """SIGHUP, as gunicorn reads it without preload_app: the handler is imported anew
        (supervisor.reload), and once that worked every handler process is replaced (see
        ``code_event``)."""
        if self.arbiter.stopping:
            log.info("SIGHUP received while stopping: ignored")
            return
        self.code.reload()

    def code_event(self, event: Event) -> None:
        """A reload's import ended, or an old handler server exited. New code adopted: each
        process takes no more work, exits once what it holds is finished and settled, and
        one forked from the new code takes its place; nothing is released or requeued."""
        alive = [place for place in self.places if place.alive and not place.retiring]
        if self.code.finished(event, len(alive), self.arbiter.stopping):
            for place in alive:
                place.retire()
                self.retire_if_idle(place)

    # -- stopping ----------------------------------------------------------------------------

    def signal_busy(self, sig: int) -> None:
        self.abandoning = True
        for place in self.places:
            if self.buffer.load(place.index):
                place.kill(sig)

    async def stop_children(self, deadline: float) -> None:
        for place in self.places:
            place.request_exit()
        wait_until = self.arbiter.wait_until
        await wait_until(lambda: not any(p.alive for p in self.places), deadline)
        for place in self.places:
            place.kill(signal.SIGKILL)
        await wait_until(lambda: not any(p.alive for p in self.places), time.monotonic() + 2)
