"""Maintenance of one Redis queue: return work that dead consumers left behind, as queue 5's
``maintain()`` does, so that it is safe beside PHP queue-5 workers on the same queue.

One ``maintain()`` call does a bounded amount of work, in three steps:

1. **Lock.** ``SET reap-lock <unix seconds> NX EX <maintenance interval>``. Like queue 5's,
   the lock is never released: its expiry is the fleet's sweep schedule (one sweep per
   interval across every supervisor and PHP worker of the queue). The lock only avoids
   duplicated work: every state change below is re-checked inside a script.

2. **Expired reservations.** ``expired.lua`` lists registered reservations whose deadline
   (whole seconds) has passed; ``recover.lua`` re-checks each deadline atomically and moves
   what they hold back to the ready list. A reservation claimed meanwhile (unregistered) is
   not touched.

3. **Processing entries**, in queue 5's bounded sweep: a window of at most ``scan`` pids
   ending ``retained`` entries from the tail (the oldest end), walked oldest first, with the
   cursor ``reap-cursor = "<retained>:<remaining>"`` shared with PHP workers; plus the newest
   ``scan`` pids at the head, where the deliveries of a consumer that just died are (they
   leave the cursor alone). For each pid:

   - a live claim key (renewed by its owner, PHP or Python) keeps it;
   - an owner known to be one of our supervisors (its token starts with a prefix in
     ``supervisor-tokens``, or it is a previous-format ``<consumer>:<nonce>`` token) that is
     still alive (its record exists) keeps it, whatever its age;
   - an owner known to be one of ours and dead (its record expired or was deleted at exit):
     recovered as soon as its claim is gone;
   - any other owner, or none: queue 5's rule, recovered only once the claim is gone *and*
     the envelope is older than ``recovery_age`` (queue 5's ``reapAfter``). Queue-5 workers
     of adapters that never renew (Workerman, KubernetesJob; a Swoole worker whose renewal
     coroutine is starved) write an owner key and a claim that lapses while their handler
     still runs: only the age tells that they are gone. A missing or unreadable registry
     entry is never a reason to take anything: it falls back to this rule;
   - no job record and no owner: a dangling pid, removed.

   Recovery (``reclaim.lua``, which re-checks owner, claim, record and presence) requeues the
   same pid with a new timestamp and ``attempts + 1`` at the producer end, or moves it to
   ``dead`` once that would reach ``max_attempts``. Deleting the owner key makes any late
   settle or renewal by the old owner stale.

4. **The registry** forgets supervisors that are gone and could not have claimed anything
   younger than ``recovery_age`` (queue 5's rule covers all they held), a bounded sample per
   sweep.

The clock: candidates are chosen with the server's TIME (of the node holding the queue on a
Cluster); the scripts decide with their own.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from redis.exceptions import RedisClusterException, ResponseError

from broker import envelope
from broker.base import MAX_BATCH, MaintenanceReport, WrongTypeError
from broker.failure import Failure, record_ttl
from broker.redis.keys import QueueKeys
from broker.redis.scripts import Scripts
from broker.retry import RetryPolicy

log = logging.getLogger(__name__)

#: expired/recover rounds in one maintain() call (each moves at most MAX_BATCH payloads).
RESERVATION_ROUNDS = 4
#: promote.lua calls in one maintain() call (each moves at most MAX_BATCH retries).
PROMOTE_ROUNDS = 4
#: Seconds an expired reservation found EMPTY stays registered past its deadline (issue
#: 23.3). It may belong to a consumer (a PHP worker) frozen after registering it and before
#: sending its blocking move; a move that lands while it is registered is returned by the
#: next sweep, one that lands after it went is stranded. The deadline already holds the
#: lease and the blocking timeout, so a move sent up to lease + grace after the registration
#: is covered (a freeze of up to 90 + 600 s for a PHP worker). Operator sweeps (``recover``,
#: ``drain``) use none, as queue 5's own sweep does, so that they can empty the registry.
RESERVATION_GRACE = 600
#: List entries LREM may compare in one reclaim call, summed over its items (each scans
#: from the nearer end), and items per call: together they keep one call within a few
#: milliseconds of server time, however long the list.
LREM_BUDGET = 50_000
RECLAIM_ITEMS = 250

REQUEUE, DEAD, DANGLING = "q", "d", "x"
#: The longest job record a sweep or an operator's retry reads when the job sets no envelope
#: limit of its own (records.lua answers a longer one with its length).
RECORD_LIMIT = 64 << 20
#: What the registry says of an owner token: one of our supervisors, alive or gone.
LIVE, GONE = "live", "gone"
#: Registry entries looked at per sweep for forgetting.
REGISTRY_SAMPLE = 100
_TOKEN = re.compile(r"[0-9a-f]{32}")
#: The owner-token prefix a supervisor registers (the rest of a token is per reservation).
PREFIX_HEX = 16
_LEADING_INT = re.compile(r"[ \t\n\r\v\f]*[+-]?\d+")
_UNIQID = re.compile(r"[0-9a-f]{13}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A processing entry that looked recoverable when it was read."""

    mode: str  # REQUEUE, DEAD or DANGLING
    pid: str
    owner: str = ""  # the owner token read ('' = none)
    replacement: bytes = b""  # the requeued envelope (REQUEUE only)
    marker: str | None = None  # the coalescing marker of a keyed message
    from_tail: bool = False  # LREM from the tail (the pid sat nearer that end)
    distance: int = 0  # entries between the pid and the end LREM starts from
    #: The failure record: DEAD keeps it beside the job (supervisor-errors); both push it
    #: onto the job's history (supervisor-failures).
    failure: bytes = b""


