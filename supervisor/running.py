"""The running jobs: what each handler process runs now, and for how long (SPEC §7).

The ledger knows it (``Buffer.running_in``: a plain handler's start is read from its ring's
mark every watch period, an async one's from its STARTED record) and the places know the
processes. Once a second (``PERIOD``) the arbiter's ``watch`` loop builds the table from
them, oldest first, and:

- warns about a job past ``[job] slow_job_after`` (0: never), naming its pid, attempt,
  handler process and run time, and again each time its run time doubles, at least every
  ``SLOW_REPEAT_MAX``: a job that is only slow is told a few times (60, 120, 240 s ...), a
  hung one about once an hour however long it hangs; a warning at every period would bury
  the log under one job, a single one would be forgotten by the next morning. When many
  are due at once (an async process whose thousand calls wait on one dead server) a few
  are named and the rest counted in one line.
- gives the metrics the oldest job's age and how many run past ``slow_job_after``.
- keeps a copy in the broker where ``status`` and the dashboard of any host read it
  (``publish_running``: Redis's ``supervisor-running.{q}.{consumer id}``; JetStream keeps
  no records of ours, and there the handler processes' titles tell, on their own host).
  The copy holds the ``SHOWN`` oldest jobs and how many run in all, and the supervisor's
  figures (``supervisor.figures``: prefetch, jobs done, CPU, batch fill, queue wait), so the
  supervisors of one queue can be told apart. It is written when the table changed (a job
  started or ended), at most once a period, and otherwise every ``FIGURES_EVERY`` (the
  figures' totals move), also while nothing runs. (Without figures, as the tests' own
  publisher writes it: every third of its expiry while jobs run, none while nothing runs.)
  It expires after the lease, as the supervisor's own record does (a supervisor killed
  with ``kill -9`` leaves nothing for longer), and goes with that record at a stop.
  A short job that starts and ends within a period may never be in it: the copy shows
  what runs for a while, which is what a person reading ``status`` can act on.

Each job's run time in the copy is as of its writing; a reader adds the time since, read
from the copy's remaining expiry (the broker's clock), so clocks of different hosts never
enter the sum. Its start is this host's wall-clock time, for display only.

The table is rebuilt from the ledger each period, off the hot path: a job costs the
handler process its title (``worker.titles``) and the supervisor nothing per job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from broker.base import BrokerError
from broker.errors import describe
from supervisor import figures as supervisor_figures
from supervisor.buffer import Buffer, Entry
from supervisor.config import Config, JobConfig
from supervisor.figures import Figures
from supervisor.handlers import HandlerPlace
from supervisor.metrics import Metrics

log = logging.getLogger("supervisor")

#: Seconds between two looks at the running jobs (warnings, metrics, the broker's copy).
PERIOD = 1.0
#: The longest pause between two warnings about the same job (s).
SLOW_REPEAT_MAX = 3600.0
#: Jobs named one by one in the warnings of one look; the others are counted.
NAMED = 5
#: Jobs the broker's copy holds at most (the oldest); it says how many run in all.
SHOWN = 50
#: Characters of a job's pid the copy keeps (a producer chooses pids; queue 5's have 23).
PID_CHARS = 200
#: A copy longer than this is not read (ours are at most SHOWN records of a few hundred
#: bytes).
RECORD_LIMIT = 256 * 1024

#: Seconds between two writes of a copy that carries figures (``supervisor.figures``): it
#: is then kept while nothing runs too, so a reader sees every supervisor's progress.
FIGURES_EVERY = 2.0

#: How the copy is written: (record, expiry in whole s), or (None, _) to delete it.
Write = Callable[[bytes | None, int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Job:
    """One job running in a handler process."""

    handler: int  # the place's index ("handler 0")
    process: int  # the handler process's pid (0: not known)
    pid: str  # the job's pid
    attempt: int  # this run, from 1
    started: float  # unix s (the supervisor host's clock)
    elapsed: float  # seconds it has run, as of the table
    slow: bool = False  # past slow_job_after
    #: Which run of which delivery (entry id, start on the supervisor's monotonic clock):
    #: the same while it runs, never the same for another run. Not in the copy.
    run: tuple[int, float] = field(default=(0, 0.0), compare=False)


def table(places: Sequence[HandlerPlace], buffer: Buffer, *, concurrent: bool,
          slow_after: float, now: float, wall: float) -> list[Job]:
    """What runs in each place, oldest first. ``now``: the monotonic clock, ``wall``: the
    same moment in unix s. A plain handler's process runs one delivery: the newest started;
    those started before it returned and wait for ``flush()`` (so may the newest, while
    ``flush()`` runs: a plain process reports no return, and its row then counts the flush
    too). An async one's run unless it reported them HELD."""
    jobs = []
    for place in places:
        running = buffer.running_in(place.index)
        in_handler = ([entry for entry in running if not entry.held] if concurrent
                      else running[-1:])
        jobs += [_job(place, entry, slow_after, now, wall) for entry in in_handler]
    jobs.sort(key=lambda job: -job.elapsed)
    return jobs


