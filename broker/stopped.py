"""One job that stopped (a failed, dead or poison entry), as the admin reads of either broker
find it (``broker.redis.admin``, ``broker.nats.admin``): what the operator commands and the
dashboard show of it. Nothing here is escaped for a terminal: the callers do that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
    #: Redis: the failure records of its failed attempts, oldest first (the first failure
    #: and the last few: ``supervisor-failures``); empty when none was read or kept.
    history: list[Failure] = field(default_factory=list)
    reason: str = ""  # poison: why it was poisoned, when the supervisor that did kept it
    reason_at: float | None = None  # poison: when (unix s)

    @property
    def first_published(self) -> float | None:
        """When the job was first published, if known (``first_published``)."""
        return first_published(self.decoded, self.history)

    @property
    def last_published(self) -> float | None:
        """The envelope's timestamp: when it was published or, after a retry, requeued."""
        decoded = self.decoded
        return float(decoded["timestamp"]) if decoded else None

    @property
    def runs(self) -> int | None:
        """Its last attempt's number (attempts made, the failed one included): the failure
        record's, else JetStream's deliveries, else the envelope's earlier attempts (queue 5
        counts those in ``attempts``) plus the one that failed. (The name is older than the
        rule to say "attempt" for one delivery; kept for the JSON key ``runs``.)"""
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
        """The envelope's ``attempts`` (earlier attempts, as queue 5 counts them on Redis)."""
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


def first_published(decoded: dict[str, Any] | None,
                    history: Sequence[Failure]) -> float | None:
    """When a job was first published: its envelope's timestamp while it has no earlier
    attempts, else what our record of its first failed attempt kept (queue 5 keeps it
    nowhere: a retry's envelope carries the retry's time). None: not known."""
    if decoded is not None and not decoded.get("attempts"):
        return float(decoded["timestamp"])
    for failure in history:
        if failure.attempt == 1 and failure.published:
            return failure.published
    return None


def read_history(records: Sequence[bytes] | None) -> list[Failure]:
    """A job's failure history as read (newest first), oldest first; unreadable records
    are left out."""
    history: list[Failure] = []
    for data in reversed(records or ()):
        try:
            history.append(Failure.decode(data))
        except ValueError:
            continue
    return history


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