@dataclass(slots=True)
class Window:
    """The processing pids one call looks at, where they sat, and the cursor."""

    size: int
    head: list[str]
    window: list[str]  # oldest first
    window_start: int  # index (from the head) of the window's newest entry
    retained: int
    remaining: int


async def maintain(
    client: Any,
    scripts: Scripts,
    keys: QueueKeys,
    *,
    lock_seconds: int,
    recovery_age: int,
    max_attempts: int,
    job_ttl: int = 0,
    scan: int = MAX_BATCH,
    force: bool = False,
    max_record_bytes: int = RECORD_LIMIT,
) -> MaintenanceReport:
    """One bounded sweep, if the fleet's reap lock is free (else ``skipped``).

    ``force`` sweeps without the lock (an operator's ``recover``: the scripts re-check
    everything, so a sweep beside another one recovers nothing twice).
    """
    taken = force or await client.set(
        keys.reap_lock, str(int(time.time())), nx=True, ex=lock_seconds
    )
    if not taken:
        return MaintenanceReport(skipped=True)
    try:
        report = MaintenanceReport()
        report.expired_reservations = await recover_reservations(
            scripts, keys, grace=0 if force else RESERVATION_GRACE)
        await reap(client, scripts, keys, report, recovery_age=recovery_age,
                   max_attempts=max_attempts, job_ttl=job_ttl, scan=scan,
                   max_record_bytes=max_record_bytes)
        await forget_gone(client, keys, recovery_age=recovery_age)
    except ResponseError as error:
        if "WRONGTYPE" in str(error):
            raise WrongTypeError(f"maintenance of queue {keys.queue!r}: {error}") from error
        raise
    return report


async def promote(scripts: Scripts, keys: QueueKeys, *, everything: bool = False,
                  rounds: int = PROMOTE_ROUNDS) -> int:
    """Move delayed retries to the ready list: those due, or (``everything``, the rollback)
    all of them; returns how many. At most ``rounds`` calls of MAX_BATCH each (0: until
    none is left)."""
    moved, calls = 0, 0
    while not rounds or calls < rounds:
        step = int(await scripts.call("promote", [keys.delayed, keys.ready],
                                      [MAX_BATCH, "all" if everything else "due"]))
        moved += step
        calls += 1
        if step < MAX_BATCH:
            break
    return moved


async def recover_reservations(
    scripts: Scripts, keys: QueueKeys, *, grace: int = RESERVATION_GRACE
) -> int:
    """Return the payloads of expired reservations to the ready list; returns how many.

    An expired reservation found empty stays registered until ``grace`` seconds past its
    deadline (see ``RESERVATION_GRACE``); those already seen are skipped in later rounds."""
    moved = kept = 0
    for _ in range(RESERVATION_ROUNDS):
        found = await scripts.call("expired", [keys.reservations], [MAX_BATCH, kept])
        if not found:
            break
        step, still = await scripts.call(
            "recover", [keys.reservations, keys.ready, *map(_text, found)], [MAX_BATCH, grace]
        )
        moved += int(step)
        kept += int(still)
        if len(found) < MAX_BATCH and step < MAX_BATCH:
            break  # every expired one was handled in this round
    return moved


