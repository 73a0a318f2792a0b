"""``retry``: move failed (or dead) jobs back to the ready list, oldest first, bounded.

The pids are read from the tail of the source list (the oldest end: failures are LPUSHed)
in windows of at most 1,000, their job records fetched, and ``lua/retry.lua`` moves each
one only if its pid and record are still what was read. Python builds the envelope to push,
as queue 5's ``retry()`` does (the same payload, a new timestamp and ``attempts + 1``: the
failed run counts; or ``attempts = 0`` when asked), so the script never parses a payload.
A pid whose record expired (``job_ttl``) can never run again: it leaves the list. A pid
that leaves the list takes its failure record (``supervisor-errors.{q}.{pid}``) with it.

The window is placed relative to the tail, which new failures (at the head) never shift;
entries left in place (undecodable records, records changed meanwhile) are stepped over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker import envelope
from broker.base import MAX_BATCH
from broker.redis.keys import QueueKeys
from broker.redis.recovery import RECORD_LIMIT
from broker.redis.scripts import Scripts
from broker.retry import RetryPolicy

SOURCES = ("failed", "dead")


@dataclass(slots=True)
class RetryReport:
    moved: int = 0  # back in the ready list
    expired: int = 0  # pids without a job record, removed from the source list
    malformed: int = 0  # not an envelope, cannot be written back, or too long to read: left
    skipped: int = 0  # changed or moved by someone else meanwhile

    def as_dict(self) -> dict[str, int]:
        return {"moved": self.moved, "expired": self.expired, "malformed": self.malformed,
                "skipped": self.skipped}


async def retry(
    client: Any, scripts: Scripts, keys: QueueKeys, *, source: str = "failed",
    limit: int = MAX_BATCH, reset_attempts: bool = False, max_record_bytes: int = RECORD_LIMIT,
) -> RetryReport:
    """Move up to ``limit`` jobs of ``source`` ("failed" or "dead") back to the ready list."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}")
    source_key = keys.failed if source == "failed" else keys.dead
    report, offset = RetryReport(), 0  # offset: entries at the tail that stay in place
    while report.moved < limit:
        take = min(MAX_BATCH, limit - report.moved)
        window = await client.lrange(source_key, -(offset + take), -(offset + 1))
        if not window:
            break
        pids = [_text(pid) for pid in reversed(window)]  # oldest first
        # records.lua answers a record over the limit with its length: it is never read here
        records = await scripts.call("records", [keys.job(pid) for pid in pids],
                                     [max_record_bytes])
        items, kept = _plan(pids, records, reset_attempts)
        report.malformed += kept
        offset += kept
        if items:
            offset += await _move(scripts, keys, source_key, items, report)
        if len(window) < take:
            break
    return report


def _plan(
    pids: list[str], records: list[bytes | int | None], reset: bool
) -> tuple[list[tuple[str, bytes, bytes]], int]:
    """(pid, record as read, envelope to push) per item, and how many stay in place."""
    items, kept = [], 0
    for pid, record in zip(pids, records, strict=True):
        if record is None:
            items.append((pid, b"", b""))
            continue
        if isinstance(record, int):  # longer than a supervisor of the job would take
            kept += 1
            continue
        try:
            decoded = envelope.decode(record)
            attempts = 0 if reset else RetryPolicy.next_attempts(decoded["attempts"])
            items.append((pid, record, envelope.requeued(decoded, attempts)))
        except (envelope.MalformedEnvelope, envelope.Unencodable):  # no handler could run it
            kept += 1
    return items, kept


async def _move(
    scripts: Scripts, keys: QueueKeys, source_key: str,
    items: list[tuple[str, bytes, bytes]], report: RetryReport,
) -> int:
    """Run the script on ``items``; returns how many of them stayed in the source list."""
    script_keys = [source_key, keys.ready, *(keys.job(pid) for pid, _, _ in items),
                   *(keys.error(pid) for pid, _, _ in items)]
    args = [value for item in items for value in item]
    statuses = [_text(status) for status in await scripts.call("retry", script_keys, args)]
    report.moved += statuses.count("ok")
    report.expired += statuses.count("expired")
    report.skipped += statuses.count("changed") + statuses.count("gone")
    return statuses.count("changed")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
