"""The retry policy both adapters follow, so a job gets the same attempts whichever broker
carries it and whoever (a settlement, a recovery) decides.

A failed attempt is retried while the job has attempts left of its budget; the attempt that
uses the last one sends it to failed (Redis) or dead (NATS) instead. ``attempts`` counts earlier
attempts (the envelope's field on Redis, JetStream's delivery count - 1 on NATS). A retry
waits ``backoff * 2**attempts`` seconds, at most ``cap`` (``[job] retry_backoff_max``), or
the consumer's own list of delays when it has one (as queue 5 reads it, NATS only).

Redis waits a jittered delay (``jittered``): *equal jitter*, between half the delay and the
whole of it. Full jitter (anywhere from 0) would let a retry come back at once, which is
what backoff is for not to do (a one-second blip must not spend every attempt); no jitter
would bring the jobs of one failing burst back in the same second, to fail together again.
Half the delay as a floor keeps the backoff, the other half spreads the burst.

A negative ``attempts`` (a producer may write one; PHP runs it) counts as no earlier run,
so the budget still ends the job: stepping up from -2**63 would retry it forever. The
count never steps past 2**63 - 1, which PHP could no longer read as an integer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_INT64_MAX = 2**63 - 1
#: The default cap of a backoff (s): ``[job] retry_backoff_max``.
BACKOFF_MAX = 3600.0
#: Doublings past this change nothing (2**64 times any backoff is past any cap), and
#: 2**attempts of a huge count would never finish.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    budget: int  # attempts a job gets in all (max_attempts, or a NATS consumer's budget)
    backoff: float = 0.0  # base delay (s) before a retry, doubling per attempt
    cap: float = BACKOFF_MAX  # no computed delay is longer (s)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("a job needs a budget of at least 1 run")

    def exhausted(self, attempts: int) -> bool:
        """After a failed attempt of a delivery with ``attempts`` earlier ones: none is left."""
        return max(attempts, 0) + 1 >= self.budget

    @staticmethod
    def next_attempts(attempts: int) -> int:
        """The ``attempts`` a requeued copy carries after one more attempt."""
        return min(max(attempts, 0) + 1, _INT64_MAX)

    def delay(self, attempts: int, listed: Sequence[float] = ()) -> float:
        """Seconds before the retry of a delivery with ``attempts`` earlier attempts (the
        ceiling of ``jittered``)."""
        if listed:  # the last entry repeats
            return listed[min(max(attempts, 0), len(listed) - 1)]
        if not self.backoff:
            return 0.0
        return min(self.cap, self.backoff * 2.0 ** min(max(attempts, 0), _MAX_DOUBLINGS))

    def jittered(self, attempts: int, rand: Callable[[], float] = random.random) -> float:
        """``delay`` with equal jitter: uniform between half of it and all of it."""
        ceiling = self.delay(attempts)
        return ceiling / 2 + rand() * ceiling / 2

    def whole_seconds(self, attempts: int, rand: Callable[[], float] = random.random) -> int:
        """``jittered`` in whole seconds (Redis scores due times in seconds of its clock):
        rounded up, so a backoff is never shortened to 0; 0 only without a backoff."""
        return math.ceil(self.jittered(attempts, rand)) if self.backoff else 0
