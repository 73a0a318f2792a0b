"""The broker interface the supervisor is written against.

Every broker (Redis lists, NATS JetStream) offers the same few operations, and every
operation that touches several messages reports one outcome per message: one stale or
missing delivery never hides the result of another.

Data path: ``receive`` -> handler -> ``settle`` (commit / reject / release), with
``extend`` renewing everything outstanding and ``maintain`` recovering abandoned work.

What only some brokers offer is declared below ``Broker`` as small protocols, each one a
feature the supervisor uses when it is there (``isinstance``): reserving ahead and a record
of running jobs (Redis), arrivals pushed and a connection watched (NATS), a lease and a
consumer name of their own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from broker.failure import Failure

#: No broker operation moves or settles more than this many messages in one call.
MAX_BATCH = 1000


def check_receive_limit(max_messages: int) -> None:
    """Both adapters refuse the same out-of-range receive (the caller's bug, not the broker's)."""
    if not 0 < max_messages <= MAX_BATCH:
        raise ValueError(f"max_messages must be between 1 and {MAX_BATCH}, not {max_messages}")


class BrokerError(Exception):
    """A broker operation failed; the message says which and why."""


class BrokerRefused(BrokerError):
    """The broker answered and refused this client: wrong or missing credentials, no
    permission, or a setting of the URL it cannot serve (a database number it lacks).
    Trying again with the same configuration cannot help."""


class WrongTypeError(BrokerError):
    """A queue key holds the wrong Redis type or a counter is not an integer.

    Raised before any write: the script that detected it changed nothing.
    """


class Outcome(enum.StrEnum):
    """What happened to one message of a grouped operation."""

    OK = "ok"  # applied
    STALE = "stale"  # this consumer no longer owns the delivery: nothing changed
    MISSING = "missing"  # the payload is gone: release refused, ownership kept
    UNCERTAIN = "uncertain"  # sent, but the reply was lost: may or may not be applied
    ERROR = "error"  # not applied (see Result.detail); the delivery is still outstanding


class Action(enum.StrEnum):
    """How a delivery is settled."""

    COMMIT = "commit"  # handled: remove it for good
    REJECT = "reject"  # failed: retry with attempts + 1, or failed/dead at max attempts
    RELEASE = "release"  # never started: back to the ready list, attempts unchanged


@dataclass(slots=True, eq=False)
class Delivery:
    """One claimed message, owned by this consumer until it is settled.

    ``raw`` is the envelope exactly as the broker holds it; ``receipt`` is the
    broker's proof of ownership (the Redis owner token, the NATS reply subject).
    """

    pid: str
    queue: str
    timestamp: int
    attempts: int
    payload: dict[str, Any] | list[Any]  # a list when the JSON payload is a non-empty array
    raw: bytes
    receipt: Any
    envelope: dict[str, Any] = field(repr=False, default_factory=dict)
    #: The broker's own per-delivery keys, built once at the claim and reused by every
    #: settlement and renewal of it (Redis: its claims, jobs and owners key); () if none.
    keys: tuple[str, ...] = field(repr=False, default=())
    #: ``raw`` is plain (``envelope.decode_flagged``): its handler process may read it with
    #: orjson alone. False (decode it fully) is always right.
    plain: bool = field(repr=False, default=False)


@dataclass(slots=True)
class Settlement:
    """One requested settlement: what to do with which delivery (and why, for a reject).

    Not changed once made, but not frozen: one is built per delivery settled, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) costs four times as much.
    """

    action: Action
    delivery: Delivery
    error: str | None = None
    failure: Failure | None = None  # the structured error of a failed attempt, when known


@dataclass(slots=True, frozen=True)
class Result:
    """The outcome of one message in a grouped operation."""

    outcome: Outcome
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


#: The result of an applied settlement that has nothing more to say (a commit, a release):
#: one shared object, so that a batch of them is checked by identity (``list.count``).
APPLIED = Result(Outcome.OK)


@dataclass(slots=True)
class Poisoned:
    """A message that is never handed to a handler (kept in poison/dead): malformed, or
    (``malformed=False``) out of attempts before it could run again (JetStream)."""

    raw: bytes
    reason: str
    malformed: bool = True


@dataclass(slots=True)
class Received:
    """What one ``receive`` call produced: deliveries to handle, and what went to poison."""

    deliveries: list[Delivery] = field(default_factory=list)
    poisoned: list[Poisoned] = field(default_factory=list)
    deferred: int = 0  # copies of pids already being processed, put back to wait (Redis)


@dataclass(slots=True)
class MaintenanceReport:
    """What one maintenance pass recovered, by kind (counts of messages)."""

    expired_reservations: int = 0  # payloads returned from reservations past their deadline
    dead_consumers: int = 0  # deliveries whose claim (lease) lapsed: requeued or dead
    legacy: int = 0  # owner-less processing entries past the publish-age threshold
    skipped: bool = False  # another supervisor holds the maintenance lock
    promoted: int = 0  # delayed retries whose backoff was over, moved to ready (not in total)

    @property
    def total(self) -> int:
        return self.expired_reservations + self.dead_consumers + self.legacy


ResultCallback = Callable[[int, "Result"], None]


class Publisher(Protocol):
    """Putting messages on a queue (producers, the operator ``publish`` command)."""

    async def publish(self, queue: str, payload: dict[str, Any]) -> str:
        """Publish one message; returns its pid once the broker has it."""

    async def publish_many(self, queue: str, payloads: Sequence[dict[str, Any]]) -> list[str]:
        """Publish several messages; returns their pids once the broker has them all."""


class Broker(Publisher, Protocol):
    """What the supervisor needs from a broker: consuming one queue (receive, settle,
    renew, recover), and publishing beside it. One instance serves one queue."""

    queue: str

    #: True when repeating a settlement whose reply was lost is safe and needed: the Redis
    #: scripts check ownership (a repeat that finds the work done answers "stale"), and an
    #: unapplied settlement would otherwise stay owned by a live consumer. False for JetStream,
    #: which decides by itself: the ack took effect, or the message is redelivered after
    #: AckWait once we stop renewing it. In-flight operations are then never replayed.
    replay_uncertain: bool

    #: How many settlement calls the supervisor may have in flight at once. Redis: 1 (a
    #: call is one quick script; letting completions gather while it runs makes the next
    #: group bigger). JetStream: several (a call is many independent acks; one whose reply
    #: is lost must not hold back the completions that come after it).
    settle_concurrency: int

    @property
    def max_attempts(self) -> int:
        """Runs a message gets before it is dead (NATS: the adopted consumer's budget)."""

    async def connect(self) -> None:
        """Open connections and prepare the queue (scripts, streams). Raises BrokerError."""

    async def close(self) -> None:
        """Close connections. Outstanding deliveries stay owned until recovered."""

    async def receive(self, max_messages: int, block_timeout: float) -> Received:
        """Claim up to ``max_messages`` (<= MAX_BATCH) deliveries.

        Returns what is available at once; only when nothing is, blocks up to
        ``block_timeout`` seconds for the first message. Never waits to fill a batch.
        """

    async def settle(
        self, settlements: Sequence[Settlement], on_result: ResultCallback | None = None
    ) -> list[Result]:
        """Apply commits, rejects and releases (any mix, any number: MAX_BATCH per broker
        call), one result each.

        ``on_result(index, result)``, when given, is called for each message as soon as its
        own result is known (before the call returns), so a slow reply delays nobody else.
        """

    async def extend(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Renew this consumer's lease; report per delivery whether it is still owned."""

    def stop_waiting(self) -> None:
        """A stop began: a receive blocked on an idle queue returns now, and none blocks
        again. Never loses what a blocking wait had taken."""

    async def oldest_ready_age(self) -> float | None:
        """Seconds the next message waiting to be received has waited (None: none)."""

    async def maintain(self) -> MaintenanceReport:
        """Recover work that dead consumers left behind (bounded work per call)."""

    async def abandon(self, deliveries: Sequence[Delivery] = ()) -> None:
        """Declare this consumer gone (at every exit) so ``deliveries``, still owned (their
        handlers were killed), come back now instead of after the lease: Redis requeues them
        as recovery would (attempts + 1), so that nothing this consumer owns outlives it;
        NATS redelivers them. Commits and rejects nothing."""



# -- features of some brokers: the supervisor finds them with isinstance ---------------------
# (runtime_checkable checks only that the members exist: mypy checks their types, and
# supervisor.brokers that each adapter offers what it claims.)


@runtime_checkable
class Leased(Protocol):
    """A broker whose deliveries stay ours for a time of its own (Redis: the lease it was
    given; NATS: the adopted consumer's ack wait, which may be shorter than ours)."""

    @property
    def lease(self) -> float:
        """Seconds an unrenewed delivery stays ours."""


@runtime_checkable
class Identified(Protocol):
    """A broker that is a named consumer (Redis): the name goes in failure records."""

    @property
    def consumer_id(self) -> str:
        """This consumer's name ("" is none: the supervisor then uses ``<host>-<pid>``)."""


@runtime_checkable
class ReservesAhead(Protocol):
    """A broker whose settle call can reserve, in its own write, the room it frees (Redis):
    the receive after it then claims at once."""

    @property
    def reserves_ahead(self) -> bool:
        """Its settle calls can reserve ahead now (the supervisor then receives in smaller
        batches: see ``supervisor.arbiter.batch_limit``)."""

    def reserve_ahead(self, room: int) -> bool:
        """Reserve ``room`` in the next settle call's write. False: not done."""


@runtime_checkable
class WatchesConnection(Protocol):
    """A broker with a connection of its own that tells when it breaks and is back (NATS)."""

    def watch_connection(self, lost: Callable[[str], None], back: Callable[[], None]) -> None:
        """``lost(reason)`` when the connection breaks, ``back()`` once a new one is ready."""


@runtime_checkable
class PushesArrivals(Protocol):
    """A broker that is pushed what it pulled (NATS): it tells when messages arrived, and
    hands them out without a wait."""

    def on_arrival(self, callback: Callable[[], None]) -> None:
        """``callback()`` when messages arrived that ``receive_nowait`` may take."""

    def receive_nowait(self, max_messages: int) -> Received | None:
        """What ``receive(max_messages, ...)`` would return, when it needs nothing awaited;
        None otherwise (``receive`` does it)."""


@runtime_checkable
class RecordsRunning(Protocol):
    """A broker that keeps this supervisor's record of running jobs (Redis: for
    ``status``)."""

    async def publish_running(self, record: bytes | None, ttl: int) -> None:
        """Write the record (None: remove it), kept ``ttl`` seconds."""


@runtime_checkable
class EnvelopeLimited(Protocol):
    """A broker with a limit on the envelopes it reads (Redis: records moved back too)."""

    @property
    def max_envelope_bytes(self) -> int | None:
        """The longest envelope read (None or 0: no limit of its own)."""
