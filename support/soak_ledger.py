"""Reading the chaos soak handler's ledger (see ``bench.chaos.handler``) and what it shows.

Per pid: every handler call (time, process, attempts, outcome) and every durable flush
that covered it. From those: duplicate commits (a pid flushed again after a flush that
already counted it: what at-least-once costs an idempotent handler) and re-runs (a call
after a call that had succeeded, i.e. a result that was lost).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Call:
    time: float
    process: int
    attempts: int
    outcome: str  # "." buffered, "x" seeded failure, "v" invalid payload


@dataclass(slots=True)
class Ledger:
    path: Path
    calls: dict[str, list[Call]] = field(default_factory=lambda: defaultdict(list))
    commits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    _offset: int = 0

    def update(self) -> None:
        """Read the complete lines appended since the last call."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as ledger:
            ledger.seek(self._offset)
            data = ledger.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].decode().splitlines():
            words = line.split()
            if words[0] == "I":
                _, when, process, pid, attempts, outcome = words
                self.calls[pid].append(Call(float(when), int(process), int(attempts), outcome))
            elif words[0] == "C":
                when = float(words[1])
                for pid in words[3:]:
                    self.commits[pid].append(when)

    def first_commit(self, pid: str) -> float | None:
        times = self.commits.get(pid)
        return min(times) if times else None

    def duplicate_commits(self) -> list[tuple[float, float, str]]:
        """(previous flush, this flush, pid) of every flush of a pid after its first: the
        settlement of the previous one was lost in between."""
        found = []
        for pid, times in self.commits.items():
            ordered = sorted(times)
            found += [(before, after, pid) for before, after in itertools.pairwise(ordered)]
        return found

    def reruns(self) -> list[tuple[float, float, str]]:
        """(previous call, this call, pid) of every call that followed a successful call
        of the same pid: the earlier result was lost in between."""
        found = []
        for pid, calls in self.calls.items():
            ordered = sorted(calls, key=lambda call: call.time)
            for previous, call in itertools.pairwise(ordered):
                if previous.outcome == ".":
                    found.append((previous.time, call.time, pid))
        return found

    def recoveries(self, fault_times: list[float], published: dict[str, float],
                   slow: set[str], shadow: float = 1.0) -> list[float]:
        """Per fault (times in order): seconds until the last handler call of any message
        published before it.

        Faults are seconds apart and a message normally reaches a handler within
        milliseconds of its publication, so a message published before a fault and called
        after it was in flight when it struck: its last call is when its redelivery reached
        a handler, whether it had been flushed before (a duplicate) or not. Slow messages,
        and calls that waited in a handler process behind one (ending within ``shadow``
        seconds after it), are left out: their lateness is the handler's, not recovery's.
        """
        slow_ends: dict[int, list[float]] = defaultdict(list)
        for pid in slow:
            for call in self.calls.get(pid, []):
                slow_ends[call.process].append(call.time)
        for ends in slow_ends.values():
            ends.sort()
        pairs = []
        for pid, calls in self.calls.items():
            if pid in slow or pid not in published:
                continue
            last = max(calls, key=lambda call: call.time)
            ends = slow_ends.get(last.process, [])
            index = bisect.bisect_left(ends, last.time) - 1
            if index >= 0 and last.time - ends[index] <= shadow:
                continue
            pairs.append((published[pid], last.time))
        pairs.sort()
        times = [when for when, _ in pairs]
        latest, running = 0.0, []
        for _, last in pairs:
            latest = max(latest, last)
            running.append(latest)
        found = []
        for at in fault_times:
            count = bisect.bisect_left(times, at)
            found.append(max(0.0, running[count - 1] - at) if count else 0.0)
        return found

    def last_seen(self, pid: str) -> str:
        """A line for a report: the last call and flush of ``pid`` the ledger knows."""
        calls = sorted(self.calls.get(pid, []), key=lambda call: call.time)
        commits = sorted(self.commits.get(pid, []))
        if not calls and not commits:
            return "never reached a handler"
        parts = [f"{len(calls)} calls"]
        if calls:
            last = calls[-1]
            parts.append(f"last call at {last.time:.3f} in process {last.process}, "
                         f"attempts {last.attempts}, outcome {last.outcome!r}")
        parts.append(f"last flush at {commits[-1]:.3f}" if commits else "never flushed")
        return "; ".join(parts)