def _job(place: HandlerPlace, entry: Entry, slow_after: float, now: float, wall: float) -> Job:
    elapsed = max(0.0, now - entry.started_at)
    return Job(place.index, place.pid or 0, entry.delivery.pid, entry.delivery.attempts + 1,
               wall - elapsed, elapsed, bool(slow_after) and elapsed >= slow_after,
               (entry.id, entry.started_at))


def run_seconds(entries: Iterable[Entry], now: float) -> list[float]:
    """How long each of ``entries`` ran until ``now``, for those whose start was seen (the
    handler seconds of runs that ended without an outcome: timed out, or lost)."""
    return [now - entry.started_at for entry in entries if entry.started_at]


def timeout_notice(job: JobConfig) -> str | None:
    """The start's line about ``handler_timeout = 0`` (None when a timeout is set)."""
    if job.handler_timeout:
        return None
    slow = (f"[job] slow_job_after = {job.slow_job_after:g}s warns about long runs"
            if job.slow_job_after else "[job] slow_job_after = 0 too: nothing warns about it")
    return ("[job] handler_timeout = 0: no handler call is ever stopped, by the operator's "
            "choice; a job that hangs holds its handler process until that process is killed "
            f"or the supervisor stops ({slow})")


# -- slow jobs ---------------------------------------------------------------------------------


def next_warning(told_at: float, elapsed: float) -> float:
    """The run time of the next warning after one due at ``told_at``, now ``elapsed``:
    the first doubling beyond it, at most SLOW_REPEAT_MAX apart."""
    due = told_at
    while due <= elapsed:
        due = min(2 * due, due + SLOW_REPEAT_MAX)
    return due


class SlowJobs:
    """Warnings about jobs past ``after`` seconds, at the pace ``next_warning`` sets."""

    def __init__(self, after: float) -> None:
        self.after = after
        self._due: dict[tuple[int, float], float] = {}  # run -> run time of its next warning

    def check(self, jobs: list[Job]) -> list[Job]:
        """The jobs to warn about now (each run told at its own pace)."""
        if not self.after:
            return []
        told, due = [], {}
        for job in jobs:
            if not job.slow:
                continue
            at = self._due.get(job.run, self.after)
            if job.elapsed >= at:
                told.append(job)
                at = next_warning(at, job.elapsed)
            due[job.run] = at
        self._due = due  # runs that ended are forgotten
        return told

    def tell(self, jobs: list[Job], queue: str) -> None:
        for job in jobs[:NAMED]:
            log.warning("job %s attempt %d has run %ds in handler %d (process %s), past "
                        "[job] slow_job_after = %gs; told again at %ds if it still runs",
                        job.pid, job.attempt, job.elapsed, job.handler, job.process or "?",
                        self.after, self._due.get(job.run, 0),
                        extra={"queue": queue, "pid": job.pid, "attempt": job.attempt})
        if len(jobs) > NAMED:
            log.warning("%d more jobs have run past [job] slow_job_after = %gs (up to %ds): "
                        "`status` lists the running jobs", len(jobs) - NAMED, self.after,
                        jobs[NAMED].elapsed, extra={"queue": queue})


# -- the broker's copy ---------------------------------------------------------------------------


def encode(jobs: list[Job], ttl: int, slow_after: float, figures: Figures | None = None
           ) -> bytes:
    """The copy: the SHOWN oldest of ``jobs`` (oldest first), how many run, its expiry, and
    the supervisor's figures when given."""
    record: dict[str, Any] = {
        "ttl": ttl, "slow_job_after": slow_after, "running": len(jobs),
        "jobs": [{"handler": job.handler, "process": job.process, "pid": job.pid[:PID_CHARS],
                  "attempt": job.attempt, "started": round(job.started, 3),
                  "elapsed": round(job.elapsed, 3)} for job in jobs[:SHOWN]],
    }
    if figures is not None:
        record["figures"] = figures.encode()
    return orjson.dumps(record)


@dataclass(frozen=True, slots=True)
class Copy:
    """A supervisor's copy as a reader sees it (``decode``)."""

    running: int  # jobs running in all (``jobs`` holds the oldest SHOWN)
    slow_job_after: float
    age: float  # seconds since it was written (its run times include them)
    jobs: list[Job]
    figures: Figures | None = None  # None: not given (an older supervisor) or not readable


