"""The retry policy both adapters follow, so a job gets the same runs whichever broker
carries it and whoever (a settlement, a recovery) decides.

A failed run is retried while the job has runs left of its budget; the run that uses the
last one sends it to failed (Redis) or dead (NATS) instead. ``attempts`` counts earlier
runs (the envelope's field on Redis, JetStream's delivery count - 1 on NATS). A retry
waits ``backoff * 2**attempts`` seconds where the broker can delay a redelivery (NATS),
or the consumer's own list of delays when it has one (as queue 5 reads it).

A negative ``attempts`` (a producer may write one; PHP runs it) counts as no earlier run,
so the budget still ends the job: stepping up from -2**63 would retry it forever. The
count never steps past 2**63 - 1, which PHP could no longer read as an integer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    budget: int  # runs a job gets in all (max_attempts, or a NATS consumer's budget)
    backoff: float = 0.0  # base delay (s) before a retry, doubling per run

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("a job needs a budget of at least 1 run")

    def exhausted(self, attempts: int) -> bool:
        """After a failed run of a delivery with ``attempts`` earlier runs: none is left."""
        return max(attempts, 0) + 1 >= self.budget

    @staticmethod
    def next_attempts(attempts: int) -> int:
        """The ``attempts`` a requeued copy carries after one more run."""
        return min(max(attempts, 0) + 1, _INT64_MAX)

    def delay(self, attempts: int, listed: Sequence[float] = ()) -> float:
        """Seconds before the retry of a delivery with ``attempts`` earlier runs."""
        if listed:  # the last entry repeats
            return listed[min(attempts, len(listed) - 1)]
        return self.backoff * 2**attempts