async def reap(
    client: Any, scripts: Scripts, keys: QueueKeys, report: MaintenanceReport, *,
    recovery_age: int, max_attempts: int, job_ttl: int = 0, scan: int = MAX_BATCH,
    max_record_bytes: int = RECORD_LIMIT,
) -> None:
    """Recover abandoned processing entries from the head and one cursor window."""
    scan = max(1, min(scan, MAX_BATCH))
    sample = await sample_processing(client, keys, scan)
    if sample is None:
        return
    now, _ = await server_time(client, keys.ready)
    # Where each pid was read (index from the head); a pid in both parts counts as the
    # window's, since the cursor's arithmetic depends on what leaves the window.
    oldest = sample.window_start + len(sample.window) - 1  # the window is oldest first
    positions = {pid: oldest - offset for offset, pid in enumerate(sample.window)}
    for index, pid in enumerate(sample.head):
        positions.setdefault(pid, index)
    state = await _read_state(client, scripts, keys, list(positions), now=now,
                              recovery_age=recovery_age, max_record_bytes=max_record_bytes)
    candidates: list[Candidate] = []
    for pid, index in positions.items():
        if pid not in state:
            continue  # live, or young by its pid: kept
        candidate = judge(pid, *state[pid], keys=keys, now=now, recovery_age=recovery_age,
                          max_attempts=max_attempts)
        if candidate:
            candidates.append(_from_end(candidate, index, sample.size))
    applied = await reclaim(scripts, keys, candidates, job_ttl=job_ttl)
    removed = {c.pid for c, done in zip(candidates, applied, strict=True) if done}
    for candidate, done in zip(candidates, applied, strict=True):
        if done and candidate.mode != DANGLING:
            if candidate.owner:
                report.dead_consumers += 1
            else:
                report.legacy += 1
    # queue 5's cursor: every entry looked at in the window spends one of `remaining`; the
    # ones still there afterwards count as retained (they stay between us and the tail).
    retained = sample.retained + sum(1 for pid in sample.window if pid not in removed)
    remaining = sample.remaining - len(sample.window)
    await client.set(keys.reap_cursor, f"{retained}:{remaining}")


def judge(
    pid: str, record: bytes | int | None, owner: bytes | None, holder: str = "", *,
    keys: QueueKeys, now: int, recovery_age: int, max_attempts: int,
) -> Candidate | None:
    """What to do with one processing entry whose claim key was gone, from what was read of
    it (None: keep it). ``holder``: LIVE or GONE if the owner is known to be one of our
    supervisors, '' if not (queue 5's rule: kept while younger than ``recovery_age``).
    ``record`` is its length (an int) when it was longer than the sweep reads."""
    if holder == LIVE:
        return None  # ours and alive: it renews, or settles, what it holds
    owner_text = _text(owner) if owner is not None else ""
    if record is None:
        if owner is not None:
            log.warning("queue %s: processing entry %s has an owner but no job record; left "
                        "alone", keys.queue, pid)
            return None
        return Candidate(DANGLING, pid)
    if isinstance(record, int):
        return _oversized(pid, record, owner_text, holder, keys=keys, now=now,
                          recovery_age=recovery_age)
    try:
        decoded: dict[str, Any] | None = envelope.decode(record)
    except envelope.MalformedEnvelope:
        decoded = None  # kept as it is in dead: no handler could run it
    if holder != GONE and now - _published(pid, decoded) <= recovery_age:
        return None  # a queue-5 worker that never renews (or a 1.x one) may still run it
    return verdict(pid, decoded, owner_text, keys=keys, now=now, max_attempts=max_attempts)


def _oversized(
    pid: str, length: int, owner: str, holder: str, *,
    keys: QueueKeys, now: int, recovery_age: int,
) -> Candidate | None:
    """A record too long to read (a PHP worker claimed it; none of our handlers could run
    it): its age is only known from a ``uniqid`` pid. Recovered unread, to dead, once it is
    ours and gone or old by its pid; kept while its age cannot be known (its own owner, or
    a PHP sweep, which reads it, recovers it)."""
    published = _uniqid_seconds(pid)
    if holder != GONE and (published is None or now - published <= recovery_age):
        return None
    log.error("queue %s: job %s is %d bytes, more than a sweep reads: recovered unread, "
              "moved to dead", keys.queue, pid, length)
    return Candidate(DEAD, pid, owner, failure=lapsed(
        owner, now, message=f"its job record is {length} bytes, more than a sweep reads: "
        "recovered unread").encode())


