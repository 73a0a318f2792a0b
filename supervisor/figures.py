"""A supervisor's running figures, so several on one queue can be told apart (issue 41).

The canary compares supervisors of one queue that differ only in ``prefetch`` (1, 8, 32,
100) or coroutines: is each making progress, at what CPU per job, how full are its broker
calls, how long did its messages wait. Each supervisor puts a small ``figures`` object in
its running jobs' copy (``supervisor.running``): its shape (prefetch; coroutines, its
handler processes; tasks per process) and monotonic totals (jobs done, failed, retried;
messages reserved and reserve calls; messages settled and settle calls; CPU seconds of the
supervisor and its children), with the time they were read on its own monotonic clock,
and the queue wait's p50/p99 over the last minute. A reader (the dashboard) turns two
such readings of the same supervisor into rates (``rates``): only differences of one
supervisor's clock enter them, so hosts' clocks never need to agree.

The object carries a version (``VERSION``): a reader skips one it does not know, and an
older dashboard ignores the key altogether. Every figure read back is bounded.

The queue wait is the claim's time minus the envelope's ``timestamp``, which queue 5
writes in whole seconds: the figures are whole seconds too (0: claimed within the second
it was published), enough to see a supervisor fall behind, not a millisecond's difference.
A claim costs a dict increment per message (``QueueWait``); the rest is done once a
second.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import psutil

#: The figures object's version; a reader skips another.
VERSION = 1
#: Seconds of queue waits the percentiles cover.
WAIT_WINDOW = 60
#: Longest wait counted as itself (s); a longer one counts as this.
WAIT_CAP = 86_400
#: Upper bounds (s) of the queue wait histogram the metrics endpoint serves.
WAIT_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
#: Seconds the list of a supervisor's descendants is kept (``CpuClock``).
CHILDREN_EVERY = 30.0
#: A figure read back above this is not ours (a crafted copy): the object is skipped.
LARGEST = 1e15


class Timestamped(Protocol):
    @property
    def timestamp(self) -> int: ...


class QueueWait:
    """Queue waits in whole seconds: per second of claims over the last WAIT_WINDOW (the
    percentiles), and in all since the start (the metrics' histogram).

    A claim costs one dict increment per message, by its timestamp (a receive's batch
    holds one or two); they become waits once a second (``roll``), off the receive."""

    def __init__(self) -> None:
        self._second = 0  # the second of the claims in _stamps
        self._stamps: dict[int, int] = {}  # this second's claims: timestamp -> messages
        self._seconds: deque[tuple[int, Counter[int]]] = deque()  # earlier: wait -> messages
        self.total: Counter[int] = Counter()  # wait -> messages, rolled, since the start

    def add(self, deliveries: Iterable[Timestamped], now: float | None = None) -> None:
        second = int(time.time() if now is None else now)
        if second != self._second:
            self.roll(second)
        stamps = self._stamps
        for delivery in deliveries:
            stamp = delivery.timestamp
            stamps[stamp] = stamps.get(stamp, 0) + 1

    def roll(self, second: int) -> None:
        """The claims of an earlier second become its waits; those past the window go."""
        if second == self._second:
            return
        if self._stamps:
            waits: Counter[int] = Counter()
            for stamp, n in self._stamps.items():
                waits[min(WAIT_CAP, max(0, self._second - stamp))] += n
            self._seconds.append((self._second, waits))
            self.total.update(waits)
            self._stamps = {}
        self._second = second
        while self._seconds and self._seconds[0][0] <= second - WAIT_WINDOW:
            self._seconds.popleft()

    def percentiles(self, now: float | None = None) -> tuple[int, int] | None:
        """p50 and p99 of the last WAIT_WINDOW seconds' claims (None: none was claimed)."""
        self.roll(int(time.time() if now is None else now))
        counts: Counter[int] = Counter()
        for _, each in self._seconds:
            counts.update(each)
        for stamp, n in self._stamps.items():  # this second's, so far
            counts[min(WAIT_CAP, max(0, self._second - stamp))] += n
        return percentiles(counts)

    def buckets(self) -> tuple[list[tuple[float, int]], int, float]:
        """The histogram since the start, as of the last roll: cumulative (bound, count)
        pairs, count, sum. Read from the metrics' thread: it never rolls."""
        total = dict(self.total)  # one copy: the event loop may roll meanwhile
        cumulative = [(bound, sum(n for wait, n in total.items() if wait <= bound))
                      for bound in WAIT_BUCKETS]
        return cumulative, sum(total.values()), float(sum(w * n for w, n in total.items()))


def percentiles(counts: Mapping[int, int]) -> tuple[int, int] | None:
    """p50 and p99 of a histogram of whole values (value -> count)."""
    total = sum(counts.values())
    if not total:
        return None
    found: list[int] = []
    seen = 0
    ordered = sorted(counts.items())
    for rank in (0.50, 0.99):
        need = max(1, math.ceil(rank * total))
        seen = 0
        for value, n in ordered:
            seen += n
            if seen >= need:
                found.append(value)
                break
    return found[0], found[1]


class CpuClock:
    """CPU seconds (user + system) of this process and all its descendants, those reaped
    included (their parent's ``children_*``). One that exits unreaped takes its seconds with
    it: a total may then go down, and the rate across it is not given.

    Listing the descendants reads every process of the host (``/proc``: milliseconds), so
    the list is kept and read again only when one of them is gone or after
    ``CHILDREN_EVERY`` seconds (a process started meanwhile counts from then on)."""

    def __init__(self, pid: int | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._process = psutil.Process(os.getpid() if pid is None else pid)
        self._clock = clock
        self._children: list[psutil.Process] = []
        self._listed_at = -math.inf

    def seconds(self) -> float:
        total = _cpu(self._process) or 0.0
        children = self._children
        if self._clock() - self._listed_at >= CHILDREN_EVERY:
            children = self._list()
        seconds = [_cpu(child) for child in children]
        if None in seconds:  # one is gone: its parent counts it once it is reaped
            seconds = [_cpu(child) for child in self._list()]
        return total + sum(each or 0.0 for each in seconds)

    def _list(self) -> list[psutil.Process]:
        try:
            self._children = self._process.children(recursive=True)
        except psutil.Error:
            self._children = []
        self._listed_at = self._clock()
        return self._children


def _cpu(process: psutil.Process) -> float | None:
    try:
        times = process.cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(times.user + times.system + times.children_user + times.children_system)


@dataclass(frozen=True, slots=True)
class Figures:
    """One reading of a supervisor's figures (see the module's docstring)."""

    at: float  # the supervisor's monotonic clock (s): only differences mean anything
    prefetch: int
    coroutines: int  # handler processes ([job] coroutines)
    tasks: int  # jobs each runs at once ([job] tasks_per_process; 1: a plain handler)
    done: int
    failed: int
    retried: int
    reserved: int  # messages received
    reserve_calls: int
    settled: int  # messages in settle calls
    settle_calls: int
    cpu: float  # s
    wait_p50: int | None = None  # s, the last WAIT_WINDOW (None: nothing claimed)
    wait_p99: int | None = None

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, **{field.name: getattr(self, field.name) for field in fields(self)}}


_WHOLE = ("prefetch", "coroutines", "tasks", "done", "failed", "retried", "reserved",
          "reserve_calls", "settled", "settle_calls")


def decode(value: Any) -> Figures | None:
    """Figures read back, or None when absent, of another version, or not within bounds."""
    if not isinstance(value, dict) or value.get("v") != VERSION:
        return None
    read: dict[str, Any] = {}
    for name in _WHOLE:
        number = value.get(name)
        if not _is_whole(number):
            return None
        read[name] = number
    for name in ("at", "cpu"):
        real: Any = value.get(name)
        if not _is_number(real):
            return None
        read[name] = float(real)
    for name in ("wait_p50", "wait_p99"):
        number = value.get(name)
        read[name] = number if _is_whole(number) else None
    return Figures(**read)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and 0 <= value <= LARGEST)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and _is_number(value)


