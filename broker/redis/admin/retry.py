"""Retry on Redis (the ``retry`` and ``failed retry`` commands, the dashboard): move failed
(or dead) jobs back to the ready list, oldest first (or the pids named), bounded.

The pids are read from the tail of the source list (the oldest end: failures are LPUSHed)
in windows of at most 1,000, their job records fetched, and ``lua/retry.lua`` moves each
one only if its pid and record are still what was read. Python builds the envelope to push,
as queue 5's ``retry()`` does (the same payload, a new timestamp and ``attempts + 1``: the
failed run counts; or ``attempts = 0`` when asked), so the script never parses a payload.
A pid whose record expired (``job_ttl``) can never run again: it leaves the list. Either
way the pid's failure record (``QueueKeys.error``) is deleted with it: it described a run
that is over. ``pids`` names the jobs instead of the window; ``dry_run`` reads and plans
but writes nothing (what would move is counted as moved).

The window is placed relative to the tail, which new failures (at the head) never shift;
entries left in place (undecodable records, records changed meanwhile) are stepped over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from broker import envelope
from broker.base import MAX_BATCH
from broker.redis.admin.lists import in_list
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
    missing: list[str] = field(default_factory=list)  # pids named but not in the list
    moved_pids: list[str] = field(default_factory=list)  # in the order moved

    @property
    def left(self) -> bool:
        """Something selected was not moved (named but missing, malformed, changed)."""
        return bool(self.missing or self.malformed or self.skipped)

    def as_dict(self) -> dict[str, Any]:
        return {"moved": self.moved, "expired": self.expired, "malformed": self.malformed,
                "skipped": self.skipped, "missing": self.missing, "pids": self.moved_pids}


async def retry(
    client: Any, scripts: Scripts, keys: QueueKeys, *, source: str = "failed",
    limit: int = MAX_BATCH, reset_attempts: bool = False, max_record_bytes: int = RECORD_LIMIT,
    pids: Sequence[str] | None = None, dry_run: bool = False,
) -> RetryReport:
    """Move up to ``limit`` jobs of ``source`` ("failed" or "dead") back to the ready list,
    or the jobs ``pids`` names."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}")
    source_key = keys.failed if source == "failed" else keys.dead
    if pids is not None:
        return await _retry_named(client, scripts, keys, source_key, list(dict.fromkeys(pids)),
                                  reset_attempts, max_record_bytes, dry_run)
    report, offset = RetryReport(), 0  # offset: entries at the tail that stay in place
    while report.moved < limit:
        take = min(MAX_BATCH, limit - report.moved)
        window = await client.lrange(source_key, -(offset + take), -(offset + 1))
        if not window:
            break
        # oldest first; a pid that is not UTF-8 (no PHP or supervisor writes one) names no
        # record we could build a key for: it stays in place, counted, and is stepped over
        pids = [pid for pid in map(_pid, reversed(window)) if pid is not None]
        report.malformed += len(window) - len(pids)
        offset += len(window) - len(pids)
        # records.lua answers a record over the limit with its length: it is never read here
        records = await scripts.call("records", [keys.job(pid) for pid in pids],
                                     [max_record_bytes])
        items, kept = _plan(pids, records, reset_attempts)
        report.malformed += kept
        offset += kept
        if items and dry_run:
            _count_planned(items, report)
            offset += len(items)
        elif items:
            offset += await _move(scripts, keys, source_key, items, report)
        if len(window) < take:
            break
    return report


async def _retry_named(
    client: Any, scripts: Scripts, keys: QueueKeys, source_key: str, pids: list[str],
    reset: bool, max_record_bytes: int, dry_run: bool,
) -> RetryReport:
    report = RetryReport()
    for start in range(0, len(pids), MAX_BATCH):
        chunk = pids[start:start + MAX_BATCH]
        if dry_run:  # the script would answer 'gone' for these
            listed = await in_list(client, source_key, chunk)
            report.missing += [pid for pid in chunk if pid not in listed]
            chunk = [pid for pid in chunk if pid in listed]
        records = await scripts.call("records", [keys.job(pid) for pid in chunk],
                                     [max_record_bytes]) if chunk else []
        items, kept = _plan(chunk, records, reset)
        report.malformed += kept
        if items and dry_run:
            _count_planned(items, report)
        elif items:
            await _move(scripts, keys, source_key, items, report, named=True)
    return report


def _count_planned(items: list[tuple[str, bytes, bytes]], report: RetryReport) -> None:
    for pid, record, _ in items:
        if record:
            report.moved += 1
            report.moved_pids.append(pid)
        else:
            report.expired += 1


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
    items: list[tuple[str, bytes, bytes]], report: RetryReport, named: bool = False,
) -> int:
    """Run the script on ``items``; returns how many of them stayed in the source list.
    A pid not in the list is ``missing`` when it was named, else moved by someone else."""
    script_keys = [source_key, keys.ready]
    for pid, _, _ in items:
        script_keys += [keys.job(pid), keys.error(pid), keys.failures(pid)]
    args = [value for item in items for value in item]
    statuses = [_text(status) for status in await scripts.call("retry", script_keys, args)]
    report.moved += statuses.count("ok")
    report.moved_pids += [pid for (pid, _, _), status in zip(items, statuses, strict=True)
                          if status == "ok"]
    report.expired += statuses.count("expired")
    gone = [pid for (pid, _, _), status in zip(items, statuses, strict=True) if status == "gone"]
    if named:
        report.missing += gone
    else:
        report.skipped += len(gone)
    report.skipped += statuses.count("changed")
    return statuses.count("changed")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pid(value: bytes | str) -> str | None:
    """A list entry as a pid, or None when it is not UTF-8 text."""
    try:
        return _text(value)
    except UnicodeDecodeError:
        return None
