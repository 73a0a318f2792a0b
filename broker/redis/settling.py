"""What one settle.lua call sends for a batch that is more than unkeyed commits: each
settlement's op, its extra arguments (a retry's envelope, delay and failure record, a
reject's failure record) and its result once applied. The call itself, and the usual batch
of plain commits (no op to build per item), are ``RedisBroker.settle``'s (``broker.redis.broker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import orjson

from broker import envelope
from broker.base import APPLIED, Action, Outcome, Result, Settlement
from broker.failure import Failure
from broker.redis.keys import QueueKeys
from broker.retry import RetryPolicy

log = logging.getLogger("broker.redis.broker")  # its log lines keep the broker's name

#: The fields of a failure record, in ``Failure.encode()``'s order.
_FAILURE_FIELDS = tuple(item.name for item in fields(Failure))
_COMMIT = Action.COMMIT
_FAILED = Result(Outcome.OK, "failed")


def batch_ops(
    batch: Sequence[Settlement], keys: list[str], queue: QueueKeys, retry: RetryPolicy,
    consumer_id: str,
) -> tuple[str, list[Any], list[Result]]:
    """A batch with more than unkeyed commits: the script's op per item, the extra
    arguments (a retry's envelope, delay and failure record, a reject's failure record),
    the result of each once applied; the keyed items' markers, the rejects' failure record
    keys and the failed attempts' history keys are added to ``keys``, in that order, after
    every item's own."""
    ops: list[str] = []
    markers: list[str] = []
    records: list[str] = []  # the failure record key of each reject
    histories: list[str] = []  # the history key of each failed attempt (retry or reject)
    extras: list[Any] = []
    applied: list[Result] = []
    now = time.time()
    for settlement in batch:
        delivery = settlement.delivery
        if settlement.action is _COMMIT:
            op, result = "c", APPLIED
            if delivery.attempts:  # it may have a failure history: it goes with the job
                op = "o"
                histories.append(queue.failures(delivery.pid))
        else:
            op, arguments, result = _op(settlement, now, retry, consumer_id)
            extras += arguments
            if op == "f":
                records.append(queue.error(delivery.pid))
            if op != "l":
                histories.append(queue.failures(delivery.pid))
        if "key" in delivery.envelope:  # possibly keyed (coalesced)
            marker = queue.marker(delivery.envelope)
            if marker:
                markers.append(marker)
                op = op.upper()  # keyed: the marker follows the items' keys
        ops.append(op)
        applied.append(result)
    keys += markers
    keys += records
    keys += histories
    return "".join(ops), extras, applied


def _op(
    settlement: Settlement, now: float, retry: RetryPolicy, consumer_id: str
) -> tuple[str, list[Any], Result]:
    """The script's op for one settlement, its extra arguments (a retry's envelope, delay
    and failure record, a reject's failure record) and its result once applied (what became of the
    job: "retrying in N s", "failed")."""
    if settlement.action is Action.COMMIT:
        return "c", [], APPLIED
    if settlement.action is Action.RELEASE:
        return "l", [], APPLIED
    delivery = settlement.delivery
    if retry.exhausted(delivery.attempts):
        return _reject_op(settlement, now, consumer_id)
    decoded = delivery.envelope or envelope.decode(delivery.raw)
    delay = retry.whole_seconds(delivery.attempts)
    try:
        # A delayed retry is stamped again by promote.lua when it becomes ready (the
        # server's time); parked, it carries when it is due by this host's clock, which
        # is what an older promote.lua, moving it as it is, pushes (a rolling upgrade).
        retried = envelope.requeued(
            decoded, RetryPolicy.next_attempts(delivery.attempts), int(now) + delay)
    except envelope.Unencodable as error:
        # This delivery alone: the batch it settles with must still go through.
        log.error("job %s failed, and its retry cannot be written as PHP would (%s): it "
                  "goes to the failed list instead", delivery.pid, error)
        return _reject_op(settlement, now, consumer_id)
    retrying = Result(Outcome.OK, f"retrying in {delay} s")
    record = _record(settlement, now, consumer_id, "retrying")
    if delay:
        return "d", [retried, delay, record], retrying  # waits in supervisor-delayed
    return "r", [retried, record], retrying  # queue 5's immediate requeue


def _reject_op(
    settlement: Settlement, now: float, consumer_id: str
) -> tuple[str, list[Any], Result]:
    """Queue 5's reject to the failed list (the record kept), with our failure record."""
    return "f", [_record(settlement, now, consumer_id, "failed")], _FAILED


def _record(settlement: Settlement, now: float, consumer_id: str, outcome: str) -> bytes:
    """Our failure record of a failed attempt: ``Failure.encode()``'s JSON with what this
    attempt adds (outcome, attempt, time, consumer, the envelope's timestamp), built in one
    step (a batch of 1,000 failures must stay cheap)."""
    failure = (settlement.failure.bounded() if settlement.failure
               else Failure.from_text(settlement.error))  # bounded already
    delivery = settlement.delivery
    record = {name: getattr(failure, name) for name in _FAILURE_FIELDS}
    record["outcome"] = outcome
    record["attempt"] = failure.attempt or RetryPolicy.next_attempts(
        delivery.attempts)  # counted from 1
    record["at"] = failure.at or now
    record["consumer"] = failure.consumer or consumer_id
    record["published"] = failure.published or float(delivery.timestamp)
    return orjson.dumps(record)