def verdict(
    pid: str, decoded: dict[str, Any] | None, owner: str, *,
    keys: QueueKeys, now: int, max_attempts: int, lost: Failure | None = None,
) -> Candidate:
    """Requeue (same pid, timestamp ``now``, one more attempt) or dead: the one rule for a
    sweep's candidates and for what a supervisor still owns at exit. A dead one carries
    its failure record: ``lost`` (why it was abandoned), else a lapsed lease."""
    marker = keys.marker(decoded) if decoded is not None else None
    run = RetryPolicy.next_attempts(decoded["attempts"]) if decoded is not None else 0
    failure = lost or lapsed(owner, now)
    if decoded is not None and not failure.published:
        failure = failure.replace(published=float(decoded["timestamp"]))
    if decoded is None:
        return Candidate(DEAD, pid, owner, marker=marker, failure=failure.replace(
            message=failure.message + "; its job record is not an envelope: no handler "
            "could run it").encode())
    if RetryPolicy(max_attempts).exhausted(decoded["attempts"]):
        return Candidate(DEAD, pid, owner, marker=marker, failure=failure.replace(
            attempt=run, message=f"{failure.message}; that was attempt {run} of "
            f"{max_attempts}").encode())
    try:
        requeued = envelope.requeued(decoded, run, now)
    except envelope.Unencodable as error:  # this entry alone: the sweep goes on
        log.error("queue %s: job %s cannot be requeued as PHP would write it (%s): moved to "
                  "dead", keys.queue, pid, error)
        return Candidate(DEAD, pid, owner, marker=marker, failure=failure.replace(
            attempt=run, message=f"{failure.message}; its retry cannot be written as PHP "
            f"would ({error})").encode())
    return Candidate(REQUEUE, pid, owner, requeued, marker, failure=failure.replace(
        attempt=run, outcome="retrying").encode())


def lapsed(owner: str, now: float, *, message: str = "") -> Failure:
    """The failure record of a job recovered from a consumer that stopped renewing it."""
    holder = f"owner token {owner}" if owner else "no owner (a legacy consumer)"
    return Failure(
        error="LeaseLapsed", outcome="dead", at=float(now), consumer="recovery",
        message=message or f"the claim of {holder} lapsed: its consumer stopped renewing it "
        "(killed, frozen or cut off) while the job ran",
    )


def token_prefix(token: str) -> str | None:
    """The registry prefix an owner token (32 lowercase hex) starts with; None for any other
    text (a previous-format ``<consumer>:<nonce>`` token, or garbage)."""
    return token[:PREFIX_HEX] if _TOKEN.fullmatch(token) else None


async def holders(client: Any, keys: QueueKeys, owners: Iterable[bytes]) -> dict[bytes, str]:
    """The owner tokens known to be our supervisors', each LIVE or GONE; the others are left
    out (queue 5's rule applies to them). A token is ours if it starts with a prefix in the
    registry (or is a previous-format ``<consumer>:<nonce>``, which PHP never writes); it is
    GONE once that supervisor's record (the previous format's heartbeat) has expired. An
    unreadable registry or entry knows nothing."""
    by_prefix: dict[str, list[bytes]] = {}
    by_legacy: dict[str, list[bytes]] = {}
    for token in set(owners):
        text = _text(token)
        if (prefix := token_prefix(text)) is not None:
            by_prefix.setdefault(prefix, []).append(token)
        elif ":" in text:
            by_legacy.setdefault(text.rpartition(":")[0], []).append(token)
    consumers: dict[str, list[bytes]] = {}  # record key -> tokens
    if by_prefix:
        try:
            entries = await client.hmget(keys.supervisor_tokens, list(by_prefix))
        except ResponseError:  # not a hash: nothing is known to be ours
            entries = [None] * len(by_prefix)
        for prefix, entry in zip(by_prefix, entries, strict=True):
            consumer = _registered_consumer(entry)
            if consumer is not None:
                consumers.setdefault(keys.supervisor(consumer), []).extend(by_prefix[prefix])
    for consumer, tokens in by_legacy.items():
        consumers.setdefault(keys.legacy_consumer(consumer), []).extend(tokens)
    if not consumers:
        return {}
    alive = await client.mget(list(consumers))
    return {token: LIVE if record is not None else GONE
            for (_, tokens), record in zip(consumers.items(), alive, strict=True)
            for token in tokens}


