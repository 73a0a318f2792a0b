"""Read one Redis queue's state: sizes, reservations, supervisors, owner records, counters
(``status``, ``check``, ``drain`` and the dashboard; the running jobs each supervisor's copy
names are added by ``supervisor.ops.running``).

Keys that carry a pid, token or consumer id cannot be listed by name, so they are found
with ``SCAN MATCH <prefix>* COUNT 1000``: bounded work per round trip, never ``KEYS``.
(A queue whose name is another's plus ``.suffix`` shares its patterns; avoid such names.)

A supervisor of ours is alive while its record (``supervisors.{q}.<id>``) exists or its
entry in the token registry is current (``"<until> <id>"``, until in the future): either
is renewed with its deliveries and lapses a lease after the last renewal (a supervisor
killed with SIGKILL counts until then); a graceful stop deletes the record and ends the
entry (``extend.lua`` with lease 0). ``check`` and ``drain`` fail while one is alive.
Once none is, an empty registration of ours before its deadline is a leftover too: the
blocking receive of one killed while it waited, registered past its lapse.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from broker.redis.gauges import overdue
from broker.redis.keys import MS_DEADLINES_FROM, QueueKeys, glob_escape
from broker.redis.recovery import server_time, token_prefix

#: Keys looked at per SCAN call.
SCAN_COUNT = 1000
#: The largest reservation list (all of it, as MEMORY USAGE counts) whose payloads status
#: reads to show them.
PEEK_BYTES = 1 << 20
#: Reservations, payloads, consumers and key names listed in full at most.
SHOW = 1000
STATS = ("total", "processing", "success", "failed")


@dataclass(slots=True)
class Found:
    """Keys with a prefix: how many, and the first few of them by name."""

    count: int = 0
    names: list[str] = field(default_factory=list)

    def add(self, name: str, show: int) -> None:
        """Count ``name``; keep it if fewer than ``show`` are kept."""
        self.count += 1
        if len(self.names) < show:
            self.names.append(name)


@dataclass(slots=True)
class Leftovers:
    """What a stopped supervisor may leave behind: the rollback check reads these. Only
    what is this project's supervisors' counts (its token starts with a prefix in the token
    registry, or is a previous-format ``<consumer>:<nonce>``): what other consumers (PHP
    queue-5 workers, running during a rollback) hold is theirs, counted in ``others``."""

    #: Registered reservations of ours: expired or holding payloads (with none of ours
    #: alive: any)
    registered: Found
    lists: Found  # reservation list keys of ours (registered or not)
    owners: Found  # owner records of deliveries of ours
    #: Live heartbeats of the previous format's supervisors (``consumers.{q}.*``): they must
    #: be stopped before this version runs, since their recovery takes every delivery whose
    #: owner token has no consumer id in it (this version's and PHP workers').
    previous: Found = field(default_factory=Found)
    #: Reservation lists and owner records of other consumers (information only).
    others: Found = field(default_factory=Found)
    #: Retries waiting for their backoff in ``supervisor-delayed.{q}``: PHP workers never
    #: read that set, so with no supervisor left to promote them they would wait forever.
    delayed: int = 0
    #: Seconds the oldest of them is past its due time (0: none is due yet).
    overdue: int = 0
    #: Supervisors of ours alive on the queue (``live_supervisors``): what they hold is
    #: not left behind yet, and they may still reserve, own and delay more.
    alive: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.registered.count or self.lists.count or self.owners.count
                    or self.previous.count or self.delayed or self.alive)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"empty": self.empty}


async def scan_prefix(client: Any, prefix: str, show: int = SHOW) -> Found:
    """Every key that starts with ``prefix`` (counted), the first ``show`` by name."""
    found = Found()
    async for key in client.scan_iter(match=glob_escape(prefix) + "*", count=SCAN_COUNT):
        found.add(_text(key), show)
    found.names.sort()
    return found


async def leftovers(client: Any, keys: QueueKeys, show: int = SHOW) -> Leftovers:
    ours = await our_prefixes(client, keys)
    others = Found()
    reservation = keys.reservation("")
    stale, blocking = await stale_registrations(client, keys, SHOW_ALL)
    lists = _split(await scan_prefix(client, reservation, SHOW_ALL), reservation, ours, others,
                   show)
    owners = await owner_records(client, keys, ours, others, show)
    previous = await scan_prefix(client, keys.legacy_consumer(""), show)
    others.names.sort()
    delayed, overdue = await delayed_retries(client, keys)
    alive = await live_supervisors(client, keys)  # last: one that started meanwhile counts
    if not alive:
        # No receive of ours is blocked in an empty registration before its deadline: one
        # there is a killed supervisor's, registered until lease + block_timeout after it
        # was made, past that supervisor's lapse.
        for name in blocking.names:
            stale.add(name, SHOW_ALL)
    registered = _split(stale, reservation, ours, Found(), show)  # others' counted in lists
    return Leftovers(registered, lists, owners, previous, others, delayed, int(overdue), alive)


async def delayed_retries(client: Any, keys: QueueKeys) -> tuple[int, float]:
    """How many retries wait in the delayed set, and how long the oldest is overdue."""
    count = await client.zcard(keys.delayed)
    first = await client.zrange(keys.delayed, 0, 0, withscores=True) if count else []
    now, _ = await server_time(client, keys.delayed)
    return count, overdue(first, now)


#: Names kept while sorting leftovers into ours and others' (all of them).
SHOW_ALL = 10**9


async def our_prefixes(client: Any, keys: QueueKeys) -> set[str]:
    """The owner-token prefixes registered by this project's supervisors."""
    prefixes: set[str] = set()
    async for prefix, _ in client.hscan_iter(keys.supervisor_tokens, count=SCAN_COUNT):
        prefixes.add(_text(prefix))
    return prefixes


