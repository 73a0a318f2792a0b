"""What a broker holds for one queue, sampled now and then for the metrics endpoint.

One ``QueueGauges`` per sample: sizes the operators alert on (ready, failed, dead ...) and
the broker's own running counts (reconnects, unconfirmed replica writes). ``None`` means
"not known here": the broker has no such thing (no failed list on NATS), or this one
reading failed (a command the ACL refuses); such a gauge is left out of the scrape rather
than shown as 0. This module imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueGauges:
    ready: int | None = None  # waiting to be received
    oldest_ready_age: float | None = None  # seconds the next one waited (0: none waiting)
    processing: int | None = None  # received by some consumer, not settled
    failed: int | None = None  # out of attempts (Redis: the failed list)
    dead: int | None = None  # lost on the last attempt (Redis) / dead letters (NATS)
    poison: int | None = None  # undecodable (Redis)
    delayed: int | None = None  # retries waiting for their backoff (Redis)
    delayed_overdue: float | None = None  # seconds the oldest of them is past due (0: none)
    redelivered: int | None = None  # delivered more than once, not acked yet (NATS)
    supervisors_alive: int | None = None  # whose registry entry is current (Redis)
    reconnects: int | None = None  # connections replaced since start (a running count)
    unreplicated: int | None = None  # writes no replica confirmed in time (a running count)
    leader: bool | None = None  # the JetStream API answered for the queue (NATS)
    leaderless_seconds: float | None = None  # since it last did (filled in by the supervisor)
