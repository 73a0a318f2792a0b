"""Why an attempt of a job failed, kept where an operator can read it later.

Words: an *attempt* is one delivery of the job to a handler, numbered from 1 (``attempt``
below); the envelope's ``attempts`` counts the earlier ones, as queue 5 means it.

A handler's exception becomes a ``Failure`` in the handler process (class, message, where,
a bounded traceback), travels to the supervisor on the ring, is logged with the outcome,
and is kept beside the job when the job stops retrying:

- Redis: ``{ns}.supervisor-errors.{q}.{pid}`` (``QueueKeys.error``) holds ``encode()``'s
  JSON while the pid is in the failed or dead list, with the job record's expiry
  (``record_ttl``). Queue 5 never reads the key; it is written in the same script that
  moves the pid, and deleted when the job leaves the list by our hand (retry, delete).
  ``{ns}.supervisor-failures.{q}.{pid}`` (``QueueKeys.failures``) lists the records of
  every failed attempt (retried or not), newest first: the first and the last
  ``FAILURES_KEPT``, with the same expiry, deleted with the error record and when a
  retried job commits.
- NATS keeps no history: a failed attempt is NAKed and redelivered (the envelope, and its
  timestamp, unchanged); the dead-letter copy holds the last record.
- NATS: the dead-letter copy carries ``encode()`` in the header ``NATS_HEADER``.

The record is one JSON object of bounded size, so a listing of a thousand failed jobs reads
at most a few megabytes whatever the handlers raised. ``decode`` accepts what an older or
newer version wrote (unknown fields are ignored, missing ones take their defaults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import orjson

#: The header of a NATS dead-letter copy that holds the failure record.
NATS_HEADER = "Supervisor-Failure"

#: Bounds of each text field, in UTF-8 bytes: the message and the traceback's last lines
#: are what an operator reads; a handler that raises a 10 MB message must not fill Redis.
MAX_MESSAGE_BYTES = 2048
MAX_WHERE_BYTES = 512
MAX_TRACEBACK_BYTES = 8192
#: No encoded record is longer (the bounds above plus the fixed fields, JSON-escaped).
MAX_RECORD_BYTES = 6 * (MAX_MESSAGE_BYTES + MAX_WHERE_BYTES + MAX_TRACEBACK_BYTES) + 1024


#: How long a failure record is kept where job records are kept for ever (``job_ttl = 0``,
#: queue 5's default): it cannot simply go with its pid, because a queue-5 worker's
#: ``retry()`` takes the pid out of the failed list and requeues the job under a new pid,
#: leaving our record of the old one where nothing would ever look for it (issue 39.4).
RECORD_TTL_WITHOUT_JOB_TTL = 7 * 86_400


def record_ttl(job_ttl: int) -> int:
    """Seconds a failure record is kept: as long as its job record, never for ever."""
    return job_ttl or RECORD_TTL_WITHOUT_JOB_TTL


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt: what was raised, where, and what became of the job."""

    error: str  # the exception's class, qualified outside builtins ("mymod.Timeout")
    message: str = ""  # str(exception), cut to MAX_MESSAGE_BYTES
    where: str = ""  # "path.py:123 in handle": the innermost frame that raised
    traceback: str = ""  # formatted traceback, its last MAX_TRACEBACK_BYTES kept
    attempt: int = 0  # which attempt failed, counted from 1 (0: unknown)
    at: float = 0.0  # when, unix seconds
    outcome: str = ""  # "retrying", "failed" or "dead"
    consumer: str = ""  # the supervisor that ran it (its consumer id)
    #: Seconds the handler ran before it failed, as its process timed it (0: not known:
    #: an attempt its process did not live to report, or a record of an older version).
    seconds: float = 0.0
    #: The envelope's timestamp on this attempt (unix s; 0: not known): when the job was
    #: published, or, after a retry, requeued. On attempt 1 it is the first publish time,
    #: which queue 5 keeps nowhere else (a retry's envelope carries the retry's time).
    published: float = 0.0

    @classmethod
    def from_text(cls, text: str | None, **extra: Any) -> Failure:
        """A failure known only by a line of text ("worker lost: killed by signal 9")."""
        error, _, message = (text or "unknown error").partition(": ")
        if not message or " " in error:
            error, message = "Error", text or "unknown error"
        return cls(error=error, message=message, **extra).bounded()

    def bounded(self) -> Failure:
        """This failure with every text field cut to its bound (on a character boundary;
        the traceback keeps its end, where the raising line is)."""
        return Failure(
            error=_head(self.error, MAX_WHERE_BYTES),
            message=_head(self.message, MAX_MESSAGE_BYTES),
            where=_head(self.where, MAX_WHERE_BYTES),
            traceback=_tail(self.traceback, MAX_TRACEBACK_BYTES),
            attempt=self.attempt, at=self.at, outcome=self.outcome,
            consumer=_head(self.consumer, MAX_WHERE_BYTES), seconds=self.seconds,
            published=self.published,
        )

    def replace(self, **changes: Any) -> Failure:
        values: dict[str, Any] = {name: getattr(self, name) for name in _FIELDS}
        values.update(changes)
        return Failure(**values)

    @property
    def summary(self) -> str:
        """One line: "ValueError: bad input" (what logs and listings show)."""
        return f"{self.error}: {self.message}" if self.message else self.error

    def encode(self) -> bytes:
        # Not dataclasses.asdict: it deep-copies every field (a third of a millisecond,
        # paid on every failed attempt of a failure storm).
        bounded = self.bounded()
        record = {name: getattr(bounded, name) for name in _FIELDS}
        if not bounded.published:  # not known (a handler's report): no room spent on it
            del record["published"]
        return orjson.dumps(record)

    def encode_within(self, limit: int, ascii: bool = False) -> bytes:
        """``encode()`` in at most ``limit`` bytes (a ring record, a NATS header): the
        traceback is halved (its end kept) until it fits, then the message and where (their
        starts kept), then the class. ``ascii``: every non-ASCII character escaped
        (``\\uXXXX``), for a header. Raises ValueError if even the class does not fit."""
        failure = self.bounded()
        while True:
            data = failure.encode()
            if ascii:
                data = json.dumps(orjson.loads(data), ensure_ascii=True,
                                  separators=(",", ":")).encode()
            if len(data) <= limit:
                return data
            if failure.traceback:
                text = failure.traceback
                failure = failure.replace(traceback=text[len(text) // 2 + 1 :])
            elif failure.message or failure.where or failure.consumer:
                failure = failure.replace(message=failure.message[: len(failure.message) // 2],
                                          where=failure.where[: len(failure.where) // 2],
                                          consumer="")
            elif len(failure.error) > 1:
                failure = failure.replace(error=failure.error[: len(failure.error) // 2])
            else:
                raise ValueError(f"a failure record does not fit in {limit} bytes")

    @classmethod
    def decode(cls, data: bytes | str) -> Failure:
        """Raises ValueError for anything that is not a JSON object with a string ``error``."""
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError as error:
            raise ValueError(f"not a failure record: {error}") from None
        if not isinstance(value, dict) or not isinstance(value.get("error"), str):
            raise ValueError("not a failure record: no error class")
        known: dict[str, Any] = {}
        for name, kind in _FIELDS.items():
            item = value.get(name)
            if isinstance(item, kind) and not isinstance(item, bool):
                known[name] = item
            elif kind is float and isinstance(item, int) and not isinstance(item, bool):
                known[name] = float(item)
        return cls(**known).bounded()


_FIELDS: dict[str, type] = {
    field.name: {"str": str, "int": int, "float": float}[str(field.type)]
    for field in fields(Failure)
}


def _head(text: str, limit: int) -> str:
    # Encoded and decoded even when short: a lone surrogate (from a filename or a C
    # extension's message) becomes "?", so encode() never fails on what a handler raised.
    data = text.encode("utf-8", "replace")
    return data[:limit].decode("utf-8", "ignore")


def _tail(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    return data[-limit:].decode("utf-8", "ignore") if len(data) > limit else data.decode()
