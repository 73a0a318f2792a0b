"""Search of the failed, dead and poison lists (Redis) and of the dead stream (NATS) by error
class, message text and payload text, bounded: what the list page's search and its bulk
actions read.

A search reads the newest ``SEARCH_ENTRIES`` entries at most (Redis: list positions, NATS:
stream sequences), newest first, in windows of ``WINDOW`` read at once (Redis: one LRANGE,
then one pipeline of the job and failure records; NATS: that many STREAM.MSG.GET requests
at a time). Of each entry it matches only the first ``RECORD_BYTES`` of the job record
(poison: of the entry) and ``ERROR_BYTES`` of the failure record, and it stops once it has
read ``SEARCH_BYTES`` in all. It says how far it got (``Found.note``): "searched the newest
10,000 of 250,000 entries; 12 match". It writes nothing.

Every criterion is text that the field contains, case folded; all given must match. A
failure record longer than ``ERROR_BYTES`` is matched as its first bytes, JSON as stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import orjson

from broker.failure import Failure
from broker.nats import admin as nats_admin
from broker.nats.dead import REASON_HEADER
from broker.redis.admin import browse
from broker.redis.admin import lists as redis_lists
from supervisor.dashboard import pids
from supervisor.dashboard.sources import (
    PREVIEW_BYTES,
    Entry,
    dead_entry,
    envelope_facts,
    failure_of,
    text,
)

#: Entries a search reads at most, from the newest (NATS: stream sequences).
SEARCH_ENTRIES = 10_000
#: Entries read at once: one LRANGE and one pipeline (NATS: requests in flight).
WINDOW = 500
#: Bytes of each job record (poison entry, dead letter) a search matches.
RECORD_BYTES = 4 * 1024
#: Bytes of each failure record a search reads.
ERROR_BYTES = 8 * 1024
#: Bytes one search reads in all before it stops.
SEARCH_BYTES = 32 << 20
#: Matches listed on the page (all are counted, and a bulk action takes all).
SHOW = 50
#: Characters of each criterion kept.
CRITERION = 200
FIELDS = ("error", "message", "payload")


@dataclass(frozen=True, slots=True)
class Query:
    """What a search looks for: text the error class, the message, the payload contains."""

    error: str = ""
    message: str = ""
    payload: str = ""

    @classmethod
    def of(cls, params: Mapping[str, str]) -> Query:
        return cls(*(params.get(name, "").strip()[:CRITERION] for name in FIELDS))

    def __bool__(self) -> bool:
        return bool(self.error or self.message or self.payload)

    def params(self) -> str:
        """The query string that asks for this search again."""
        return urlencode({name: value for name in FIELDS if (value := getattr(self, name))})

    def describe(self) -> str:
        return "; ".join(f"{name} contains {value!r}" for name in FIELDS
                         if (value := getattr(self, name)))

    def matches(self, failure: Failure | None, failure_text: str, record: str,
                payload: str = "") -> bool:
        """``failure_text``: the failure as read when it is no record (its raw first bytes,
        a NATS Queue-Reason header); ``payload``: the decoded payload as JSON, if read."""
        error = failure.error if failure else failure_text
        message = failure.message if failure else failure_text
        return (_contains(error, self.error) and _contains(message, self.message)
                and (_contains(record, self.payload) or _contains(payload, self.payload)))


@dataclass(slots=True)
class Found:
    """What a search found and how far it read."""

    kind: str
    total: int  # entries the list (stream) held when the search began
    bound: int = SEARCH_ENTRIES
    read: int = 0  # entries (NATS: sequences) looked at
    bytes: int = 0
    entries: list[Entry] = field(default_factory=list)  # the first SHOW matches
    matches: int = 0
    #: what a bulk action may name: the matches' pids (NATS: ``seq:N``), newest first
    selectors: list[str] = field(default_factory=list)
    stopped: str = ""  # why it stopped before its bound, if it did
    nats: bool = False  # a dead stream: sequences, not list positions

    @property
    def note(self) -> str:
        what = "sequences of the dead stream" if self.nats else "entries"
        held = f"{self.total:,} dead letters" if self.nats else f"{self.total:,}"
        note = (f"searched the newest {self.read:,} {what} of {held} (at most "
                f"{self.bound:,}; the first {RECORD_BYTES:,} bytes of each record); "
                f"{self.matches:,} match")
        return note + (f"; stopped early: {self.stopped}" if self.stopped else "")

    def add(self, entry: Entry, selector: str | None) -> None:
        self.matches += 1
        if len(self.entries) < SHOW:
            self.entries.append(entry)
        if selector is not None:
            self.selectors.append(selector)

    def spent(self, size: int) -> bool:
        """Count ``size`` bytes read; whether the search has read all it may."""
        self.bytes += size
        if self.bytes >= SEARCH_BYTES:
            self.stopped = f"read {SEARCH_BYTES / 2**20:g} MiB, the most one search reads"
        return bool(self.stopped)


async def redis(broker: Any, kind: str, query: Query, bound: int = SEARCH_ENTRIES) -> Found:
    """Search the newest ``bound`` entries of a failed, dead or poison list."""
    client, keys = broker.client, broker.keys
    key = browse.list_key(keys, kind)
    total = await client.llen(key)
    found = Found(kind, total, bound)
    reach = min(total, bound)
    while found.read < reach and not found.stopped:
        take = min(WINDOW, reach - found.read)
        start = total - found.read - take  # from the oldest end: pushes do not move it
        found.read += take
        if kind == "poison":
            await _poison_window(broker, key, start, take, total, query, found)
            continue
        window = await browse.from_tail(client, key, start, take)
        for record in await browse.records(client, keys, window, RECORD_BYTES, ERROR_BYTES):
            found.spent(len(record.head) + len(record.error or b""))
            failure, note = failure_of(record.error)
            raw_error = text(record.error) if failure is None and record.error else ""
            head = text(record.head)
            facts = envelope_facts(record.head) if record.size <= RECORD_BYTES else {}
            if not query.matches(failure, raw_error or note, head, _payload(facts)):
                continue
            entry = Entry(record.pid, record.size, head[:PREVIEW_BYTES], failure,
                          note if record.size else "(job record expired)",
                          attempts=facts.get("attempts"), at=facts.get("timestamp"))
            found.add(entry, record.pid if pids.is_pid(record.pid) else None)
    return found


async def _poison_window(broker: Any, key: str, start: int, take: int, total: int,
                         query: Query, found: Found) -> None:
    """Poison entries are raw bytes (no record, no error class): their text is matched, and
    a message query matches why each was poisoned, where the reason store keeps it."""
    jobs = await redis_lists.peek(broker.client, broker.scripts, broker.keys, start, take,
                                  RECORD_BYTES)
    for job in reversed(jobs):  # newest first
        raw = job.raw or b""
        found.spent(len(raw))
        head = text(raw)
        if (query.error or not _contains(job.reason or "", query.message)
                or not _contains(head, query.payload)):
            continue
        position = total - 1 - (job.position or 0)  # as the poison page counts, from newest
        found.add(Entry(str(position), job.size, head[:PREVIEW_BYTES]), None)


async def nats(stream: nats_admin.DeadStream, query: Query, bound: int = SEARCH_ENTRIES
               ) -> Found:
    """Search the dead letters of the newest ``bound`` sequences of the dead stream."""
    info = await stream.info()
    if info is None:
        return Found("dead", 0, bound, nats=True)
    found = Found("dead", info.state.messages, bound, nats=True)
    first, last = info.state.first_seq, info.state.last_seq
    low = max(first, last - bound + 1, 1)
    high = last
    while high >= low and not found.stopped:
        seqs = range(high, max(low, high - WINDOW + 1) - 1, -1)
        found.read += len(seqs)
        high -= len(seqs)
        letters = await asyncio.gather(*(stream.get(seq) for seq in seqs))
        for letter in letters:
            if letter is not None:
                _match_letter(letter, query, found)
    return found


def _match_letter(letter: nats_admin.Letter, query: Query, found: Found) -> None:
    job = letter.job
    raw = job.raw or b""
    found.spent(len(raw))
    head = text(raw[:RECORD_BYTES])
    facts = envelope_facts(raw) if len(raw) <= RECORD_BYTES else {}
    reason = letter.headers.get(REASON_HEADER, "")
    if not query.matches(job.failure, reason or job.failure_note, head, _payload(facts)):
        return
    found.add(dead_entry(letter), f"seq:{job.seq}")


def _payload(facts: dict[str, Any]) -> str:
    """The payload as JSON text without escapes (PHP writes ``\\/`` and ``\\u00e9``)."""
    shown = facts.get("payload")
    if not isinstance(shown, str):
        return ""
    try:
        return orjson.dumps(orjson.loads(shown)).decode()
    except orjson.JSONDecodeError:
        return shown


def _contains(value: str, wanted: str) -> bool:
    return not wanted or wanted.casefold() in (value or "").casefold()

