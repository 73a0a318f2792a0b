"""What a browser of a Redis queue (the dashboard) reads: the sampler's counts, pages of the
failed, dead and poison lists from the newest, windows of them for a search, and one job
wherever it is.

Every read is bounded by what the caller passes (entries per page, bytes of a value, depth
of a search) and none writes. A sample is one pipeline (sizes, counters, the supervisors'
token registry, the delayed retry due first), the server's ``TIME`` and one ``EXISTS`` per
registered supervisor: no ``SCAN``, which costs a walk of the whole keyspace. The live
supervisors it finds (``live_consumers``) are what the queue page lists, so a page view
does no ``SCAN`` either.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from broker.redis.admin.lists import poison_reason
from broker.redis.gauges import overdue
from broker.redis.keys import FAILURES_KEPT, QueueKeys
from broker.redis.recovery import server_time


@dataclass(slots=True)
class Sample:
    """The sizes and counters of one queue at one time."""

    ready: int
    processing: int
    failed: int
    dead: int
    poison: int
    delayed: int
    done: int  # settled so far (success + failed): rates are its deltas
    supervisors: int | None  # live ones (None: too many registered to check)
    delayed_overdue: float  # s the oldest delayed retry is past due
    consumers: list[str] | None = None  # the live ones' ids, sorted (None: too many)


@dataclass(slots=True)
class Record:
    """The job record of one pid, read up to a number of bytes, and its failure record."""

    pid: str
    size: int  # bytes of the whole record (0: none, it expired)
    head: bytes  # its first bytes
    error: bytes | None  # the failure record (None: none)


async def sample(client: Any, keys: QueueKeys, max_tokens: int) -> Sample:
    """One sample; supervisors are checked only when at most ``max_tokens`` are registered."""
    pipe = client.pipeline(transaction=False)
    for key in (keys.ready, keys.processing, keys.failed, keys.dead, keys.poison):
        pipe.llen(key)
    pipe.get(keys.stat("success"))
    pipe.get(keys.stat("failed"))
    pipe.zcard(keys.delayed)
    pipe.hlen(keys.supervisor_tokens)
    pipe.zrange(keys.delayed, 0, 0, withscores=True)
    ready, processing, failed, dead, poison, success, failures, delayed, tokens, first = (
        await pipe.execute())
    consumers = await live_consumers(client, keys, tokens, max_tokens)
    now, _ = await server_time(client, keys.delayed)
    return Sample(ready, processing, failed, dead, poison, delayed,
                  _int(success) + _int(failures), None if consumers is None else len(consumers),
                  overdue(first, now), consumers)


async def live_consumers(client: Any, keys: QueueKeys, registered: int | None,
                         max_tokens: int) -> list[str] | None:
    """The ids of the supervisors whose record still exists, by the token registry (None:
    more than ``max_tokens`` registered, too many to check at once). ``registered``: the
    registry's size if known (HLEN), else it is read here."""
    if registered is None:
        registered = await client.hlen(keys.supervisor_tokens)
    if registered > max_tokens:
        return None
    entries = await client.hgetall(keys.supervisor_tokens) if registered else {}
    consumers = sorted({_text(value).partition(" ")[2] for value in entries.values()} - {""})
    if not consumers:
        return []
    pipe = client.pipeline(transaction=False)
    for consumer in consumers:
        pipe.exists(keys.supervisor(consumer))
    alive: list[int] = await pipe.execute()
    return [consumer for consumer, exists in zip(consumers, alive, strict=True) if exists]


def list_key(keys: QueueKeys, kind: str) -> str:
    return {"failed": keys.failed, "dead": keys.dead, "poison": keys.poison}[kind]


async def newest(client: Any, key: str, start: int, count: int) -> list[str]:
    """``count`` pids of a list from position ``start`` (0: the newest)."""
    return [_text(p) for p in await client.lrange(key, start, start + count - 1)]


async def search(client: Any, key: str, pid: str, depth: int) -> bool:
    """Whether ``pid`` is among the newest ``depth`` entries of the list."""
    return await client.lpos(key, pid, maxlen=depth) is not None


async def from_tail(client: Any, key: str, start: int, count: int) -> list[str]:
    """``count`` pids of a list from position ``start`` counted from the oldest end, newest
    first: failures pushed meanwhile (at the head) do not move them, so a search that reads
    window after window neither reads an entry twice nor skips one for them."""
    return [_text(pid) for pid in await client.lrange(key, -(start + count), -(start + 1))]


async def records(client: Any, keys: QueueKeys, pids: list[str], head_bytes: int,
                  error_bytes: int | None = None) -> list[Record]:
    """The job record (its first ``head_bytes``) and failure record (whole, or its first
    ``error_bytes``) of each pid: one pipeline."""
    pipe = client.pipeline(transaction=False)
    for pid in pids:
        pipe.strlen(keys.job(pid))
        pipe.getrange(keys.job(pid), 0, head_bytes - 1)
        if error_bytes is None:
            pipe.get(keys.error(pid))
        else:  # GETRANGE of a missing key answers "": no failure record is empty
            pipe.getrange(keys.error(pid), 0, error_bytes - 1)
    replies = await pipe.execute() if pids else []
    found = [Record(pid, *replies[3 * index:3 * index + 3]) for index, pid in enumerate(pids)]
    for record in found:
        record.error = record.error or None
    return found


async def poison_page(client: Any, key: str, total: int, start: int, count: int,
                      max_list_bytes: int) -> tuple[int, list[bytes] | None]:
    """(the list's bytes, ``count`` entries from position ``start``), the entries None when
    the list holds more than ``max_list_bytes``: entries are raw bytes of any size, and
    LRANGE cannot cut them."""
    size = await client.memory_usage(key, samples=0) if total else 0
    if (size or 0) > max_list_bytes:
        return size, None
    return size, await client.lrange(key, start, start + count - 1)


async def poison_reasons(client: Any, keys: QueueKeys, raws: list[bytes]
                         ) -> list[tuple[float | None, str]]:
    """Why each poison entry was poisoned and when, as the reason store keeps it (by the SHA1
    of its bytes): (None, "") where it keeps none."""
    if not raws:
        return []
    digests = [hashlib.sha1(raw).hexdigest() for raw in raws]
    return [poison_reason(stored)
            for stored in await client.hmget(keys.poison_reasons, digests)]


async def job(client: Any, keys: QueueKeys, pid: str, value_bytes: int, depth: int
              ) -> dict[str, Any]:
    """Everything about one pid: the lists it is in (among their newest ``depth``), its job
    record (the first ``value_bytes``), time to live, failure record, failure history
    (newest first, at most ``FAILURES_KEPT`` + 1 records), owner and claim."""
    pipe = client.pipeline(transaction=False)
    for key in (keys.failed, keys.dead, keys.processing):
        pipe.lpos(key, pid, maxlen=depth)
    pipe.strlen(keys.job(pid))
    pipe.getrange(keys.job(pid), 0, value_bytes - 1)
    pipe.ttl(keys.job(pid))
    pipe.get(keys.error(pid))
    pipe.get(keys.owner(pid))
    pipe.pttl(keys.claim(pid))
    pipe.lrange(keys.failures(pid), 0, FAILURES_KEPT)
    failed, dead, processing, size, raw, ttl, error, owner, claim, history = (
        await pipe.execute())
    where = [name for name, at in (("failed", failed), ("dead", dead),
                                   ("processing", processing)) if at is not None]
    return {"where": where, "size": size, "raw": raw, "ttl": ttl, "error": error,
            "owner": owner, "claim_ms": claim, "history": history}


def _int(value: bytes | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
