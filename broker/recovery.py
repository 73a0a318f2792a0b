"""Maintenance of one Redis queue: return work that dead consumers left behind.

One ``maintain()`` call does a bounded amount of work, in three steps:

1. **Lock.** ``SET reap-lock <holder> NX PX lock_ms``; if another supervisor holds it, the
   call reports ``skipped`` and does nothing. The lock only avoids duplicated work: every
   state change below is re-checked inside a script, so two overlapping sweeps (say, after
   the lock expired mid-sweep) cannot recover one message twice. It is released at the end
   by compare-and-delete (``lua/unlock.lua``), so an expired lock taken over by someone
   else is left alone.

2. **Expired reservations.** Read the server clock, list registered reservations whose
   deadline passed (``ZRANGEBYSCORE``, 100 at a time) and hand their keys to
   ``recover_reservations.lua``. The list may be stale by the time the script runs: a
   consumer may have renewed the deadline, or claimed the reservation (which unregisters
   it). The script re-reads each deadline and the server clock atomically and skips any
   reservation that is no longer registered or no longer expired, so a renewal or claim
   that won the race is never undone; a claim that comes after the recovery finds the
   reservation gone and claims nothing.

3. **Abandoned processing entries.** Look at the newest ``batch`` pids (the head, where
   the fresh deliveries of a consumer that just died are) and one ``batch``-sized window of
   the older part at a cursor kept in ``reap-cursor.{q}``. The cursor counts from the tail
   (the oldest end), which new deliveries never shift, and moves on by the entries the
   window kept; past the head it wraps to the tail. A long history is thus swept over
   successive calls with bounded work per call.

   For each pid: an owner token whose consumer's heartbeat is missing is recovered as
   "dead" (``'d'``); a pid without an owner (a legacy PHP consumer that never renews) is
   recovered as "legacy" (``'l'``) once its envelope's timestamp is older than
   ``recovery_age`` seconds of server time. These reads are not atomic either, so
   ``recover_processing.lua`` re-checks each candidate: a dead candidate only if the
   owner token is still the one read and the heartbeat is still missing (a settle deletes
   the owner, a re-delivery rewrites it, a late renewal brings the heartbeat back: all
   three make it skip); a legacy candidate only if there is still no owner and the pid is
   still in processing. Recovering deletes the owner key, so the dead consumer's own
   settle or renewal, if it ever comes, finds a stale owner and changes nothing.

The server clock read here only chooses candidates; the scripts decide with the clock of the
node that holds the keys. On a Redis Cluster, TIME is sent to the node that serves the
queue's slot (as the client last saw it), so both clocks are normally the same.

Script errors about wrong key types surface as ``WrongTypeError``, raised before the
script's first write.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisClusterException, ResponseError

from broker.base import MAX_BATCH, MaintenanceReport, WrongTypeError
from broker.keys import QueueKeys, owner_consumer
from broker.scripts import Scripts

log = logging.getLogger(__name__)

#: Expired reservation keys handed to one recovery script call.
RESERVATION_SCAN = 100
#: Recovery script calls for expired reservations in one maintain() call.
RESERVATION_ROUNDS = 10
#: Upper bound of the default lock time: a holder that dies delays sweeps by at most this.
DEFAULT_LOCK_MS = 5_000

DEAD = "d"
LEGACY = "l"
REMOVED = frozenset({"ok", "missing"})  # statuses after which the pid left processing


@dataclass(frozen=True, slots=True)
class Candidate:
    """A processing entry that looked abandoned when it was read."""

    mode: str  # DEAD or LEGACY
    pid: str
    token: str = ""  # the owner token read (DEAD only)


@dataclass(frozen=True, slots=True)
class Sample:
    """The processing pids one call looks at, and where the older-part window was."""

    head: list[str]
    window: list[str]
    cursor: int

    def pids(self) -> list[str]:
        """Head then window, each pid once."""
        return list(dict.fromkeys([*self.head, *self.window]))


async def maintain(
    client: Any,
    scripts: Scripts,
    keys: QueueKeys,
    *,
    consumer_id: str,
    lease_ms: int,
    recovery_age: int,
    batch: int = MAX_BATCH,
    lock_ms: int | None = None,
) -> MaintenanceReport:
    """Recover expired reservations and abandoned processing entries (bounded work).

    ``batch`` (at most 1,000) bounds the pids looked at per part of the processing list and
    the items per script call. ``lock_ms`` defaults to the lease, at most 5 s.
    """
    batch = max(1, min(batch, MAX_BATCH))
    lock_ms = lock_ms or max(1, min(lease_ms, DEFAULT_LOCK_MS))
    holder = f"{consumer_id}:{os.urandom(8).hex()}"
    if not await client.set(keys.reap_lock, holder, nx=True, px=lock_ms):
        return MaintenanceReport(skipped=True)
    try:
        report = await _sweep(client, scripts, keys, consumer_id, recovery_age, batch)
    except BaseException:
        with contextlib.suppress(Exception):  # the lock expires anyway; keep the real error
            await scripts.call("unlock", [keys.reap_lock], [holder])
        raise
    await scripts.call("unlock", [keys.reap_lock], [holder])
    return report


async def _sweep(
    client: Any, scripts: Scripts, keys: QueueKeys, consumer_id: str, recovery_age: int,
    batch: int,
) -> MaintenanceReport:
    try:
        report = MaintenanceReport()
        report.expired_reservations = await recover_reservations(client, scripts, keys, batch)
        seconds, _ = await server_time(client, keys.ready)
        sample = await sample_processing(client, keys, batch)
        candidates = await find_candidates(
            client, keys, sample.pids(), now=int(seconds), recovery_age=recovery_age
        )
        statuses = await recover_candidates(
            scripts, keys, candidates, placeholder=consumer_id, chunk=batch
        )
        await _advance_cursor(client, keys, sample, candidates, statuses)
    except ResponseError as error:
        if "WRONGTYPE" in str(error):
            raise WrongTypeError(f"maintenance of queue {keys.queue!r}: {error}") from error
        raise
    for candidate, status in zip(candidates, statuses, strict=True):
        if status == "ok" and candidate.mode == DEAD:
            report.dead_consumers += 1
        elif status == "ok":
            report.legacy += 1
    if missing := statuses.count("missing"):
        log.warning("queue %s: removed %d processing entries without a job record",
                    keys.queue, missing)
    return report


async def recover_reservations(client: Any, scripts: Scripts, keys: QueueKeys, batch: int) -> int:
    """Return the payloads of expired reservations to the ready list; returns how many."""
    moved = 0
    for _ in range(RESERVATION_ROUNDS):
        seconds, micros = await server_time(client, keys.ready)
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        found = await client.zrangebyscore(
            keys.reservations, "-inf", now_ms, start=0, num=RESERVATION_SCAN
        )
        if not found:
            break
        step, done = await scripts.call(
            "recover_reservations", [keys.ready, keys.reservations, *found], [batch]
        )
        moved += int(step)
        if done == 0:  # every one was renewed or claimed meanwhile: nothing left to do now
            break
    return moved


async def server_time(client: Any, key: str) -> tuple[int, int]:
    """TIME of the server holding ``key``: a cluster client would ask any node otherwise."""
    node = None
    with contextlib.suppress(RedisClusterException):  # slot map not loaded: any clock will do
        node_of = getattr(client, "get_node_from_key", None)
        node = node_of(key) if node_of is not None else None
    if node is None:
        return await client.time()
    return await client.time(target_nodes=node)


async def sample_processing(client: Any, keys: QueueKeys, batch: int) -> Sample:
    """The newest ``batch`` pids, plus a ``batch``-sized window of the older part.

    The window starts ``cursor`` entries from the tail; a cursor that reached the head part
    wraps to the tail.
    """
    pipe = client.pipeline(transaction=False)
    pipe.llen(keys.processing)
    pipe.lrange(keys.processing, 0, batch - 1)
    pipe.get(keys.reap_cursor)
    length, head, stored = await pipe.execute()
    older = length - batch  # entries beyond the head part
    cursor = _int_or_zero(stored)
    if older <= 0 or cursor >= older:
        cursor = 0
    window: list[Any] = []
    if older > 0:
        window = await client.lrange(
            keys.processing, -min(cursor + batch, older), -(cursor + 1)
        )
    return Sample([_text(pid) for pid in head], [_text(pid) for pid in window], cursor)


async def find_candidates(
    client: Any, keys: QueueKeys, pids: Sequence[str], *, now: int, recovery_age: int
) -> list[Candidate]:
    """The pids that look abandoned now (``now`` in seconds of server time), in order."""
    if not pids:
        return []
    owners = [_text(owner) if owner is not None else None
              for owner in await client.mget([keys.owner(pid) for pid in pids])]
    dead = await _dead_consumers(client, keys, {owner_consumer(o) for o in owners if o})
    candidates: dict[str, Candidate] = {}
    for pid, owner in zip(pids, owners, strict=True):
        if owner and owner_consumer(owner) in dead:
            candidates[pid] = Candidate(DEAD, pid, owner)
    ownerless = [pid for pid, owner in zip(pids, owners, strict=True) if owner is None]
    if ownerless:
        records = await client.mget([keys.job(pid) for pid in ownerless])
        for pid, record in zip(ownerless, records, strict=True):
            if now - _published(pid, record) > recovery_age:
                candidates[pid] = Candidate(LEGACY, pid)
    return [candidates[pid] for pid in pids if pid in candidates]


async def recover_candidates(
    scripts: Scripts, keys: QueueKeys, candidates: Sequence[Candidate], *,
    placeholder: str, chunk: int = MAX_BATCH,
) -> list[str]:
    """Run ``recover_processing.lua`` on the candidates; one status per candidate.

    ``placeholder`` is a consumer id whose heartbeat key stands in for legacy items (the
    script does not read it; it only keeps every key of the call declared).
    """
    chunk = max(1, min(chunk, MAX_BATCH))
    fixed = [keys.ready, keys.processing, keys.stat("processing")]
    statuses: list[str] = []
    for start in range(0, len(candidates), chunk):
        part = candidates[start:start + chunk]
        item_keys: list[str] = []
        args: list[str] = []
        for candidate in part:
            consumer = owner_consumer(candidate.token) if candidate.mode == DEAD else placeholder
            item_keys += [keys.job(candidate.pid), keys.owner(candidate.pid),
                          keys.consumer(consumer)]
            args += [candidate.mode, candidate.pid, candidate.token]
        results = await scripts.call("recover_processing", [*fixed, *item_keys], args)
        statuses += [_text(status) for status in results]
    return statuses


async def _dead_consumers(client: Any, keys: QueueKeys, consumer_ids: set[str]) -> set[str]:
    """The consumers among ``consumer_ids`` whose heartbeat key is gone (one EXISTS each)."""
    if not consumer_ids:
        return set()
    ordered = sorted(consumer_ids)
    pipe = client.pipeline(transaction=False)
    for consumer_id in ordered:
        pipe.exists(keys.consumer(consumer_id))
    alive = await pipe.execute()
    return {cid for cid, exists in zip(ordered, alive, strict=True) if not exists}


async def _advance_cursor(
    client: Any, keys: QueueKeys, sample: Sample, candidates: Sequence[Candidate],
    statuses: Sequence[str],
) -> None:
    """Move the cursor past the window, minus what was removed from it.

    Removing entries inside the window moves the entries beyond it that many places toward
    the tail, so the first entry not yet seen is ``len(window) - removed`` further on.
    """
    in_window = set(sample.window) - set(sample.head)
    removed = sum(1 for candidate, status in zip(candidates, statuses, strict=True)
                  if status in REMOVED and candidate.pid in in_window)
    await client.set(keys.reap_cursor, sample.cursor + len(sample.window) - removed)


def _published(pid: str, record: bytes | str | None) -> int:
    """The envelope's timestamp (0 if undecodable: treated as old).

    Without a record (a legacy consumer's job key may carry a TTL), the time encoded in a
    PHP ``uniqid`` pid is used, so a pid that was settled a moment ago is not touched.
    """
    if record is None:
        return _pid_time(pid)
    try:
        timestamp = orjson.loads(record).get("timestamp")
    except (orjson.JSONDecodeError, AttributeError):
        return 0
    return timestamp if isinstance(timestamp, int) and not isinstance(timestamp, bool) else 0


def _pid_time(pid: str) -> int:
    try:
        return int(pid[:8], 16) if len(pid) >= 13 else 0
    except ValueError:
        return 0


def _int_or_zero(value: bytes | str | None) -> int:
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