@dataclass(frozen=True, slots=True)
class Rates:
    """What happened between two readings of one supervisor."""

    seconds: float
    jobs_per_s: float  # done + failed
    cpu_us_per_job: float | None  # None: no job finished
    per_reserve: float | None  # messages per reserve call (None: no call)
    per_settle: float | None
    retried: int


def rates(earlier: Figures, later: Figures) -> Rates | None:
    """The rates from ``earlier`` to ``later`` (same supervisor), or None when they cannot
    be told: no time passed, or a total went down (a restart with the same id)."""
    seconds = later.at - earlier.at
    if seconds <= 0:
        return None
    delta = {name: getattr(later, name) - getattr(earlier, name)
             for name in ("done", "failed", "retried", "reserved", "reserve_calls", "settled",
                          "settle_calls")}
    if any(value < 0 for value in delta.values()):
        return None
    jobs = delta["done"] + delta["failed"]
    cpu = later.cpu - earlier.cpu
    return Rates(
        seconds, jobs / seconds,
        cpu / jobs * 1e6 if jobs and cpu >= 0 else None,
        delta["reserved"] / delta["reserve_calls"] if delta["reserve_calls"] else None,
        delta["settled"] / delta["settle_calls"] if delta["settle_calls"] else None,
        delta["retried"])


#: Readings of one supervisor kept for its rates; the rates span the oldest within RATE_SPAN.
KEPT = 32
RATE_SPAN = 60.0


class RateBook:
    """The readings of each supervisor a reader saw (by its id), and its rates over up to the
    last RATE_SPAN seconds of its own clock. Supervisors not seen in a reading are dropped."""

    def __init__(self) -> None:
        self._seen: dict[str, deque[Figures]] = {}

    def add(self, readings: Mapping[str, Figures]) -> None:
        for gone in set(self._seen) - set(readings):
            del self._seen[gone]
        for ident, figures in readings.items():
            kept = self._seen.setdefault(ident, deque(maxlen=KEPT))
            if kept and figures.at < kept[-1].at:  # a restart under the same id
                kept.clear()
            if not kept or figures.at > kept[-1].at:
                kept.append(figures)

    def rates(self, ident: str) -> Rates | None:
        kept = self._seen.get(ident)
        if not kept or len(kept) < 2:
            return None
        latest = kept[-1]
        earlier = next((each for each in kept if latest.at - each.at <= RATE_SPAN), kept[0])
        if earlier is latest:
            earlier = kept[-2]
        return rates(earlier, latest)