def decode(raw: bytes | None, pttl_ms: int) -> Copy | None:
    """A copy read back (``pttl_ms``: its remaining expiry, from the same reply), or None if
    there is none or it is not one of ours (written by someone else, or too long)."""
    if raw is None or len(raw) > RECORD_LIMIT:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("jobs"), list):
        return None
    ttl = _number(value.get("ttl"))
    age = max(0.0, ttl - pttl_ms / 1000) if pttl_ms >= 0 else 0.0
    slow_after = _number(value.get("slow_job_after"))
    jobs = [job for job in (_read_job(item, age, slow_after) for item in value["jobs"][:SHOWN])
            if job is not None]
    running = value.get("running")
    total = running if isinstance(running, int) and running >= len(jobs) else len(jobs)
    return Copy(total, slow_after, age, jobs, supervisor_figures.decode(value.get("figures")))


def _read_job(item: Any, age: float, slow_after: float) -> Job | None:
    if not isinstance(item, dict) or not isinstance(item.get("pid"), str):
        return None
    elapsed = _number(item.get("elapsed")) + age
    return Job(_whole(item.get("handler")), _whole(item.get("process")), item["pid"],
               _whole(item.get("attempt")), _number(item.get("started")), elapsed,
               bool(slow_after) and elapsed >= slow_after)


def _number(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return max(0.0, float(value)) if ok else 0.0


def _whole(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Publisher:
    """Writes the copy when it is due (see the module's docstring), one write at a time; a
    write that fails is tried again at the next look (the outage is the other loops' to
    tell)."""

    def __init__(self, write: Write, ttl: int, slow_after: float,
                 figures: Callable[[], Figures] | None = None) -> None:
        self._write = write
        self.ttl = ttl
        self.slow_after = slow_after
        self.figures = figures
        self._shown: tuple[Any, ...] | None = None  # what the copy holds (None: no copy)
        self._written_at = -math.inf
        self._task: asyncio.Task[None] | None = None
        self.disabled = False  # the broker refused it: not tried again

    def update(self, jobs: list[Job], now: float) -> None:
        if self.disabled or (self._task is not None and not self._task.done()):
            return
        shown = (len(jobs), *(job.run for job in jobs[:SHOWN]))
        if self.figures is not None:  # kept, and rewritten every FIGURES_EVERY
            if shown == self._shown and now - self._written_at < FIGURES_EVERY:
                return
            record = encode(jobs, self.ttl, self.slow_after, self.figures())
        elif not jobs:
            if self._shown is None:
                return
            record = None
        elif shown == self._shown and now - self._written_at < self.ttl / 3:
            return
        else:
            record = encode(jobs, self.ttl, self.slow_after)
        self._task = asyncio.create_task(self._send(record, shown, now))

    async def _send(self, record: bytes | None, shown: tuple[Any, ...], now: float) -> None:
        try:
            await self._write(record, self.ttl)
        except (BrokerError, OSError) as error:
            log.debug("the running jobs' copy was not written: %s", error)
            return
        except Exception as error:  # refused (an ACL user made before the copy existed)
            log.warning("the running jobs' copy cannot be written (%s): `status` and the "
                        "dashboard will not list this supervisor's jobs; the acl command "
                        "prints the users it needs", describe(error))
            self.disabled = True
            return
        self._shown, self._written_at = (None if record is None else shown), now

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


# -- the arbiter's part ---------------------------------------------------------------------------


class RunningJobs:
    """The table, the warnings, the metrics and the copy, looked at every PERIOD."""

    def __init__(self, config: Config, places: Sequence[HandlerPlace], buffer: Buffer,
                 metrics: Metrics, *, concurrent: bool, write: Write | None = None) -> None:
        self.queue = config.job.queue
        self.places, self.buffer, self.metrics = places, buffer, metrics
        self.concurrent = concurrent
        self.slow = SlowJobs(config.job.slow_job_after)
        ttl = max(1, math.ceil(config.supervisor.lease))  # what the supervisor record has
        metrics.shape(config.job.prefetch, len(places),
                      config.job.tasks_per_process if concurrent else 1)
        self.publisher = (Publisher(write, ttl, config.job.slow_job_after, metrics.figures)
                          if write is not None else None)

    def look(self, now: float | None = None, wall: float | None = None) -> list[Job]:
        """The table now; warns about slow jobs and sets the metrics' figures."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        jobs = table(self.places, self.buffer, concurrent=self.concurrent,
                     slow_after=self.slow.after, now=now, wall=wall)
        self.slow.tell(self.slow.check(jobs), self.queue)
        self.metrics.running(jobs[0].elapsed if jobs else 0.0, sum(job.slow for job in jobs))
        return jobs

    async def watch(self, closed: Callable[[], bool]) -> None:
        """Look every PERIOD until ``closed()``; the copy follows each look."""
        try:
            while not closed():
                jobs = self.look()
                if self.publisher is not None:
                    self.publisher.update(jobs, time.monotonic())
                await asyncio.sleep(PERIOD)
        finally:
            if self.publisher is not None:
                self.publisher.close()
