"""What the dashboard reads from one job's broker: counts for the sampler, and the details,
listings and jobs of the pages.

Every read is bounded (pages of ``PAGE`` entries, values read up to ``VALUE_BYTES``, lists
searched up to ``SEARCH_DEPTH``) and none writes. The reads are the admin modules'
(``broker.redis.admin.browse`` and ``.status``, ``broker.nats.admin``): this module turns
them into rows and pages. Neither the sampler's read of a Redis queue (``browse.sample``,
then ``oldest.lua``) nor a queue page does a ``SCAN``, which costs a walk of the whole
keyspace: the page lists the supervisors the last sample found alive in the token registry
(read again, bounded, only without a recent sample), and a view within ``DETAIL_REUSE``
seconds of the last one is given that one's reading. No owner token (a delivery's receipt)
is shown: a reservation's key is cut after its token's registry prefix.
A broker that cannot be reached raises ``BrokerError``; the next call connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats.errors
import orjson

from broker import envelope
from broker.base import BrokerError
from broker.failure import Failure
from broker.nats import admin as nats_admin
from broker.nats.dead import REASON_HEADER
from broker.nats.setup import QueueNames
from broker.redis.admin import browse
from broker.redis.admin import status as redis_status
from broker.redis.recovery import PREFIX_HEX
from broker.stopped import first_published, read_history
from broker.urls import redact
from supervisor.config import Config
from supervisor.dashboard import local
from supervisor.figures import Figures
from supervisor.ops import running

#: Entries of a failed, dead or poison list shown per page.
T = TypeVar("T")

PAGE = 50
#: Bytes of a job record, payload or poison entry read for a page (the rest is counted).
VALUE_BYTES = 64 * 1024
#: Bytes of a record read for a row of a listing.
PREVIEW_BYTES = 512
#: A poison page is read only if the whole list is at most this big (entries are raw
#: bytes of any size, and LRANGE cannot cut them).
POISON_LIST_BYTES = 8 << 20
#: Entries a pid search looks at, from the newest (LPOS MAXLEN).
SEARCH_DEPTH = 100_000
#: Dead letters a NATS pid search reads, from the oldest (one request each).
NATS_SEARCH_DEPTH = 10_000
#: Registered supervisors checked for liveness per sample.
MAX_TOKENS = 1000
#: Supervisors a queue page lists at most.
SHOW_SUPERVISORS = 100
#: Reservations a queue page lists at most.
SHOW_RESERVATIONS = 20
#: Seconds a queue page's broker reading is reused by the next views (any client).
DETAIL_REUSE = 1.0
LISTS = ("failed", "dead", "poison")


@dataclass(slots=True)
class Counts:
    """One sample of a queue. None: this broker has no such thing (NATS has no failed list)."""

    ready: int = 0
    processing: int = 0
    failed: int | None = 0
    dead: int = 0
    poison: int | None = 0
    delayed: int | None = 0
    done: int = 0  # settled so far (success + failed, or acknowledged): rates are its deltas
    oldest_age: float | None = None
    supervisors: int | None = None
    delayed_overdue: float | None = None  # s the oldest delayed retry is past due (Redis)
    consumers: list[str] | None = None  # the live supervisors' ids (Redis; None: unknown)


@dataclass(slots=True)
class Entry:
    """One row of a failed, dead or poison listing."""

    pid: str  # or the stream sequence (NATS), or the position (poison)
    size: int = 0
    preview: str = ""
    failure: Failure | None = None
    note: str = ""  # "(no record)", the Queue-Reason header ...
    #: Its last attempt's number (the envelope's earlier ``attempts`` + 1 on Redis, the
    #: deliveries on NATS), shown where no failure record names it.
    attempts: int | None = None
    at: float | None = None
    seq: int | None = None  # NATS: the dead stream's sequence (actions name it: seq:N)


@dataclass(slots=True)
class Listing:
    kind: str
    total: int
    entries: list[Entry] = field(default_factory=list)
    page: int = 0
    next_after: int | None = None  # NATS: the sequence to continue after
    searched: str | None = None
    note: str = ""


def text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def failure_of(raw: bytes | str | None) -> tuple[Failure | None, str]:
    """A stored failure record, or None and why not."""
    if raw is None:
        return None, "(no record)"
    try:
        return Failure.decode(raw), ""
    except ValueError as error:
        return None, f"(unreadable record: {error})"


def last_attempt(facts: dict[str, Any]) -> int | None:
    """The number of the attempt an envelope is on (or was on when it failed): its earlier
    ``attempts`` (queue 5's count) + 1."""
    earlier = facts.get("attempts")
    return earlier + 1 if isinstance(earlier, int) else None


def envelope_facts(raw: bytes) -> dict[str, Any]:
    """attempts, timestamp and the payload as indented JSON, if ``raw`` is an envelope."""
    try:
        decoded = envelope.decode(raw, None)
    except (envelope.MalformedEnvelope, TypeError, ValueError):
        return {}
    payload = decoded.get("payload")
    try:
        shown = orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode()
    except TypeError:
        shown = repr(payload)
    return {"attempts": decoded.get("attempts"), "timestamp": decoded.get("timestamp"),
            "payload": shown, "pid": decoded.get("pid")}


class RedisSource:
    kind = "redis"

    def __init__(self, config: Config) -> None:
        self.config = config
        self._broker: Any = None
        self._lock = asyncio.Lock()

    async def broker(self) -> Any:
        async with self._lock:
            if self._broker is None:
                from supervisor.brokers import make_broker

                broker = make_broker(self.config)
                try:
                    await broker.connect()
                except BaseException:
                    await broker.close()
                    raise
                self._broker = broker
            return self._broker

    async def _call(self, read: Callable[[Any], Awaitable[T]]) -> T:
        """``read(broker)``; a broker that failed is dropped, to be connected again."""
        broker = await self.broker()
        try:
            return await read(broker)
        except Exception as error:
            from broker.redis.connection import CONNECTION_ERRORS

            if isinstance(error, (BrokerError, *CONNECTION_ERRORS)):
                self._broker = None
                await _quietly(broker.close())
                raise BrokerError(str(error)) from error
            raise

    async def using(self, read: Callable[[Any], Awaitable[T]]) -> T:
        """``read(broker)`` on this queue's broker (a search, an action's reads)."""
        return await self._call(read)

    async def close(self) -> None:
        if self._broker is not None:
            broker, self._broker = self._broker, None
            await _quietly(broker.close())

    async def counts(self) -> Counts:
        return await self._call(self._counts)

    async def _counts(self, broker: Any) -> Counts:
        found = await browse.sample(broker.client, broker.keys, MAX_TOKENS)
        counts = Counts(found.ready, found.processing, found.failed, found.dead, found.poison,
                        found.delayed, found.done, supervisors=found.supervisors,
                        delayed_overdue=found.delayed_overdue, consumers=found.consumers)
        counts.oldest_age = await broker.oldest_ready_age()
        return counts

    async def detail(self, consumers: list[str] | None = None) -> dict[str, Any]:
        """What the queue page shows. ``consumers``: the live supervisors the last sample
        found (None: read the token registry now, at most ``MAX_TOKENS`` of it)."""
        async def read(broker: Any) -> dict[str, Any]:
            client, keys = broker.client, broker.keys
            known = consumers
            if known is None:
                known = await browse.live_consumers(client, keys, None, MAX_TOKENS)
            records = await redis_status.named_supervisors(client, keys,
                                                           (known or [])[:SHOW_SUPERVISORS])
            for record in records:  # uptime and what runs now, where this host can see it
                record["local"] = await asyncio.to_thread(
                    local.describe, keys.queue, record["where"])
            await running.add_redis_copies(client, keys, records)  # every host's jobs
            return {
                "supervisors": records,
                # None: more than MAX_TOKENS registered, too many to look at per view
                "supervisors_alive": None if known is None else len(known),
                "running": sorted(({"where": record["where"], **job} for record in records
                                   if record.get("running")
                                   for job in record["running"]["jobs"]),
                                  key=lambda job: -job["elapsed"]),
                "running_total": sum(record["running"]["running"] for record in records
                                     if record.get("running")),
                "reservations": hide_tokens(await redis_status.reservations(
                    client, keys, show=SHOW_RESERVATIONS), keys.reservation("")),
            }

        return await self._call(read)

    async def figures(self, consumers: list[str]) -> dict[str, Figures]:
        """The figures of the live supervisors ``consumers`` (the sampler's, for their
        rates: ``supervisor.dashboard.compare``)."""
        async def read(broker: Any) -> dict[str, Figures]:
            return await running.redis_figures(broker.client, broker.keys,
                                               consumers[:SHOW_SUPERVISORS])

        return await self._call(read)

    async def listing(self, kind: str, page: int = 0, pid: str = "") -> Listing:
        async def read(broker: Any) -> Listing:
            client, keys = broker.client, broker.keys
            key = browse.list_key(keys, kind)
            total = await client.llen(key)
            if kind == "poison":
                return await _poison(client, keys, total, page)
            if pid:
                pids = [pid] if await browse.search(client, key, pid, SEARCH_DEPTH) else []
                listing = Listing(kind, total, searched=pid)
            else:
                pids = await browse.newest(client, key, page * PAGE, PAGE)
                listing = Listing(kind, total, page=page)
            for record in await browse.records(client, keys, pids, PREVIEW_BYTES):
                failure, note = failure_of(record.error)
                size, head = record.size, record.head
                facts = envelope_facts(head) if size <= PREVIEW_BYTES else {}
                listing.entries.append(Entry(
                    record.pid, size, text(head), failure,
                    note if size else "(job record expired)",
                    attempts=last_attempt(facts), at=facts.get("timestamp")))
            return listing

        return await self._call(read)

    async def job(self, pid: str) -> dict[str, Any]:
        async def read(broker: Any) -> dict[str, Any]:
            found = await browse.job(broker.client, broker.keys, pid, VALUE_BYTES, SEARCH_DEPTH)
            size, raw = found["size"], found["raw"]
            failure, note = failure_of(found["error"])
            history = read_history(found["history"])
            if failure is None and history:  # retrying: its last failed attempt's record
                failure, note = history[-1], ""
            facts = envelope_facts(raw) if size <= VALUE_BYTES else {}
            decoded = {"attempts": facts["attempts"], "timestamp": facts["timestamp"]} if (
                facts) else None
            return {
                "pid": pid, "where": found["where"], "size": size, "record": text(raw),
                "cut": size > len(raw), "ttl": found["ttl"], "failure": failure,
                "failure_note": note, "owned": found["owner"] is not None,
                "claim_ms": found["claim_ms"], "facts": facts, "history": history,
                "first_published": first_published(decoded, history),
            }

        return await self._call(read)


def hide_tokens(reservations: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Reservations with each key's owner token cut to its registry prefix (which names the
    supervisor, not the delivery): the whole token is the receipt that settles it."""
    for item in reservations["lists"]:
        key = item["key"]
        if key.startswith(prefix) and len(key) > len(prefix) + PREFIX_HEX:
            item["key"] = key[:len(prefix) + PREFIX_HEX] + "…"
    return reservations


async def _poison(client: Any, keys: Any, total: int, page: int) -> Listing:
    listing = Listing("poison", total, page=page)
    size, raws = await browse.poison_page(client, keys.poison, total, page * PAGE, PAGE,
                                          POISON_LIST_BYTES)
    if raws is None:
        listing.note = (f"the poison list holds {size:,} bytes: too big to page through "
                        f"here (at most {POISON_LIST_BYTES:,}); read it with redis-cli")
        return listing
    reasons = await browse.poison_reasons(client, keys, raws)
    for index, (raw, (at, why)) in enumerate(zip(raws, reasons, strict=True)):
        listing.entries.append(Entry(
            str(page * PAGE + index), len(raw), text(raw[:PREVIEW_BYTES]),
            Failure(error="poison", message=why, at=at or 0.0) if why else None,
            note=NO_POISON_REASON, at=at))
    return listing


#: What the poison page says of an entry whose reason is not kept.
NO_POISON_REASON = ("(no reason kept: pushed by a PHP worker or an older supervisor, or among "
                    "the oldest beyond the 1,000 reasons kept)")


class NatsSource:
    """A JetStream queue: its consumer's counts and the dead stream. NATS has no failed or
    poison list (an undecodable message is dead-lettered) and no supervisor records."""

    kind = "nats"

    def __init__(self, config: Config) -> None:
        self.config = config
        self._client: Any = None
        self._lock = asyncio.Lock()
        self.state: dict[str, Any] = {}

    async def _js(self) -> Any:
        async with self._lock:
            if self._client is None or self._client.is_closed:
                # One quick try per server, as ``status`` connects (nats-py alone would
                # retry a refused server 60 times); kept open between samples.
                self._client = await nats_admin.connect(
                    self.config.broker.url, self.config.broker.tls,
                    f"queue-supervisor dashboard {self.config.job.queue}")
            return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await _quietly(client.close())

    async def dead_stream(self) -> nats_admin.DeadStream:
        """The dead stream, through ``dead``'s own reader (``broker.nats.admin``)."""
        return nats_admin.DeadStream(await self._js(), QueueNames.of(self.config.job.queue))

    async def _read(self) -> dict[str, Any]:
        """What ``status`` reads, and the two figures the dashboard plots."""
        names = QueueNames.of(self.config.job.queue)
        try:
            async with asyncio.timeout(nats_admin.STATUS_TIMEOUT):
                js = (await self._js()).jetstream(timeout=nats_admin.CONNECT_TIMEOUT)
                info = await nats_admin.read_queue(js, names)
        except (TimeoutError, OSError, nats.errors.Error) as error:
            await self.close()
            raise BrokerError(f"NATS at {redact(self.config.broker.url)} did not answer "
                              f"the JetStream API: {error!r}") from error
        return {**info.counts(self.config.job.max_attempts), "acknowledged": info.acknowledged}

    async def counts(self) -> Counts:
        self.state = state = await self._read()
        return Counts(ready=state["ready"], processing=state["processing"], failed=None,
                      dead=state["dead"], poison=None, delayed=None,
                      done=state["acknowledged"])

    async def detail(self) -> dict[str, Any]:
        """The JetStream figures, and the jobs this host's supervisors of the queue run
        (their handler processes' titles: JetStream keeps no records of ours)."""
        here = await asyncio.to_thread(running.on_this_host, self.config.job.queue,
                                       self.config.job.slow_job_after)
        jobs = [{"where": f"{found['host']} {found['pid']}", **job}
                for found in here for job in found["jobs"]]
        return {"nats": self.state or await self._read(), "running": jobs,
                "running_total": sum(job["in_process"] for job in jobs),
                "this_host_only": True}

    async def listing(self, kind: str, page: int = 0, pid: str = "", after: int = 0
                      ) -> Listing:
        """A page of the dead stream, oldest first from past sequence ``after``; or the
        letters of one pid (or ``seq:N``) among the oldest ``NATS_SEARCH_DEPTH``."""
        if kind != "dead":
            listing = Listing(kind, 0)
            listing.note = "JetStream queues have no such list: failures end in the dead stream"
            return listing
        stream = await self.dead_stream()
        listing = Listing(kind, await stream.total())
        try:
            if pid:
                listing.searched = pid
                letters, _ = await stream.find([pid], depth=NATS_SEARCH_DEPTH)
                listing.entries = [dead_entry(letter) for letter in letters[:PAGE]]
                return listing
            async for letter in stream.letters(PAGE, after=after):
                listing.entries.append(dead_entry(letter))
        except (OSError, nats.errors.Error) as error:
            await self.close()
            raise BrokerError(f"reading {stream.names.dead_stream}: {error!r}") from error
        if len(listing.entries) == PAGE:
            listing.next_after = listing.entries[-1].seq
        return listing

    async def job(self, pid: str) -> dict[str, Any]:
        """A dead letter by ``seq:N`` (what the dead list links to), else the oldest dead
        letter of that pid among the oldest ``NATS_SEARCH_DEPTH``."""
        stream = await self.dead_stream()
        letters, _ = await stream.find([pid], depth=NATS_SEARCH_DEPTH) if pid else ([], [])
        if not letters:
            return {"pid": pid, "where": [], "size": 0, "record": "", "missing": True}
        letter = letters[0]
        entry, raw = dead_entry(letter), letter.job.raw or b""
        return {
            "pid": letter.job.pid, "seq": letter.job.seq, "where": ["dead"],
            "size": len(raw), "record": text(raw[:VALUE_BYTES]),
            "cut": len(raw) > VALUE_BYTES, "failure": entry.failure,
            "failure_note": entry.note, "headers": letter.headers,
            "facts": envelope_facts(raw) if len(raw) <= VALUE_BYTES else {},
        }


def dead_entry(letter: nats_admin.Letter) -> Entry:
    """A row of the dead list, from ``dead``'s reading of the letter."""
    job = letter.job
    note = job.failure_note
    if job.failure is None and letter.headers.get(REASON_HEADER):
        note = f"(no record) {REASON_HEADER}: {letter.headers[REASON_HEADER]}"
    raw = job.raw or b""
    facts = envelope_facts(raw) if len(raw) <= VALUE_BYTES else {}
    return Entry(job.pid, len(raw), text(raw[:PREVIEW_BYTES]), job.failure,
                 note or "(no record)", attempts=job.deliveries,
                 at=job.stored_at or facts.get("timestamp"), seq=job.seq)


def make_source(config: Config) -> RedisSource | NatsSource:
    return NatsSource(config) if config.broker.kind == "nats" else RedisSource(config)


async def _quietly(closing: Any) -> None:
    with contextlib.suppress(Exception):  # closing must not hide what made us close
        await closing
