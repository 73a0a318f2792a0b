"""A broker in this process's memory, for tests of the supervisor's core.

It keeps the promises of ``broker.base.Broker`` that the core relies on (ownership checked
at every settlement, at-least-once redelivery of what a consumer gave up, one result per
message) and none of a real broker's transport. It also misbehaves on request, the way a
real broker does under faults: a settlement call that raises, results that come back as
ERROR or UNCERTAIN (applied or not), a receive that fails, a delivery recovered by "another
consumer" behind our back. The adapters' own behaviour is tested against real servers; this
broker only lets the arbiter, the buffer and the settler be tested in one process, fast,
under any order of events (as Dramatiq's stub broker does for its workers).

With ``retry_backoff`` a failed attempt's retry waits as on Redis: out of the ready queue (in
``delayed``, with its due time on ``clock``) until a ``maintain()`` finds it due and moves it
to the producer end, counted in the report's ``promoted``; ``drain_delayed()`` moves all of
it, as the rollback does. A test advances ``clock`` instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker import envelope
from broker.base import (
    Action,
    BrokerError,
    Delivery,
    MaintenanceReport,
    Outcome,
    Poisoned,
    Received,
    Result,
    ResultCallback,
    Settlement,
    check_receive_limit,
)
from broker.retry import BACKOFF_MAX, RetryPolicy


@dataclass(slots=True)
class Faults:
    """Misbehaviour still to come, counted down as it is used."""

    receive_errors: int = 0  # receive calls that raise BrokerError
    settle_errors: int = 0  # settle calls that raise BrokerError (nothing applied)
    unapplied: int = 0  # messages answered ERROR (not applied)
    uncertain_applied: int = 0  # messages applied, answered UNCERTAIN (a lost reply)
    uncertain_unapplied: int = 0  # messages not applied, answered UNCERTAIN


@dataclass(slots=True)
class _Message:
    pid: str
    raw: bytes
    attempts: int = 0
    owner: int | None = None  # the token of the delivery that owns it now


@dataclass
class MemoryBroker:
    """One queue; ``max_attempts`` runs per message before it is dead."""

    queue: str = "jobs"
    max_attempts: int = 3
    replay_uncertain: bool = True
    settle_concurrency: int = 1
    #: Tell each result as it is made (``on_result``), as JetStream does; False: only all
    #: at once in the returned list, as Redis does.
    early_results: bool = True
    #: Never reserves ahead (``reserve_ahead`` declines); True makes the supervisor receive
    #: in the batches it takes from a broker that does (``supervisor.arbiter.batch_limit``).
    reserves_ahead: bool = False
    faults: Faults = field(default_factory=Faults)
    ready: deque[_Message] = field(default_factory=deque)
    owned: dict[str, _Message] = field(default_factory=dict)  # pid -> message
    committed: Counter[str] = field(default_factory=Counter)  # pid -> commits applied
    dead: list[str] = field(default_factory=list)
    #: Retries waiting for their backoff: (due on ``clock``, message), in the order parked.
    delayed: list[tuple[float, _Message]] = field(default_factory=list)
    retry_backoff: float = 0.0  # as [job] retry_backoff: 0 = retried at once
    retry_backoff_max: float = BACKOFF_MAX
    clock: Callable[[], float] = time.monotonic
    poisoned: list[bytes] = field(default_factory=list)  # malformed, never handed out
    runs: Counter[str] = field(default_factory=Counter)  # pid -> deliveries handed out
    calls: Counter[str] = field(default_factory=Counter)
    stopped_waiting: bool = False

    def __post_init__(self) -> None:
        self.retry = RetryPolicy(self.max_attempts, self.retry_backoff, self.retry_backoff_max)
        self._tokens = itertools.count(1)
        self._arrived = asyncio.Event()

    # -- publishing ----------------------------------------------------------------------

    async def publish(self, queue: str, payload: dict[str, Any]) -> str:
        return (await self.publish_many(queue, [payload]))[0]

    async def publish_many(self, queue: str, payloads: Sequence[dict[str, Any]]) -> list[str]:
        pids = []
        for payload in payloads:
            pid, raw = envelope.build(queue, payload)
            self.ready.append(_Message(pid, raw))
            pids.append(pid)
        self._arrived.set()
        return pids

    # -- consuming -------------------------------------------------------------------------

    async def connect(self) -> None:
        self.calls["connect"] += 1

    async def close(self) -> None:
        self.calls["close"] += 1

    async def receive(self, max_messages: int, block_timeout: float) -> Received:
        check_receive_limit(max_messages)
        self.calls["receive"] += 1
        if self.faults.receive_errors:
            self.faults.receive_errors -= 1
            raise BrokerError("receive failed (injected)")
        await self._wait_for_work(block_timeout)
        received = Received()
        while self.ready and len(received.deliveries) < max_messages:
            message = self.ready.popleft()
            try:
                fields, plain = envelope.decode_flagged(message.raw)
            except envelope.MalformedEnvelope as error:
                # Never handed out, and kept (a real broker keeps poison in a list/stream).
                self.poisoned.append(message.raw)
                received.poisoned.append(Poisoned(message.raw, str(error)))
                continue
            if not message.pid:  # stored raw: what the envelope says
                message.pid, message.attempts = fields["pid"], fields["attempts"]
            message.owner = next(self._tokens)
            self.owned[message.pid] = message
            self.runs[message.pid] += 1
            received.deliveries.append(Delivery(
                message.pid, self.queue, fields["timestamp"], message.attempts,
                fields["payload"], message.raw, message.owner, fields, plain=plain,
            ))
        return received

    async def _wait_for_work(self, block_timeout: float) -> None:
        """Until something is ready, the timeout passed, or this consumer is stopping. The
        wake-up is shared by every consumer of the queue, so a wake finding nothing ready
        (another consumer took it, or stopped) waits on."""
        deadline = time.monotonic() + block_timeout
        while not self.ready and not self.stopped_waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    async def settle(
        self, settlements: Sequence[Settlement], on_result: ResultCallback | None = None
    ) -> list[Result]:
        self.calls["settle"] += 1
        await asyncio.sleep(0)  # a real call yields: completions may gather meanwhile
        if self.faults.settle_errors:
            self.faults.settle_errors -= 1
            raise BrokerError("settle failed (injected)")
        results = []
        for index, settlement in enumerate(settlements):
            result = self._settle_one(settlement)
            results.append(result)
            if on_result is not None and self.early_results:
                on_result(index, result)
        return results

    def _settle_one(self, settlement: Settlement) -> Result:
        faults = self.faults
        if faults.unapplied:
            faults.unapplied -= 1
            return Result(Outcome.ERROR, "not applied (injected)")
        if faults.uncertain_unapplied:
            faults.uncertain_unapplied -= 1
            return Result(Outcome.UNCERTAIN, "reply lost, not applied (injected)")
        delivery = settlement.delivery
        message = self.owned.get(delivery.pid)
        if message is None or message.owner != delivery.receipt:
            return Result(Outcome.STALE, "not owned")
        del self.owned[delivery.pid]
        message.owner = None
        detail = None
        if settlement.action is Action.COMMIT:
            self.committed[message.pid] += 1
        elif settlement.action is Action.RELEASE:
            self.ready.appendleft(message)
        elif self.retry.exhausted(message.attempts):
            self.dead.append(message.pid)
        else:
            delay = self.retry.whole_seconds(message.attempts)
            message.attempts = RetryPolicy.next_attempts(message.attempts)
            if delay:
                self.delayed.append((self.clock() + delay, message))
                detail = f"retrying in {delay} s"
            else:
                self.ready.append(message)
        if faults.uncertain_applied:
            faults.uncertain_applied -= 1
            return Result(Outcome.UNCERTAIN, "reply lost, applied (injected)")
        return Result(Outcome.OK, detail)

    def reserve_ahead(self, room: int) -> bool:
        """Declined: a settle call here reserves nothing (see ``reserves_ahead``)."""
        return False

    async def extend(self, deliveries: Sequence[Delivery]) -> list[bool]:
        self.calls["extend"] += 1
        return [self._owns(delivery) for delivery in deliveries]

    def stop_waiting(self) -> None:
        self.stopped_waiting = True
        self._arrived.set()

    async def oldest_ready_age(self) -> float | None:
        if not self.ready:
            return None
        try:
            published: int = envelope.decode(self.ready[0].raw)["timestamp"]
            return max(0.0, time.time() - published)
        except envelope.MalformedEnvelope:
            return None  # as Redis: a malformed head has no age to read

    async def maintain(self) -> MaintenanceReport:
        """Moves the retries whose backoff is over to the ready queue (nothing else to
        recover: another consumer's recovery is ``recover()``)."""
        self.calls["maintain"] += 1
        now = self.clock()
        return MaintenanceReport(promoted=self._promote(lambda due: due <= now))

    def drain_delayed(self) -> int:
        """Every waiting retry to the ready queue, due or not (the rollback's step)."""
        return self._promote(lambda due: True)

    def _promote(self, moves: Callable[[float], bool]) -> int:
        """The chosen retries to the producer end, the earliest due first."""
        chosen = sorted((entry for entry in self.delayed if moves(entry[0])),
                        key=lambda entry: entry[0])
        if not chosen:
            return 0
        self.delayed[:] = [entry for entry in self.delayed if not moves(entry[0])]
        self.ready.extend(message for _, message in chosen)
        self._arrived.set()
        return len(chosen)

    async def abandon(self, deliveries: Sequence[Delivery] = ()) -> None:
        """Our deliveries are recovered at once (queue 5's recovery counts an attempt)."""
        self.calls["abandon"] += 1
        for delivery in deliveries:
            if self._owns(delivery):
                self.recover(delivery.pid)

    # -- what other consumers and the tests do -------------------------------------------

    def sharing_queue(self, **options: Any) -> MemoryBroker:
        """Another consumer of this broker's queue (its own options, e.g. ``max_attempts``)."""
        other = MemoryBroker(self.queue, ready=self.ready, owned=self.owned,
                             committed=self.committed, dead=self.dead, runs=self.runs,
                             poisoned=self.poisoned, delayed=self.delayed,
                             **{"clock": self.clock, **options})
        other._tokens, other._arrived = self._tokens, self._arrived
        return other

    def push_raw(self, raw: bytes) -> None:
        """Store bytes as a producer that does not check them would."""
        self.ready.append(_Message("", raw))
        self._arrived.set()

    def recover(self, pid: str) -> bool:
        """Another consumer's recovery took this delivery back (its lease lapsed)."""
        message = self.owned.pop(pid, None)
        if message is None:
            return False
        message.owner = None
        message.attempts += 1
        self.ready.append(message)
        self._arrived.set()
        return True

    def _owns(self, delivery: Delivery) -> bool:
        message = self.owned.get(delivery.pid)
        return message is not None and message.owner == delivery.receipt

    @property
    def settled(self) -> set[str]:
        """Every pid that is finished for good: committed or dead."""
        return set(self.committed) | set(self.dead)