def _registered_consumer(entry: bytes | None) -> str | None:
    """The consumer id of a registry entry ``"<until> <consumer id>"`` (None: unreadable)."""
    until, _, consumer = _text(entry or b"").partition(" ")
    return consumer if until.isdecimal() and consumer else None


async def forget_gone(client: Any, keys: QueueKeys, *, recovery_age: int) -> int:
    """Remove registry entries of supervisors that are gone and could not have claimed
    anything in the last ``recovery_age`` seconds: queue 5's rule already covers whatever
    they held. Looks at a random sample; returns how many went."""
    try:
        sample = await client.hrandfield(keys.supervisor_tokens, REGISTRY_SAMPLE, withvalues=True)
    except ResponseError:  # not a hash, or a server without HRANDFIELD: nothing to forget
        return 0
    if not sample:
        return 0
    now, _ = await server_time(client, keys.ready)
    old = {}
    for prefix, entry in zip(sample[::2], sample[1::2], strict=True):
        until, _, consumer = _text(entry).partition(" ")
        if until.isdecimal() and int(until) < now - recovery_age and consumer:
            old[prefix] = keys.supervisor(consumer)
    if not old:
        return 0
    records = await client.mget(list(old.values()))
    gone = [prefix for prefix, record in zip(old, records, strict=True) if record is None]
    return int(await client.hdel(keys.supervisor_tokens, *gone)) if gone else 0


async def reclaim(
    scripts: Scripts, keys: QueueKeys, candidates: Sequence[Candidate], *, job_ttl: int = 0,
) -> list[bool]:
    """Run ``reclaim.lua`` over the candidates, in calls bounded by RECLAIM_ITEMS items and
    LREM_BUDGET scanned entries; one flag (applied) per candidate."""
    fixed = [keys.ready, keys.dead, keys.processing, keys.stat("processing")]
    applied: list[bool] = []
    for part in _calls(candidates):
        item_keys: list[str] = []
        args: list[Any] = [job_ttl, record_ttl(job_ttl)]
        for c in part:
            job = keys.job(c.pid)
            item_keys += [keys.owner(c.pid), keys.claim(c.pid), job, c.marker or job,
                          keys.error(c.pid), keys.failures(c.pid)]
            args += [c.mode, c.owner, c.pid, c.replacement, -1 if c.from_tail else 1,
                     1 if c.marker else 0, c.failure]
        applied += [flag == 1 for flag in await scripts.call("reclaim", [*fixed, *item_keys], args)]
    return applied


def _calls(candidates: Sequence[Candidate]) -> list[list[Candidate]]:
    calls: list[list[Candidate]] = [[]]
    cost = 0
    for candidate in candidates:
        full = len(calls[-1]) >= RECLAIM_ITEMS or cost + candidate.distance > LREM_BUDGET
        if calls[-1] and full:
            calls.append([])
            cost = 0
        calls[-1].append(candidate)
        cost += candidate.distance
    return [call for call in calls if call]


def _from_end(candidate: Candidate, index: int, size: int) -> Candidate:
    """Mark the end LREM should scan from: the one nearer to where the pid was read."""
    from_tail = size - 1 - index < index
    return replace(candidate, from_tail=from_tail,
                   distance=(size - index) if from_tail else index + 1)


async def sample_processing(client: Any, keys: QueueKeys, scan: int) -> Window | None:
    """The newest ``scan`` pids and queue 5's cursor window (None: processing is empty)."""
    pipe = client.pipeline(transaction=False)
    pipe.llen(keys.processing)
    pipe.lrange(keys.processing, 0, scan - 1)
    pipe.get(keys.reap_cursor)
    size, head, stored = await pipe.execute()
    if not size:
        return None
    retained, remaining = parse_cursor(stored)
    if retained < 0 or retained >= size or remaining <= 0:
        retained, remaining = 0, size
    remaining = min(remaining, size - retained)
    length = min(scan, remaining)
    start = max(0, size - retained - length)
    window = await client.lrange(keys.processing, start, start + length - 1)
    return Window(size, _pids(head), _pids(reversed(window)), start, retained, remaining)


