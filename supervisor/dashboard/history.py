"""What the sampler saw of each queue over the last hour, kept in memory only.

A sample is taken every ``interval`` seconds (5 by default: 720 an hour per queue, a few
hundred kilobytes for 20 queues). Rates are differences of the cumulative ``done`` counter
between samples; a counter that went down (reset, or another Redis) gives no rate.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from supervisor.dashboard.sources import Counts

#: Seconds of history kept and plotted.
WINDOW = 3600
#: A queue with ready messages that settled none for this long is "not draining".
STALLED_AFTER = 60


@dataclass(slots=True)
class Sample:
    at: float  # unix seconds
    counts: Counts
    rate: float | None  # jobs/s since the previous sample


class History:
    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self.samples: deque[Sample] = deque()
        self.error: str = ""  # the last sample's failure, shown until one succeeds
        self.error_at: float = 0.0  # when the last sample failed
        self.failing_since: float = 0.0  # when the first of the failures in a row did

    def add(self, counts: Counts, at: float | None = None) -> Sample:
        at = time.time() if at is None else at
        rate = None
        if self.samples:
            last = self.samples[-1]
            elapsed = at - last.at
            if elapsed > 0 and counts.done >= last.counts.done:
                rate = (counts.done - last.counts.done) / elapsed
        sample = Sample(at, counts, rate)
        if self.samples:  # only the newest sample's supervisor ids are read (queue page)
            self.samples[-1].counts.consumers = None
        self.samples.append(sample)
        while self.samples and self.samples[0].at < at - self.window:
            self.samples.popleft()
        self.error = ""
        return sample

    def failed(self, error: str, at: float | None = None) -> None:
        at = time.time() if at is None else at
        if not self.error:
            self.failing_since = at
        self.error = error
        self.error_at = at

    @property
    def stale(self) -> bool:
        """True while the broker does not answer: the figures shown (counts, rates,
        charts) are those of the last good sample, ``last.at``."""
        return bool(self.error) and bool(self.samples)

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def rate(self, seconds: float = 60) -> float | None:
        """Jobs/s over about the last ``seconds`` (None until two samples exist)."""
        if len(self.samples) < 2:
            return None
        last = self.samples[-1]
        first = next((s for s in self.samples if s.at >= last.at - seconds), self.samples[0])
        if first is last:
            first = self.samples[-2]
        done = last.counts.done - first.counts.done
        return done / (last.at - first.at) if last.at > first.at and done >= 0 else None

    def draining(self) -> str:
        """"" when all is well, else why the queue is not draining (shown as a warning)."""
        last = self.last
        if last is None or not last.counts.ready:
            return ""
        # the newest sample at least STALLED_AFTER old: none yet, not watched long enough
        older = next((s for s in reversed(self.samples) if s.at <= last.at - STALLED_AFTER),
                     None)
        if older is not None and last.counts.done == older.counts.done:
            return (f"not draining: {last.counts.ready:,} ready, none settled in the last "
                    f"{STALLED_AFTER} s")
        return ""

    def unattended(self, overdue_after: float) -> str:
        """"" when all is well, else why delayed retries wait unseen (Redis; issue 39.3):
        only supervisors move them to the ready list (PHP workers never read the set), so
        with none alive, or past ``overdue_after`` seconds overdue, nobody does."""
        last = self.last
        if last is None or not last.counts.delayed:
            return ""
        counts, late = last.counts, last.counts.delayed_overdue or 0.0
        overdue = f", the oldest due {late:.0f} s ago" if late else ""
        if counts.supervisors == 0:
            return (f"{counts.delayed:,} delayed retries wait{overdue} and no supervisor is "
                    f"alive to move them to the ready list")
        if late > overdue_after:
            return (f"{counts.delayed:,} delayed retries wait{overdue}: no supervisor's "
                    f"maintenance moves them to the ready list")
        return ""

    def series(self, name: str) -> list[tuple[float, float]]:
        """(unix s, value) of "ready" (backlog) or "rate" (jobs/s)."""
        if name == "rate":
            return [(s.at, s.rate) for s in self.samples if s.rate is not None]
        return [(s.at, float(getattr(s.counts, name) or 0)) for s in self.samples]
