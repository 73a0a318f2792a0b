"""Settlement: turn completed deliveries into grouped broker calls and act on each result.

Completions that are already waiting are settled together (at most ``MAX_BATCH`` per call)
the moment the previous call returns: there is no timer and no waiting for a full batch.
Each delivery keeps its own result. A failed or uncertain settlement never turns a handler's
success into a failure: the delivery stays outstanding and is settled again later (or
recovered by the broker if this process dies first). A broker that cannot be reached is
told by ``supervisor.outage`` once, not once per delivery and try; what else stays unconfirmed
is one line per call.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.base import (
    APPLIED,
    Action,
    Broker,
    Identified,
    Outcome,
    Result,
    ResultCallback,
    Settlement,
)
from broker.errors import describe
from supervisor import failures
from supervisor.buffer import Buffer, Entry
from supervisor.metrics import Metrics
from supervisor.outage import Outage, unreachable

log = logging.getLogger("supervisor.settlement")

#: Outcomes that leave a delivery's settlement unconfirmed.
UNCONFIRMED = (Outcome.UNCERTAIN, Outcome.ERROR)
#: Pids named in a line about several deliveries.
NAMED = 5
_COMMIT = Action.COMMIT


def settlement_for(entry: Entry, consumer: str = "") -> Settlement:
    if entry.release:
        return Settlement(Action.RELEASE, entry.delivery)
    if entry.error is None:
        return Settlement(Action.COMMIT, entry.delivery)
    failure = entry.failure
    if failure is not None:  # which run failed, when, and who ran it: the broker keeps it
        failure = failure.replace(attempt=entry.delivery.attempts + 1, at=time.time(),
                                  consumer=failure.consumer or consumer)
    return Settlement(Action.REJECT, entry.delivery, entry.error, failure=failure)


Unsettled = list[tuple[Entry, Settlement, Result]]


@dataclass(slots=True)
class Left:
    """What one settlement call left unconfirmed, told in one line each after it."""

    again: Unsettled = field(default_factory=list)  # outstanding, settled again later
    unreplayed: Unsettled = field(default_factory=list)  # uncertain, left to the broker


class Settler:
    """Settles a batch and reports, per entry, whether its commit was confirmed."""

    def __init__(
        self,
        broker: Broker,
        buffer: Buffer,
        confirm: Callable[[Entry, bool], None] | None,
        metrics: Metrics | None = None,
        progress: Callable[[], None] = lambda: None,
        outage: Outage | None = None,
    ) -> None:
        self.broker = broker
        self.buffer = buffer
        # Tells the handler process (for on_success); None: no handler listens.
        self.confirm = confirm or _nobody
        self.confirming = confirm is not None
        self.metrics = metrics or Metrics()
        self.progress = progress  # room opened before the call returned (early results)
        # Who ran a failed job, in its failure record: the Redis consumer id, or (NATS has
        # none of ours) "<host>-<pid>" of this supervisor.
        self.consumer = (broker.consumer_id if isinstance(broker, Identified) else "") or (
            f"{socket.gethostname()}-{os.getpid()}")
        self.outage = outage or Outage("the broker", lambda: buffer.outstanding,
                                       retry_every=2.0, lease=0.0)

    async def settle(self, batch: list[Entry]) -> bool:
        """Settle ``batch``; returns False when some entries must be tried again later."""
        consumer = self.consumer
        # The usual one (a success) built here: a call per delivery costs more than it does.
        settlements = [
            Settlement(_COMMIT, entry.delivery) if entry.error is None and not entry.release
            else settlement_for(entry, consumer) for entry in batch
        ]
        applied = [False] * len(batch)
        retry: list[Entry] = []
        # Several calls may run at once (JetStream): what each leaves is its own.
        left = Left()
        began, since = time.perf_counter(), self.outage.now()

        def apply(index: int, result: Result) -> None:
            applied[index] = True
            if result.outcome not in UNCONFIRMED:
                self.outage.back(since)  # it answered: told before anything is forgotten
            if not self._apply(batch[index], settlements[index], result, left):
                retry.append(batch[index])

        def apply_early(index: int, result: Result) -> None:
            apply(index, result)
            self.progress()

        def apply_many(indices: list[int], result: Result) -> None:
            """Several early results at once (NATS: the acks one read confirmed): the usual
            case (all applied, no reject) forgotten, confirmed, counted and told together."""
            actions = [settlements[index].action for index in indices]
            if result.outcome is Outcome.OK and Action.REJECT not in actions:
                for index in indices:
                    applied[index] = True
                self._applied_all([batch[index] for index in indices], actions, since)
            else:
                for index in indices:
                    apply(index, result)
            self.progress()

        told = False  # the call raised, and that was told
        try:
            results = await self.broker.settle(settlements, Early(apply_early, apply_many))
        except Exception as error:  # the broker is down or refused: keep everything outstanding
            if unreachable(error):
                self.outage.lost(error, since)
            else:
                log.error("settlement of %d deliveries failed: %s", len(batch), describe(error))
            told = True
            results = [Result(Outcome.ERROR, describe(error))] * len(batch)
        self.metrics.settle_batch(len(batch), time.perf_counter() - began)
        if any(applied):
            for index, result in enumerate(results):
                if not applied[index]:
                    apply(index, result)
        else:  # every result at once (Redis): counted and told per batch, not per entry
            retry += self._apply_all(batch, settlements, results, since, left)
        self._tell(results, since, left, told)
        if retry:
            self.buffer.retry_later(retry)
        return not retry

    def _tell(self, results: list[Result], since: float, left: Left, told: bool) -> None:
        """What this call says about the broker, and one line for what stays unsettled."""
        if not told:
            if left.again and all(result.outcome in UNCONFIRMED for result in results):
                self.outage.lost(left.again[0][2].detail or "no reply", since)
            if left.again and not self.outage.down:
                log.warning("%d of %d settlements not confirmed (%s); will settle again",
                            len(left.again), len(results), _named(left.again))
        if left.unreplayed:
            log.warning("%d settlements uncertain (%s): not replayed; the broker either "
                        "applied them or will deliver those messages again",
                        len(left.unreplayed), _named(left.unreplayed))

    def _apply_all(self, batch: list[Entry], settlements: list[Settlement],
                   results: list[Result], since: float, left: Left) -> list[Entry]:
        """``_apply`` for a whole batch whose results came together; the entries to try
        again. An applied commit or release (the common case) is forgotten and confirmed
        here, counted once per action after the loop."""
        actions = [settlement.action for settlement in settlements]
        if Action.REJECT not in actions and results.count(APPLIED) == len(batch):
            self._applied_all(batch, actions, since)  # the usual call: nothing went wrong
            return []
        retry: list[Entry] = []
        confirmed = {Action.COMMIT: 0, Action.RELEASE: 0}
        forget, confirm, ok, reject = self.buffer.forget, self.confirm, Outcome.OK, Action.REJECT
        told_back = False  # the broker answered: told once, before anything is forgotten
        for entry, settlement, result in zip(batch, settlements, results, strict=True):
            if not told_back and result.outcome not in UNCONFIRMED:
                self.outage.back(since)
                told_back = True
            action = settlement.action
            if result.outcome is ok and action is not reject:
                forget(entry)
                confirm(entry, action is Action.COMMIT)
                confirmed[action] += 1
            elif not self._apply(entry, settlement, result, left):
                retry.append(entry)
        for action, count in confirmed.items():
            if count:
                self.metrics.settled(action, count)
        return retry

    def _applied_all(self, batch: list[Entry], actions: list[Action], since: float) -> None:
        """Every commit or release of ``batch`` applied (``_apply_all``'s usual case, taken
        per batch rather than per entry): forgotten, confirmed, counted."""
        self.outage.back(since)  # it answered: told before anything is forgotten
        self.buffer.forget_all(batch)
        commits = actions.count(_COMMIT)
        if self.confirming:
            confirm = self.confirm
            for entry, action in zip(batch, actions, strict=True):
                confirm(entry, action is _COMMIT)
        if commits:
            self.metrics.settled(_COMMIT, commits)
        if commits < len(batch):
            self.metrics.settled(Action.RELEASE, len(batch) - commits)

    def _apply(self, entry: Entry, settlement: Settlement, result: Result, left: Left) -> bool:
        """Act on one result; False when the entry stays outstanding for another try."""
        outcome = result.outcome
        if outcome is Outcome.OK:
            self.metrics.settled(settlement.action)
            if settlement.action is Action.REJECT:
                self._log_failed_run(settlement, result)
            self.buffer.forget(entry)
            self.confirm(entry, settlement.action is Action.COMMIT)
            return True
        if outcome is Outcome.STALE:
            self.metrics.stale()
            if settlement.action is Action.REJECT:
                self._log_failed_run(settlement, Result(outcome, (
                    "outcome unknown: an earlier try of this reject took effect"
                    if entry.settle_failures else
                    "outcome unknown: no longer ours when rejected (recovered or delivered "
                    "again)")))
            if entry.settle_failures:  # an earlier, unconfirmed attempt of ours took effect
                log.info("earlier %s of %s took effect", settlement.action.value,
                         entry.delivery.pid)
            else:
                log.warning(
                    "delivery %s was recovered by another consumer before its %s: "
                    "it may run twice (at-least-once)", entry.delivery.pid,
                    settlement.action.value,
                )
            self.buffer.forget(entry)
            self.confirm(entry, False)
            return True
        if outcome is Outcome.MISSING:
            log.error(
                "release of %s refused: its payload is missing from the broker; "
                "ownership kept for inspection", entry.delivery.pid,
            )
            self.buffer.forget(entry)
            self.confirm(entry, False)
            return True
        if outcome is Outcome.UNCERTAIN:
            if not entry.uncertain:  # counted per delivery, not per try
                entry.uncertain = True
                self.metrics.uncertain()
            if not self.broker.replay_uncertain:
                # Never replayed: the broker either applied it or redelivers the message.
                if settlement.action is Action.REJECT:
                    self._log_failed_run(settlement, Result(outcome, (
                        "outcome unknown: the reject's reply was lost")))
                left.unreplayed.append((entry, settlement, result))
                self.buffer.forget(entry)
                self.confirm(entry, False)
                return True
        left.again.append((entry, settlement, result))
        return False

    def _log_failed_run(self, settlement: Settlement, result: Result) -> None:
        """The one line of a failed run, once its reject is settled (see failures), and its
        count by outcome and error class."""
        outcome, error = failures.log_outcome(log, settlement, result, self.broker.max_attempts)
        self.metrics.rejected(outcome, error)


class Early:
    """``Broker.settle``'s ``on_result``: a result as soon as it is known, one at a time;
    ``many(indices, result)`` for several with the same result at once, for a broker that
    has them together (NATS: the confirmations one read of the socket brought)."""

    __slots__ = ("many", "one")

    def __init__(self, one: ResultCallback, many: Callable[[list[int], Result], None]) -> None:
        self.one = one
        self.many = many

    def __call__(self, index: int, result: Result) -> None:
        self.one(index, result)


def _nobody(entry: Entry, committed: bool) -> None:
    """No handler process listens for confirmations (none defines on_success)."""


def _named(unsettled: Unsettled) -> str:
    """``commit of <pid>: <outcome>: <detail>`` for the first few, and how many more."""
    named = "; ".join(
        f"{settlement.action.value} of {entry.delivery.pid}: {result.outcome.value}: "
        f"{result.detail}" for entry, settlement, result in unsettled[:NAMED])
    more = len(unsettled) - NAMED
    return named + (f"; and {more} more" if more > 0 else "")
