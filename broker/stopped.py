"""One job that stopped (a failed, dead or poison entry), as the admin reads of either broker
find it (``broker.redis.admin``, ``broker.nats.admin``): what the operator commands and the
dashboard show of it. Nothing here is escaped for a terminal: the callers do that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker import envelope
from broker.failure import Failure


@dataclass(slots=True)
class Job:
    """One failed, dead or poison entry as read: any field may be missing."""

    pid: str  # "" for an undecodable NATS dead letter and for poison
    raw: bytes | None = None  # the envelope (poison: the bytes) as stored; None: not read
    size: int = 0  # bytes of the stored record (0: there is none)
    failure: Failure | None = None
    failure_note: str = ""  # why there is no readable failure record
    seq: int | None = None  # NATS: the dead stream's sequence number
    ttl_ms: int | None = None  # Redis: time left of the job record (-1: none; None: unknown)
    position: int | None = None  # poison: index from the oldest
    deliveries: int | None = None  # NATS: deliveries before it was dead-lettered, if known
    stored_at: float | None = None  # NATS: when the dead letter was stored (unix s)

    @property
    def runs(self) -> int | None:
        """How many times it ran, the failed run included: the failure record's count,
        else JetStream's deliveries, else the envelope's earlier runs (queue 5 counts those
        in ``attempts``) plus the one that failed."""
        if self.failure is not None and self.failure.attempt:
            return self.failure.attempt
        if self.deliveries is not None:
            return self.deliveries
        decoded = self.decoded
        return decoded["attempts"] + 1 if decoded else None

    @property
    def failed_at(self) -> float | None:
        if self.failure is not None and self.failure.at:
            return self.failure.at
        return self.stored_at

    @property
    def attempts(self) -> int | None:
        """The envelope's ``attempts`` (earlier runs, as queue 5 counts them on Redis)."""
        decoded = self.decoded
        return decoded["attempts"] if decoded else None

    @property
    def decoded(self) -> dict[str, Any] | None:
        if self.raw is None:
            return None
        try:
            return envelope.decode(self.raw, None)  # the read was bounded already
        except (envelope.MalformedEnvelope, ValueError):
            return None

    @property
    def note(self) -> str:
        """Why there is no envelope to show, if there is none."""
        if self.size == 0 and self.raw is None:
            return "(no job record: it expired, job_ttl)"
        if self.raw is None:
            return f"({self.size:,} bytes: over the job's envelope limit, not read)"
        if self.decoded is None:
            return "(undecodable)"
        return ""

    def summary(self) -> str:
        if self.failure is not None:
            return self.failure.summary
        return self.failure_note or "(no record)"


def read_failure(data: bytes | int | None) -> tuple[Failure | None, str]:
    """A failure record as read (bytes, its length when too long, or None)."""
    if data is None:
        return None, ""
    if isinstance(data, int):
        return None, f"(failure record of {data:,} bytes: too long, not read)"
    try:
        return Failure.decode(data), ""
    except ValueError as error:
        return None, f"(failure record unreadable: {error})"