def parse_cursor(stored: bytes | str | None) -> tuple[int, int]:
    """``"<retained>:<remaining>"`` read as PHP's ``(int)`` casts read it (junk reads as 0)."""
    parts = (_text(stored) if stored is not None else "").split(":")
    return _php_int(parts[0]), _php_int(parts[1] if len(parts) > 1 else "")


async def _read_state(
    client: Any, scripts: Scripts, keys: QueueKeys, pids: Sequence[str], *, now: int,
    recovery_age: int, max_record_bytes: int = RECORD_LIMIT,
) -> dict[str, tuple[bytes | int | None, bytes | None, str]]:
    """Job record, owner and holder (see ``judge``) of each pid that may need recovery; pids
    left out are kept. A live claim keeps a pid; so does an owner that is one of our live
    supervisors, and an owner-less pid whose ``uniqid`` time is younger than
    ``recovery_age`` (its record is not read: a long young history of a 1.x consumer costs
    no record reads). Plain MGETs: a cluster client refuses MGET in a pipeline."""
    if not pids:
        return {}
    claims = await client.mget([keys.claim(pid) for pid in pids])
    idle = [pid for pid, claim in zip(pids, claims, strict=True) if claim is None]
    if not idle:
        return {}
    owners = dict(zip(idle, await client.mget([keys.owner(pid) for pid in idle]), strict=True))
    known = await holders(client, keys, [owner for owner in owners.values() if owner])
    held = {pid: known.get(owner, "") if owner is not None else ""
            for pid, owner in owners.items()}
    wanted = [pid for pid in idle if held[pid] != LIVE and (
        owners[pid] is not None or not _young_by_pid(pid, now, recovery_age))]
    if not wanted:
        return {}
    # Through records.lua: a record over the limit is answered by its length, unread.
    read: list[bytes | int | None] = []
    for start in range(0, len(wanted), MAX_BATCH):
        read += await scripts.call("records", [keys.job(pid) for pid in
                                               wanted[start:start + MAX_BATCH]], [max_record_bytes])
    records = dict(zip(wanted, read, strict=True))
    settled = [pid for pid in wanted if records[pid] is None and owners[pid] is not None]
    if settled:  # read after the owner: settled meanwhile, or really without a record?
        for pid, owner in zip(settled, await client.mget([keys.owner(p) for p in settled]),
                              strict=True):
            owners[pid] = owner
    return {pid: (records[pid], owners[pid], held[pid]) for pid in wanted
            if not (records[pid] is None and pid in settled and owners[pid] is None)}


def _young_by_pid(pid: str, now: int, recovery_age: int) -> bool:
    """True if ``pid`` looks like PHP's ``uniqid`` (13 hex digits first) and the time in it
    is younger than ``recovery_age``: its envelope, published then or requeued later, is
    at least as young. Anything else is not judged young here."""
    published = _uniqid_seconds(pid) if _UNIQID.match(pid) else None
    return published is not None and published <= now + 60 and now - published <= recovery_age


async def server_time(client: Any, key: str) -> tuple[int, int]:
    """TIME of the server holding ``key``: a cluster client would ask any node otherwise."""
    node = None
    with contextlib.suppress(RedisClusterException):  # slot map not loaded: any clock will do
        node_of = getattr(client, "get_node_from_key", None)
        node = node_of(key) if node_of is not None else None
    if node is None:
        seconds, micros = await client.time()
    else:
        seconds, micros = await client.time(target_nodes=node)
    return int(seconds), int(micros)


def _published(pid: str, decoded: dict[str, Any] | None) -> int:
    """The envelope's timestamp; for an unreadable record, the time in a ``uniqid`` pid."""
    if decoded is not None:
        return int(decoded["timestamp"])
    return _uniqid_seconds(pid) or 0


def _uniqid_seconds(pid: str) -> int | None:
    """The seconds in the first 8 hex digits of a ``uniqid`` pid (None: not one)."""
    try:
        return int(pid[:8], 16) if len(pid) >= 13 else None
    except ValueError:
        return None


def _php_int(text: str) -> int:
    """PHP's ``(int)`` of a string: its leading integer (after white space), else 0."""
    match = _LEADING_INT.match(text)
    return int(match.group(0)) if match else 0


def _pids(values: Any) -> list[str]:
    return [_text(value) for value in values]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
