"""Failed runs as operators read them: the record of a run whose handler process could not
tell why (killed at its timeout, or gone), and the one log line of each failed run's outcome.

A run that failed is logged once, after the broker settled it, with what became of the job:
``retrying in N s`` (a warning), ``failed`` or ``dead`` (an error, with the traceback in
JSON logs). The outcome is the broker's (``Result.detail`` of an applied reject); a broker
that does not say is read by the attempt count. A reject that was not ours to apply (the
delivery was recovered by another consumer) or whose reply was lost is logged the same way,
as a warning saying so.
"""

from __future__ import annotations

import logging
import signal

from broker.base import Result, Settlement
from broker.failure import Failure
from worker.process import CHILD_BROKEN

#: The classes of failures the supervisor records itself (no exception was raised).
TIMEOUT = "HandlerTimeout"
LOST = "WorkerLost"

#: What an outcome means for the job, in the text of its line.
_FINAL = {"failed": "no attempts left: moved to failed", "dead": "no attempts left: moved to dead"}


def timed_out(reason: str, pid: int | None) -> Failure:
    """The run outlived ``handler_timeout`` and its process was killed for it."""
    killed = f" (handler process {pid} killed)" if pid else ""
    return Failure(error=TIMEOUT, message=f"{reason}{killed}")


def lost(pid: int, status: int | None) -> Failure:
    """The handler process died while running it (``status``: exit code, or -signal)."""
    if status is not None and status < 0:
        try:
            name = f" ({signal.Signals(-status).name})"
        except ValueError:
            name = ""
        how = f"killed by signal {-status}{name}"
    elif status == CHILD_BROKEN:
        how = f"exited with code {status} (broken: the error it logged before says why)"
    else:
        how = f"exited with code {status}"
    return Failure(error=LOST, message=f"handler process {pid} {how}")


def outcome_of(result: Result, attempt: int, max_attempts: int) -> str:
    """``retrying in N s``, ``failed`` or ``dead``: the broker's word, else the budget's."""
    if result.detail:
        return result.detail
    if max_attempts and attempt >= max_attempts:
        return "failed"
    return "retrying"


def log_outcome(
    log: logging.Logger, settlement: Settlement, result: Result, max_attempts: int
) -> tuple[str, str]:
    """One line for one settled reject: a warning while it is retried (or its outcome is
    not known), an error once it is not. Returns the outcome and the error class (the
    rejects counter's labels)."""
    delivery = settlement.delivery
    failure = settlement.failure or Failure.from_text(settlement.error)
    attempt = failure.attempt or delivery.attempts + 1
    outcome = outcome_of(result, attempt, max_attempts)
    final = outcome in _FINAL
    of = f"/{max_attempts}" if max_attempts else ""
    at = f" ({failure.where})" if failure.where else ""
    extra: dict[str, object] = {
        "queue": delivery.queue, "pid": delivery.pid, "attempt": attempt,
        "outcome": outcome, "error": failure.summary,
    }
    if max_attempts:
        extra["max_attempts"] = max_attempts
    if failure.where:
        extra["where"] = failure.where
    if final and failure.traceback:
        extra["traceback"] = failure.traceback
    log.log(logging.ERROR if final else logging.WARNING,
            "job %s attempt %d%s failed: %s%s; %s", delivery.pid, attempt, of,
            failure.summary, at, _FINAL.get(outcome, outcome), extra=extra)
    return outcome, failure.error
