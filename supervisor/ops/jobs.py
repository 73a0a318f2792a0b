"""What ``failed``, ``dead`` and ``poison`` show of one job, on either broker, as text or JSON.

Words: an *attempt* is one delivery of the job to a handler, numbered from 1; the envelope's
``attempts`` field counts the earlier ones (queue 5's meaning), so attempt N carries
``attempts`` N - 1. (The JSON key ``runs`` is kept for scripts that read it: it is
``last_attempt``.)

Everything shown comes from the broker, where anyone who can publish may have put a terminal
escape, a bidirectional override or megabytes: every line is escaped (``logs.escape``) and a
listing shows a bounded preview of each payload. ``show`` prints the whole envelope as read
(the read itself is bounded by the job's envelope limit), escaped.
"""

from __future__ import annotations

import datetime
from typing import Any

import orjson

from broker.failure import Failure
from broker.stopped import Job
from supervisor import logs

#: Characters of a payload a listing shows (``show`` prints it whole).
PREVIEW_CHARS = 100
#: What ``show`` says of a job without a failure record.
NO_RECORD = "(no record: failed by a worker that keeps none, e.g. a PHP queue-5 worker)"
#: Pids named in the plain output of delete/retry of many (``--json`` names them all).
NAMED_AT_MOST = 20


def job_dict(job: Job, whole: bool = False) -> dict[str, Any]:
    """JSON-ready; ``whole``: the envelope as text, else a bounded preview."""
    decoded = job.decoded
    text = _text(job.raw) if job.raw is not None else None
    shown: dict[str, Any] = {
        "pid": job.pid, "attempts": job.attempts, "last_attempt": job.runs, "runs": job.runs,
        "failed_at": job.failed_at,
        "enqueued_at": decoded.get("timestamp") if decoded else None,
        "first_published_at": job.first_published,
        "bytes": job.size, "note": job.note or None,
        "error": _failure_dict(job.failure), "error_note": job.failure_note or None,
    }
    if job.seq is not None:
        shown["seq"] = job.seq
    if job.ttl_ms is not None:
        shown["ttl_ms"] = job.ttl_ms
    if job.position is not None:
        shown["position"] = job.position
        shown["reason"] = job.reason or None
        shown["reason_at"] = job.reason_at
    if whole and job.history:
        shown["history"] = [_failure_dict(failure) for failure in job.history]
    if whole:
        shown["envelope"] = text
    else:
        shown["preview"] = preview(text) if text is not None else None
    return shown


def _failure_dict(failure: Failure | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    return {"class": failure.error, "message": failure.message, "where": failure.where,
            "traceback": failure.traceback, "attempt": failure.attempt, "at": failure.at,
            "outcome": failure.outcome, "consumer": failure.consumer,
            "published": failure.published or None}


def preview(text: str, chars: int = PREVIEW_CHARS) -> str:
    """One line of at most ``chars`` characters (plus a marker saying how long it was),
    escaped for a terminal."""
    return logs.clean(text, chars)


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def when(at: float, now: float) -> str:
    """"2026-12-01 15:40:02Z (5m ago)" for a unix time."""
    if at <= 0:
        return "at an unknown time"
    stamp = datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{stamp} ({age(now - at)} ago)"


def age(seconds: float) -> str:
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def list_lines(title: str, jobs: list[Job], now: float) -> list[str]:
    """The plain listing: a title, then one line per job."""
    lines = [title]
    for job in jobs:
        decoded = job.decoded
        runs = "?" if job.runs is None else job.runs
        failed = when(job.failed_at, now) if job.failed_at else "at an unknown time"
        where = f"seq {job.seq}  " if job.seq is not None else ""
        payload = (job.note or preview(_json(decoded["payload"])) if decoded else job.note)
        lines.append(f"  {where}{logs.clean(job.pid or '(no pid)', 80)}  attempt {runs}  "
                     f"failed {failed}  {logs.clean(job.summary(), PREVIEW_CHARS)}  "
                     f"payload {payload}")
    return lines


def show_lines(what: str, job: Job, now: float) -> list[str]:
    """``show``: everything about one job, labelled, escaped."""
    decoded = job.decoded
    lines = [f"{what} {logs.clean(job.pid or '(no pid)', 200)}"]
    if job.seq is not None:
        lines.append(f"  stream seq   {job.seq}")
    if job.position is not None:  # poison
        lines.append(f"  reason       {logs.clean(job.reason, 600)}, "
                     f"{when(job.reason_at or 0, now)}" if job.reason else
                     "  reason       (none kept: poisoned by a PHP worker or an older "
                     "supervisor, or among the oldest beyond the 1,000 reasons kept)")
    if job.runs is not None:
        # On Redis the envelope counts earlier attempts (queue 5); on NATS it stays as
        # published.
        lines.append(f"  attempt      {job.runs} (the last; envelope attempts {job.attempts})"
                     if job.seq is None and job.attempts is not None
                     else f"  attempt      {job.runs} (the last)")
    if job.stored_at:
        lines.append(f"  dead since   {when(job.stored_at, now)}")
    if decoded and decoded["attempts"] and job.seq is None:
        first = job.first_published
        lines.append(f"  published    {when(first, now)} (first)" if first else
                     "  published    first: not known (queue 5 keeps only the last retry's "
                     "time)")
        lines.append(f"  retried      {when(float(decoded['timestamp']), now)} (the last "
                     "retry's envelope)")
    elif decoded:
        lines.append(f"  published    {when(float(decoded['timestamp']), now)}")
    lines.append(f"  record       {job.size:,} bytes{_ttl(job.ttl_ms)}")
    failure = job.failure
    if failure is None:
        lines.append(f"  error        {job.failure_note or NO_RECORD}")
    else:
        lines += [
            f"  error        {logs.clean(failure.summary, 4000)}",
            f"  where        {logs.clean(failure.where, 600)}",
            f"  failed       {when(failure.at, now)}, attempt {failure.attempt or '?'}, "
            f"{failure.outcome or 'outcome unknown'}"
            + (f", by {logs.clean(failure.consumer, 200)}" if failure.consumer else ""),
        ]
        if failure.traceback:
            lines.append("  traceback")
            lines += [f"    {logs.escape(line)}" for line in failure.traceback.splitlines()]
    if job.history:
        lines.append("  failures     oldest first (the first failure and the last 5 kept)")
        lines += [f"    attempt {failure.attempt or '?'}  {when(failure.at, now)}  "
                  f"{failure.outcome or '?'}  {logs.clean(failure.summary, PREVIEW_CHARS)}"
                  for failure in job.history]
    if job.raw is None:
        lines.append(f"  envelope     {job.note}")
    else:
        lines.append("  envelope" + (f"     {job.note}" if job.note else ""))
        lines += [f"    {logs.escape(line)}" for line in _text(job.raw).splitlines() or [""]]
    return lines


def _ttl(ms: int | None) -> str:
    if ms is None:
        return ""
    if ms < 0:
        return ", kept until deleted (no job_ttl)"
    return f", expires in {age(ms / 1000)} (job_ttl)"
