"""The failed, dead and poison lists of a Redis queue: read and delete their jobs (the
``failed`` / ``dead`` / ``poison`` commands and the dashboard; retry: ``retry``).

The lists hold pids (poison: raw bytes), LPUSHed as jobs fail: the tail is the oldest.
Listings and ``--count`` go oldest first, in windows of at most 1,000, like ``retry``.
Job records are read through ``records.lua`` (one longer than the job's envelope limit is
answered with its length, never sent), failure records (``QueueKeys.error``, written by the
supervisor beside a pid it moves to failed or dead; a PHP worker writes none) the same way
with ``broker.failure.MAX_RECORD_BYTES``; poison entries through ``peek.lua`` (their first
bytes, their length and the SHA1 of their bytes, by which the reason store
``supervisor-poison-reasons`` keeps why our supervisor poisoned each). Deleting runs
``delete.lua``: a pid leaves the list with its records (failure record and history), and only
if it is still there, so a pid retried or deleted meanwhile by someone else is skipped, not
deleted twice or taken from its next run. ``poison delete`` trims the list (LTRIM): the
reasons of the entries it drops are not deleted; they go once they are among the oldest
beyond ``POISON_REASONS_KEPT``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.base import MAX_BATCH
from broker.failure import MAX_RECORD_BYTES
from broker.redis.keys import FAILURES_KEPT, QueueKeys
from broker.redis.scripts import Scripts
from broker.stopped import Job, read_failure, read_history

#: Bytes of a poison entry read to show it (``show``: the limit of the job's envelopes).
POISON_PREVIEW_BYTES = 400


@dataclass(slots=True)
class DeleteReport:
    deleted: list[str] = field(default_factory=list)  # pids (poison: how many, as "")
    missing: list[str] = field(default_factory=list)  # named or selected, not in the list

    def as_dict(self) -> dict[str, Any]:
        return {"deleted": len(self.deleted), "pids": self.deleted, "missing": self.missing}


def list_key(keys: QueueKeys, source: str) -> str:
    return {"failed": keys.failed, "dead": keys.dead, "poison": keys.poison}[source]


async def oldest(client: Any, key: str, count: int) -> list[str]:
    """Up to ``count`` entries from the oldest end (the tail), oldest first."""
    found: list[str] = []
    while len(found) < count:
        take = min(MAX_BATCH, count - len(found))
        window = await client.lrange(key, -(len(found) + take), -(len(found) + 1))
        found += [_text(pid) for pid in reversed(window)]
        if len(window) < take:
            break
    return found


async def read_jobs(
    client: Any, scripts: Scripts, keys: QueueKeys, pids: Sequence[str], limit: int,
    with_ttl: bool = False,
) -> list[Job]:
    jobs: list[Job] = []
    for start in range(0, len(pids), MAX_BATCH):
        chunk = list(pids[start:start + MAX_BATCH])
        records = await scripts.call("records", [keys.job(pid) for pid in chunk], [limit])
        failures = await scripts.call("records", [keys.error(pid) for pid in chunk],
                                      [MAX_RECORD_BYTES])
        sizes = [len(r) if isinstance(r, bytes) else (r or 0) for r in records]
        for pid, record, size, failure in zip(chunk, records, sizes, failures, strict=True):
            decoded_failure, note = read_failure(failure)
            jobs.append(Job(pid=pid, raw=record if isinstance(record, bytes) else None,
                            size=size, failure=decoded_failure, failure_note=note))
    if with_ttl and jobs:
        pipe = client.pipeline(transaction=False)
        for job in jobs:
            pipe.pttl(keys.job(job.pid))
        for job, ttl in zip(jobs, await pipe.execute(), strict=True):
            job.ttl_ms = ttl if ttl >= -1 else None
    return jobs


async def list_jobs(
    client: Any, scripts: Scripts, keys: QueueKeys, source: str, limit: int, record_limit: int,
) -> tuple[int, list[Job]]:
    """(how many the list holds, the oldest ``limit`` of them)."""
    key = list_key(keys, source)
    total = await client.llen(key)
    if source == "poison":
        return total, await peek(client, scripts, keys, 0, limit, POISON_PREVIEW_BYTES)
    return total, await read_jobs(client, scripts, keys, await oldest(client, key, limit),
                                  record_limit)


async def show_job(
    client: Any, scripts: Scripts, keys: QueueKeys, source: str, pid: str, record_limit: int,
) -> Job | None:
    """The job ``pid`` of the list (poison: the entry at that position from the oldest),
    or None when the list holds no such entry."""
    key = list_key(keys, source)
    if source == "poison":
        found = await peek(client, scripts, keys, int(pid), 1, record_limit)
        return found[0] if found else None
    if not await in_list(client, key, [pid]):
        return None
    [job] = await read_jobs(client, scripts, keys, [pid], record_limit, with_ttl=True)
    history = await client.lrange(keys.failures(pid), 0, FAILURES_KEPT)
    job.history = read_history(history)
    return job


async def peek(client: Any, scripts: Scripts, keys: QueueKeys, start: int, count: int,
               limit: int) -> list[Job]:
    """Poison entries from position ``start`` (0: the oldest): their first ``limit`` bytes,
    and why each was poisoned when the reason store has it."""
    jobs: list[Job] = []
    while len(jobs) < count:
        take = min(MAX_BATCH, count - len(jobs))
        found = await scripts.call("peek", [keys.poison], [start + len(jobs), take, limit])
        reasons = await client.hmget(keys.poison_reasons, [digest for *_, digest in found]) if (
            found) else []
        for (size, head, _), stored in zip(found, reasons, strict=True):
            job = Job(pid="", raw=head, size=size, position=start + len(jobs))
            job.reason_at, job.reason = poison_reason(stored)
            jobs.append(job)
        if len(found) < take:
            break
    return jobs


def poison_reason(stored: bytes | None) -> tuple[float | None, str]:
    """A reason store value ``"<unix s> <why>"`` as (when, why); (None, "") for none."""
    if stored is None:
        return None, ""
    when, _, why = _text(stored).partition(" ")
    try:
        return float(when), why
    except ValueError:
        return None, _text(stored)


async def delete(
    client: Any, scripts: Scripts, keys: QueueKeys, source: str, pids: Sequence[str],
    dry_run: bool = False,
) -> DeleteReport:
    """Remove each pid still in the list, with its job record and failure record."""
    key, report = list_key(keys, source), DeleteReport()
    pids = list(dict.fromkeys(pids))
    for start in range(0, len(pids), MAX_BATCH):
        chunk = pids[start:start + MAX_BATCH]
        if dry_run:
            listed = await in_list(client, key, chunk)
            report.deleted += [pid for pid in chunk if pid in listed]
            report.missing += [pid for pid in chunk if pid not in listed]
            continue
        script_keys = [key]
        for pid in chunk:
            script_keys += [keys.job(pid), keys.error(pid), keys.failures(pid)]
        statuses = await scripts.call("delete", script_keys, chunk)
        for pid, status in zip(chunk, statuses, strict=True):
            (report.deleted if _text(status) == "ok" else report.missing).append(pid)
    return report


async def delete_oldest(
    client: Any, scripts: Scripts, keys: QueueKeys, source: str, count: int | None,
    dry_run: bool = False,
) -> DeleteReport:
    """Delete the oldest ``count`` pids (None: as many as the list holds now), a window of
    at most 1,000 at a time: each window leaves the list whole (deleted here, or by someone
    else meanwhile), so the next one starts at the tail again and no pid list is built."""
    key = list_key(keys, source)
    if count is None:
        count = await client.llen(key)
    if dry_run:
        return DeleteReport(deleted=await oldest(client, key, count))
    report, seen = DeleteReport(), 0
    while seen < count:
        window = await oldest(client, key, min(MAX_BATCH, count - seen))
        if not window:
            break
        report.deleted += (await delete(client, scripts, keys, source, window)).deleted
        seen += len(window)  # a pid someone else took meanwhile was not named: not missing
    return report


async def delete_poison(client: Any, keys: QueueKeys, count: int | None,
                        dry_run: bool = False) -> int:
    """Drop the oldest ``count`` poison entries (None: all there are now); how many went."""
    total = await client.llen(keys.poison)
    count = total if count is None else min(count, total)
    if count and not dry_run:
        # LTRIM keeps the newest: entries pushed meanwhile (at the head) are never dropped.
        await client.ltrim(keys.poison, 0, -(count + 1))
    return count


async def in_list(client: Any, list_key: str, pids: Sequence[str]) -> set[str]:
    """Which of ``pids`` are in the list (LPOS each: a scan of the list in the server)."""
    pipe = client.pipeline(transaction=False)
    for pid in pids:
        pipe.lpos(list_key, pid)
    found = await pipe.execute() if pids else []
    return {pid for pid, position in zip(pids, found, strict=True) if position is not None}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