def is_ours(token: str, prefixes: set[str]) -> bool:
    """A token of one of our supervisors: a registered prefix, or the previous format's
    ``<consumer>:<nonce>`` (PHP writes 32 hex only)."""
    return token_prefix(token) in prefixes or ":" in token


def _split(found: Found, prefix: str, ours: set[str], others: Found, show: int) -> Found:
    """The keys of ``found`` whose token (after ``prefix``) is ours; the rest go to
    ``others``."""
    mine = Found()
    for name in found.names:
        (mine if is_ours(name[len(prefix):], ours) else others).add(name, show)
    return mine


async def owner_records(
    client: Any, keys: QueueKeys, ours: set[str], others: Found, show: int,
) -> Found:
    """Owner records whose token is ours (the others' counted in ``others``)."""
    names = (await scan_prefix(client, keys.owner(""), SHOW_ALL)).names
    mine = Found()
    for start in range(0, len(names), SCAN_COUNT):
        chunk = names[start:start + SCAN_COUNT]
        for name, token in zip(chunk, await client.mget(chunk), strict=True):
            if token is None:
                continue  # settled meanwhile
            (mine if is_ours(_text(token), ours) else others).add(name, show)
    return mine


async def stale_registrations(
    client: Any, keys: QueueKeys, show: int = SHOW
) -> tuple[Found, Found]:
    """Registered reservations that are leftovers: expired, or holding payloads; and apart,
    the empty ones before their deadline: blocking receives (a supervisor's or a PHP
    worker's), left behind only if their consumer is gone."""
    now_ms = await server_ms(client)
    found, blocking = Found(), Found()
    start = 0
    while batch := await client.zrange(keys.reservations, start, start + SCAN_COUNT - 1,
                                       withscores=True):
        start += len(batch)
        pipe = client.pipeline(transaction=False)
        for key, _ in batch:
            pipe.llen(key)
        for (key, score), length in zip(batch, await pipe.execute(), strict=True):
            stale = length or deadline_in_ms(score) <= now_ms
            (found if stale else blocking).add(_text(key), show)
    return found, blocking


async def queue_status(client: Any, keys: QueueKeys, show: int = SHOW) -> dict[str, Any]:
    """Everything ``status`` prints, as a JSON-ready dict, but the running jobs (the caller
    adds those to each of ``supervisors``: ``supervisor.ops.running.add_redis_copies``)."""
    pipe = client.pipeline(transaction=False)
    for key in (keys.ready, keys.processing, keys.failed, keys.dead, keys.poison):
        pipe.llen(key)
    pipe.zcard(keys.delayed)
    pipe.zrange(keys.delayed, 0, 0, withscores=True)
    for name in STATS:  # one GET each: a Redis Cluster pipeline refuses MGET
        pipe.get(keys.stat(name))
    ready, processing, failed, dead, poison, delayed, first, *stats = await pipe.execute()
    owners = await scan_prefix(client, keys.owner(""), show=0)
    now, _ = await server_time(client, keys.delayed)
    listed = await supervisors(client, keys, show)
    return {
        "queue": keys.queue,
        "namespace": keys.namespace,
        "ready": ready,
        "processing": processing,
        "delayed": {"count": delayed, "next_due": int(first[0][1]) if first else None,
                    "overdue": int(overdue(first, now))},
        "reservations": await reservations(client, keys, show),
        "failed": failed,
        "dead": dead,
        "poison": poison,
        "owners": owners.count,
        "supervisors": listed,
        "previous_format": (await scan_prefix(client, keys.legacy_consumer(""), 0)).count,
        "stats": {name: _counter(value) for name, value in zip(STATS, stats, strict=True)},
    }


async def reservations(client: Any, keys: QueueKeys, show: int = SHOW) -> dict[str, Any]:
    """Registered reservations with their deadlines and payloads (at most ``show`` each)."""
    count = await client.zcard(keys.reservations)
    registered = await client.zrange(keys.reservations, 0, show - 1, withscores=True)
    now_ms = await server_ms(client)
    pipe = client.pipeline(transaction=False)
    for key, _ in registered:
        pipe.llen(key)
        pipe.memory_usage(key, samples=0)
    sizes = await pipe.execute()
    # Payloads are read only from lists whose whole size is small: a reservation can hold
    # payloads of any size (a PHP worker takes them all), and status must never pull one in.
    pipe = client.pipeline(transaction=False)
    readable = [key for index, (key, _) in enumerate(registered)
                if (sizes[2 * index + 1] or 0) <= PEEK_BYTES]
    for key in readable:
        pipe.lrange(key, 0, show - 1)
    peeked = dict(zip(readable, await pipe.execute() if readable else [], strict=True))
    lists, total, expired, budget = [], 0, 0, show
    for index, (key, deadline) in enumerate(registered):
        length = sizes[2 * index]
        payloads = peeked.get(key, [])
        if key not in peeked and length:
            payloads = [f"({sizes[2 * index + 1]:,} bytes in all: not read)".encode()]
        total += length
        deadline_ms = deadline_in_ms(deadline)
        expired += deadline_ms <= now_ms
        shown = [_text(raw) for raw in payloads[:budget]]
        budget -= len(shown)
        lists.append({
            "key": _text(key), "deadline_ms": deadline_ms,
            "expires_in_ms": deadline_ms - now_ms, "size": length, "payloads": shown,
        })
    return {"count": count, "payloads": total, "expired": expired, "lists": lists}


async def supervisors(client: Any, keys: QueueKeys, show: int = SHOW) -> list[dict[str, Any]]:
    """Running supervisors by their informational records: id, host and pid, time left."""
    found = await scan_prefix(client, keys.supervisor(""), show)
    pipe = client.pipeline(transaction=False)
    for name in found.names:
        pipe.get(name)
        pipe.pttl(name)
    replies = await pipe.execute() if found.names else []
    prefix = len(keys.supervisor(""))
    listed = []
    for index, name in enumerate(found.names):
        value, ttl = replies[2 * index], replies[2 * index + 1]
        if value is not None:  # not expired between the scan and now
            listed.append({"id": name[prefix:], "where": _text(value), "ttl_ms": ttl})
    return listed


async def named_supervisors(client: Any, keys: QueueKeys, consumers: list[str]
                            ) -> list[dict[str, Any]]:
    """The records of the supervisors ``consumers`` names (the dashboard finds them in the
    token registry: no ``SCAN``), as ``supervisors`` gives them; one that has none (stopped
    meanwhile) is left out. One pipeline of a ``GET`` and a ``PTTL`` each."""
    if not consumers:
        return []
    pipe = client.pipeline(transaction=False)
    for consumer in consumers:
        pipe.get(keys.supervisor(consumer))
        pipe.pttl(keys.supervisor(consumer))
    replies = await pipe.execute()
    return [{"id": consumer, "where": _text(replies[2 * index]), "ttl_ms": replies[2 * index + 1]}
            for index, consumer in enumerate(consumers) if replies[2 * index] is not None]


async def live_supervisors(client: Any, keys: QueueKeys) -> list[dict[str, Any]]:
    """Supervisors of ours alive on the queue: a record, or a current registry entry (one
    without the other: a record evicted or deleted by hand, or a supervisor of a version
    that left its entry current at a graceful stop). Each with its consumer id, where it
    runs ("host pid" from the record, None without one) and the seconds until both lapse
    unless it renews them (None: a record without expiry, which only a person writes)."""
    alive: dict[str, dict[str, Any]] = {}
    for record in await supervisors(client, keys, SHOW_ALL):
        ttl = record["ttl_ms"]
        alive[record["id"]] = {"id": record["id"], "where": record["where"],
                               "lapses_in": None if ttl < 0 else -(-ttl // 1000)}
    now, _ = await server_time(client, keys.supervisor_tokens)
    async for _, entry in client.hscan_iter(keys.supervisor_tokens, count=SCAN_COUNT):
        until, _, consumer = _text(entry).partition(" ")
        if not (until.isdecimal() and int(until) > now and consumer):
            continue
        known = alive.setdefault(consumer, {"id": consumer, "where": None, "lapses_in": 0})
        if known["lapses_in"] is not None:
            known["lapses_in"] = max(known["lapses_in"], int(until) - now)
    return sorted(alive.values(), key=lambda supervisor: supervisor["id"])


def deadline_in_ms(score: float) -> int:
    """A registry score in ms: whole seconds (queue 5), or ms (this project's old format)."""
    return int(score) if score >= MS_DEADLINES_FROM else int(score) * 1000


async def server_ms(client: Any) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _counter(value: bytes | None) -> int | str | None:
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        return _text(value)  # shown as it is: a corrupt counter is worth seeing


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
