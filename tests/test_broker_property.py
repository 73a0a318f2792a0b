"""A property test of the Redis protocol (SPEC §4, §5) against its guarantee (SPEC §9), in a
mixed fleet: this project's consumers and PHP queue-5 workers on one queue.

A hypothesis state machine interleaves, on one private redis-server, the operations of
``RedisBroker`` consumers (three acting at a time, a 3 s lease) and of PHP queue-5 workers
(``tests.queue5.Queue5Consumer``, two acting at first, the same 3 s claim TTL; in turn a
Swoole worker that renews and sweeps with ``reap_after`` 0 (so that its sweeps do recover),
a Workerman worker that never renews (its handlers outlast the claim: it settles long after
its claims lapsed) and sweeps with queue 5's default ``reapAfter`` (90,000 s), a Swoole one
at the default, a KubernetesJob one (never renews) at 0; every other one reaps as queue 5 B,
which requeues whatever it reaps, the others as C with ``reapMaxAttempts``), with the faults
the protocol must survive:

- publish: ``publish_many``, PHP's ``publish``, crafted envelopes (an old timestamp, attempts
  already made) and malformed bytes pushed with LPUSH, as a broken producer would; PHP's
  ``coalesce()`` of keyed messages (published only while the key's marker is free);
  envelopes over our consumers' ``max_envelope_bytes`` pushed in one batch beside good ones
  (ours poison them unread as they are, counted nowhere; PHP workers run them; a sweep of
  ours moves one to dead unread, and only once old by its ``uniqid`` pid);
- receive, on either side: reserve then claim, or death between them; a blocking receive on
  an empty queue with a message arriving meanwhile; and (ours) the *frozen* blocking receive:
  the consumer registers its blocking reservation, is frozen past its deadline, recovery
  (ours, PHP's, or nobody's) runs, then the late BLMOVE lands in the reservation and the
  claim follows. RedisBroker's freeze guard avoids that move; the rule drives the lower level
  to model the worst case: the payload must go back to the ready list, never stay in a list
  no registry names;
- settle, on either side: commit, reject (ours: a retry with the same pid, or failed at
  ``max_attempts``; PHP's: failed), release; several in one call, the same delivery twice;
  a PHP worker releasing all it holds. Every other consumer of ours has a ``retry_backoff``
  (issue 39): its retry waits in ``supervisor-delayed`` (the envelope with the pid, payload
  and attempts of the retry; due in whole seconds of the server clock, within the delay its
  settlement reported), out of every consumer's and sweep's reach, until its backoff passes
  (a rule makes it due and stamps it with the time of its failure, that long ago, as
  versions before issue 39 parked it):
  then the next maintenance of ours, whatever the lock, moves it to the ready list stamped
  with the server's time of the promotion;
- extend (also done automatically, as the renewal loops would, for every actor that is not
  stalled and renews; ours also renews its record and token registration with it), a claim
  key deleted (its owner stalled past the lease; it may come back later), a record of ours
  deleted once not renewed for 1.5 s (it would lapse at 3 s), the requeue at exit (ours:
  ``abandon`` requeues what it still owns itself), death (with its leases and record run out,
  or not yet), an owner key deleted (the entry looks like a utopia-php/queue 1.x
  consumer's), SCRIPT FLUSH;
- maintenance by either side: ours with the reap lock deleted first (the interval passed),
  held by someone else (then skipped, changing nothing), or forced; PHP's ``maintain()``;
  ours while an owner (ours or PHP) renews or commits, another full sweep (ours or PHP's)
  runs, or another of ours recovers the entries, takes them again and stalls in turn,
  between the sweep's reads and its recovery script (``recovery._read_state`` wrapped: the
  scripts' re-checks decide); sweeps with a tiny scan window, ours, PHP's, or the two
  alternating on the shared cursor, which must reach every abandoned entry in a bounded number
  of passes.

The model follows every message by a unique id inside its payload (``uid``), not by its pid:
PHP's reap requeues a *new* pid. It knows where each message is and what each actor believes
it holds. After every step the real Redis state is compared with it (SPEC §9): each message
is in exactly one place -- the ready list, a registered reservation list (one the
reservations zset names, holding exactly the payloads the model says, in order, with the
deadline expired exactly when the model says so and otherwise in whole seconds, at most
lease + blocking timeout ahead), processing (the pid in the processing list, its job record,
its owner token (none if made legacy), and its claim key, with the token and at most the
lease to live, exactly when the model says the lease is live), failed or dead (the job
record kept, no owner, no claim), poison (malformed bytes only), or done (committed: nothing
of it left). Every envelope still carries the pid, the payload and the attempts the model
expects. A coalescing marker exists exactly for each keyed message ready, reserved or
processing, and names its current pid. No key is left that the model cannot explain (a list
no registry names is reported as stranded).

Counters (both sides keep them alike, SPEC §4):

- ``stats.total`` = deliveries claimed, by either side (a redelivery counts again);
- ``stats.processing`` = LLEN processing = the entries the model has in processing;
- ``stats.success`` = commits applied;
- ``stats.failed`` = failed runs applied: our rejects (retried or failed), PHP's rejects;
- poison counts in none.

Outcomes are predicted, not just observed: a settlement or renewal of a delivery whose owner
token is no longer the one it holds must be ``stale`` (``False`` from extend, ``NotOwned``
from PHP) and change nothing; any other one applies, whether its claim key still exists or
not. A claim of an expired or unregistered reservation claims nothing (ours puts what the
list holds back at the consumer end, first taken rightmost; PHP's fails and leaves it to
recovery). Recovery returns expired reservations to the consumer end in taken order and
requeues at the producer end: ours takes an entry whose claim is gone when its owner token
carries the registered prefix of one of our consumers whose record is gone, and otherwise
(any other owner, or none) only past ``recovery_age`` (queue 5's rule), never from one of
ours whose record exists; it requeues the same pid with ``attempts + 1`` or dead-letters it
once that reaches ``max_attempts``; PHP's takes an entry without a claim when its
``reap_after`` is 0 or the envelope is past it, and requeues a new pid with ``attempts + 1``
(C: dead once ``attempts >= reapMaxAttempts``). Besides the predicted counts, every recovery
by a sweep of ours checks that the holder is dead or no longer holds it live: a living PHP
worker's young delivery (renewing or not) and a delivery of one of ours whose record exists
are never taken. Reports and return
values must count exactly what was recovered. Reserve takes from the consumer end (right); a
release goes back to that end in order, a retry to the producer end. A zero-argument rule,
``advance``, walks the plain path (reserve, claim, settle) on both sides so that most examples
get far enough for the faults to matter.

Wall-clock time is done on purpose, so the model knows: live actors renew their claims every
0.5 s; a claim nobody renewed for 1.5 s is deleted (it would lapse by itself at 3 s); a
reservation 1 s old gets a deadline in the past (it could lapse by itself after 2 s).

At teardown the queue is drained: faults stop, every live actor claims what it reserved and
commits what it still owns, then the leases of the dead run out and recovery (ours, then a
PHP sweep for owner-less entries younger than ``recovery_age``) and a fresh consumer run
until nothing is ready, reserved or processing. Every message must then be done, failed,
dead or poison exactly once, no key stranded, ``stats.processing`` 0 and the other counters
as the model predicts.

Size: ``QS_PROPERTY_SHARDS`` (default 3) runs of ``QS_PROPERTY_EXAMPLES`` (default 60)
examples of up to ``QS_PROPERTY_STEPS`` (default 80) steps: about 3,700 rule steps per shard
(measured), over 11,000 in all, about 25 s per shard on a loaded 2-core box (xdist runs the
shards side by side); a longer hunt is e.g. ``QS_PROPERTY_EXAMPLES=500
QS_PROPERTY_STEPS=120``. ``QS_PROPERTY_SEED`` fixes hypothesis's seed (a failure names the
seed it ran with, and prints the shrunk sequence of steps with what each one did).
Renewals, lapses and deadlines follow the model's own clock (``TICK`` per step), never the
wall clock, and the real lease is long enough that nothing lapses by itself in an example:
a seed replays the same steps however slow the machine is.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, event, note, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from broker import envelope
from broker.base import Action, Outcome, Result, Settlement
from broker.failure import RECORD_TTL_WITHOUT_JOB_TTL
from broker.redis import RedisBroker, Reservation, recovery
from broker.redis.keys import FAILURES_KEPT, QueueKeys
from tests.queue5 import LIMIT, REAP_AFTER, NotOwned, Queue5Consumer

#: A passing run takes seconds; a failing one also shrinks its example, which can take minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NS = "utopia-queue"
QUEUE = "stats-usage"
KEYS = QueueKeys(NS, QUEUE)
URL = "https://example.com/a/b"  # in every payload: both sides write "/" as "\/"
STATS = ("total", "processing", "success", "failed")

LEASE = 60  # our lease and PHP's claim TTL, seconds: nothing lapses by itself in an example
#: The model's own clock, advanced by TICK at every step: which claims are renewed, lapse or
#: expire depends on the steps taken, never on how fast this machine ran them (a wall clock
#: made hypothesis replay an example differently under load: FlakyStrategyDefinition).
TICK = 0.25
MAX_ATTEMPTS = 3
RECOVERY_AGE = 90_000
OLD = 100_000  # an old envelope is this many seconds older than now: past RECOVERY_AGE
RENEW_AFTER = 0.5  # a live actor renews its claims once one is this old (model seconds)
CLAIM_GUARD = 1.5  # a claim nobody renewed for this long is deleted on purpose
RESERVATION_GUARD = 1.0  # a reservation this old gets a past deadline

MAX_ITEMS = 30  # messages published per example
MAX_OURS = 6  # our consumers started per example (at most three acting at once)
MAX_PHP = 4  # PHP workers started per example (at most two acting at once)

EXAMPLES = int(os.environ.get("QS_PROPERTY_EXAMPLES", "60"))
STEPS = int(os.environ.get("QS_PROPERTY_STEPS", "80"))
SHARDS = int(os.environ.get("QS_PROPERTY_SHARDS", "3"))
SEED = int(os.environ.get("QS_PROPERTY_SEED") or random.randrange(2**32))

#: Malformed payloads that both sides poison (``%d`` keeps each one unique).
MALFORMED = (
    b"{not json %d",
    b'["an array", %d]',
    b'{"pid":"m%d","queue":"stats-usage","payload":{}}',  # no timestamp
    b'{"pid":"m%d","queue":"stats-usage","timestamp":null,"payload":{}}',
    b'{"pid":["m"],"queue":"stats-usage","timestamp":%d,"payload":{}}',
    b'{"pid":"m%d","queue":"stats-usage","timestamp":1,"payload":"text"}',
    b'{"pid":"m%d","queue":"stats-usage","timestamp":1,"payload":{},"attempts":"-1x"}',
    b'{"pid":"m%d","queue":"stats-usage","timestamp":1,"payload":{},"attempts":1e30}',
    # hostile: one level deeper than json_decode's 512 allows (the envelope is one)
    b'{"pid":"m%d","queue":"stats-usage","timestamp":1,"payload":' + b"[" * 511 + b"]" * 511
    + b"}",
)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Hostile attempts PHP accepts (each side's retry accounting must still end) and extreme
#: timestamps (the oldest stands for an old envelope, the newest for a young one).
EXTREME_ATTEMPTS = (INT64_MIN, -1, INT64_MAX - 100)
#: Our consumers' ``max_envelope_bytes``: a longer envelope is poisoned unread by our reserve
#: (reserve.lua, or claim.lua after a blocking move), and a sweep of ours reads no job record
#: longer than this (records.lua: recovered unread, to dead, only once old by its pid). PHP
#: workers have no limit: they run it, and their sweeps requeue it.
ENVELOPE_LIMIT = 16 * 1024


def ran_before(attempts: int) -> int:
    """Earlier runs by our retry accounting: a negative attempts counts as none."""
    return max(attempts, 0)

#: What the ``advance`` rule does with deliveries, in turn.
ADVANCE_ACTIONS = (Action.COMMIT, Action.REJECT, Action.COMMIT, Action.RELEASE)
PHP_OPS = ("commit", "reject", "commit", "release")

# Where a message is (the model's view).
READY, RESERVED, PROCESSING, DELAYED, FAILED, DEAD, POISON, DONE = (
    "ready", "reserved", "processing", "delayed", "failed", "dead", "poison", "done",
)
TOKEN = re.compile(r"[0-9a-f]{32}")
#: Places a coalesced message holds its marker in (it is freed in the others).
PENDING = (READY, RESERVED, PROCESSING, DELAYED)
#: The ``retry_backoff`` of every other consumer of ours: its shortest delay (half of it,
#: the jitter's floor) is far longer than an example runs, so nothing becomes due by itself.
RETRY_BACKOFF = 600


@dataclass(eq=False)
class Item:
    """One published message: a valid envelope (followed by the uid in its payload) or
    malformed bytes (followed by the bytes)."""

    uid: str
    valid: bool
    raw: bytes = b""  # malformed: the bytes
    pid: str | None = None  # the current pid (None: requeued by PHP, not looked up yet)
    pids: list[str] = field(default_factory=list)  # every pid it had
    key: str | None = None  # a coalesced message's key (its marker names the current pid)
    attempts: int = 0
    old: bool = False  # its timestamp is past RECOVERY_AGE
    place: str = READY
    reservation: str | None = None  # the reservation key while RESERVED
    owner: str | None = None  # the owner token while PROCESSING (None: made legacy)
    holder: str | None = None  # the actor that claimed it, while PROCESSING
    claim: bool = False  # its claims key exists (PROCESSING)
    renewed: float = 0.0  # model time (see TICK) the claims key was last written
    waited: int = 0  # DELAYED: the delay its settlement reported (whole seconds)
    due: bool = False  # DELAYED: its backoff passed (a rule made it due)
    depth: int = 0  # hostile: the payload holds arrays nested this deep (envelope: 2 more)
    pad: int = 0  # oversized: the payload carries this many bytes more than ENVELOPE_LIMIT

    @property
    def oversized(self) -> bool:
        return self.pad > 0

    @property
    def payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"uid": self.uid, "url": URL}
        if self.pad:
            payload["pad"] = "x" * (ENVELOPE_LIMIT + self.pad)
        if not self.depth:
            return payload
        deep: Any = [1]
        for _ in range(self.depth - 1):
            deep = [deep]
        return {**payload, "deep": deep}


@dataclass(eq=False)
class Res:
    """A reservation list, as the model expects it."""

    key: str
    uids: list[str]  # in the order taken
    started: float  # model time (see TICK) of the reserve call
    wait: int = 0  # the blocking timeout it was registered with (seconds)
    expired: bool = False  # its deadline was moved into the past
    registered: bool = True  # the reservations zset names it


@dataclass(eq=False)
class Actor:
    """One of our consumers (``broker``) or a PHP queue-5 worker (``php``)."""

    name: str
    broker: RedisBroker | None = None
    php: Queue5Consumer | None = None
    dead: bool = False
    stalled: bool = False  # stopped renewing (a claim of it lapsed) until it extends again
    # Ours: its token prefix is in the registry (from its first extend on), and its record
    # exists (written by every extend, deleted at exit or, on purpose, once not renewed for
    # CLAIM_GUARD: it would lapse by itself after the lease).
    registered: bool = False
    record: bool = False
    record_renewed: float = 0.0
    held: list[Any] = field(default_factory=list)  # Delivery / Message: claimed, not settled
    pending: list[Any] = field(default_factory=list)  # its reservations, not claimed

    @property
    def ours(self) -> bool:
        return self.broker is not None

    def holds_live(self, item: Item) -> bool:
        """True while no sweep of ours may take ``item`` from this (living) holder: ours,
        while its record exists, if the token is its own (registered); any other, while the
        envelope is younger than RECOVERY_AGE (queue 5's rule: it may never renew)."""
        if self.broker is not None and item.owner is not None \
                and item.owner.startswith(self.broker.token_prefix):
            return self.record or (not self.registered and not item.old)
        return not item.old

    @property
    def renews(self) -> bool:
        """False for a PHP worker of an adapter that never calls extend() (Workerman)."""
        return self.php is None or self.php.renews


pick = st.integers(0, 5)


class BrokerProtocol(RuleBasedStateMachine):
    url = ""  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.redis = redis.Redis.from_url(self.url)
        self.redis.flushall()
        self.redis.script_flush()
        self.loop = asyncio.new_event_loop()
        self.items: dict[str, Item] = {}
        # raw -> uid: malformed bytes, and oversized envelopes as our reserve poisoned them
        self.malformed: dict[bytes, str] = {}
        self.res: dict[str, Res] = {}
        self.actors: dict[str, Actor] = {}
        self.spawned = {"ours": 0, "php": 0}
        self.serial = 0
        self.forced = 0  # deadlines moved into the past so far
        self.clock = 0.0  # model seconds (see TICK)
        self.claims = self.commits = self.fails = 0
        self.advances = 0
        for _ in range(3):
            self._spawn_ours()
        for _ in range(2):
            self._spawn_php()

    def teardown(self) -> None:
        try:
            if sys.exc_info()[1] is None:  # not while a step's failure is on its way out
                self._drain()
        finally:
            for actor in self.actors.values():
                if actor.broker is not None:
                    self.run(actor.broker.close())
                if actor.php is not None:
                    actor.php.client.close()
            self.loop.close()
            self.redis.close()

    # -- helpers ----------------------------------------------------------------------

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def _spawn_ours(self) -> Actor:
        name = f"c{self.spawned['ours']}"
        self.spawned["ours"] += 1
        broker = RedisBroker(
            self.url, QUEUE, namespace=NS, consumer_id=name, lease=LEASE,
            max_attempts=MAX_ATTEMPTS, recovery_age=RECOVERY_AGE,
            max_envelope_bytes=ENVELOPE_LIMIT,
            retry_backoff=RETRY_BACKOFF if self.spawned["ours"] % 2 == 0 else 0,
        )
        actor = self.actors[name] = Actor(name, broker=broker)
        return actor

    def _spawn_php(
        self, max_attempts: int | str | None = "alternate", reap_after: int | None = None,
    ) -> Actor:
        """PHP workers in turn: Swoole (renews) reaping at 0, Workerman (never renews, its
        handlers outlast the claim) at queue 5's default ``reapAfter``, Swoole at the
        default, KubernetesJob (never renews) at 0."""
        number = self.spawned["php"]
        self.spawned["php"] += 1
        if max_attempts == "alternate":  # queue 5 B requeues whatever it reaps; C has a limit
            max_attempts = None if number % 2 == 0 else MAX_ATTEMPTS
        adapter = ("swoole", "workerman", "swoole", "kubernetes-job")[number % 4]
        if reap_after is None:
            reap_after = (0, REAP_AFTER, REAP_AFTER, 0)[number % 4]
        worker = Queue5Consumer(
            redis.Redis.from_url(self.url), QUEUE, namespace=NS, claim_ttl=LEASE,
            reap_after=reap_after, max_attempts=max_attempts,  # type: ignore[arg-type]
            adapter=adapter,
        )
        name = f"php{number}"
        actor = self.actors[name] = Actor(name, php=worker)
        return actor

    def _acting(self, ours: bool | None = None) -> list[Actor]:
        return [
            a for a in self.actors.values()
            if not a.dead and (ours is None or a.ours == ours)
        ]

    @staticmethod
    def _pick(index: int, actors: list[Actor]) -> Actor:
        return actors[index % len(actors)]

    def _room(self) -> bool:
        return len(self.items) < MAX_ITEMS

    def _in(self, place: str) -> list[Item]:
        return [item for item in self.items.values() if item.place == place]

    def _item(self, delivery: Any) -> Item:
        return self.items[delivery.payload["uid"]]

    def _owns(self, delivery: Any) -> bool:
        item = self._item(delivery)
        return (item.place == PROCESSING and item.pid == delivery.pid
                and item.owner == delivery.receipt)

    def _owned(self, actor: Actor) -> list[Any]:
        return [d for d in actor.held if self._owns(d)]

    def _expired(self) -> list[Res]:
        return [r for r in self.res.values() if r.registered and r.expired]

    def _recoverable(
        self, side: str, scan: int | None = None, reap_after: int = 0,
    ) -> list[Item]:
        """Processing entries a sweep takes, once the claim is gone: ours, when the owner is
        one of our consumers that is gone (registered, its record gone), or, for any owner
        not one of ours alive, when the envelope is past RECOVERY_AGE (queue 5's rule);
        PHP's, when ``reap_after`` is 0 or the envelope is past it. With ``scan``: only those
        the sweep looks at (see ``_looked_at``)."""
        looked_at = None if scan is None else self._looked_at(side, scan)
        return [
            item for item in self._in(PROCESSING)
            if not item.claim and (looked_at is None or item.pid in looked_at) and (
                (item.old or reap_after == 0) if side == "php"
                else self._holder_state(item) != "live"
                and (item.old or self._holder_state(item) == "gone"))
            and not (side == "php" and self._published_later(item))
        ]

    def _holder_state(self, item: Item) -> str:
        """What the token registry says of an item's owner: 'live' or 'gone' for one of our
        consumers that registered its token prefix, '' for any other owner (or none)."""
        for actor in self.actors.values():
            if actor.broker is not None and actor.registered and item.owner is not None \
                    and item.owner.startswith(actor.broker.token_prefix):
                return "live" if actor.record else "gone"
        return ""

    def _stranded_by_its_timestamp(self, item: Item) -> bool:
        """Hostile, and left alone as queue 5 leaves it: a processing entry whose timestamp
        is in the future is young to every age gate, so no sweep takes it from an owner not
        known to be ours (nor from none)."""
        if item.place == PROCESSING and self._published_later(item):
            event("a processing entry published in the future stays (as in queue 5)")
            return True
        return False

    def _published_later(self, item: Item) -> bool:
        """Hostile: its timestamp is in the future, so every age gate keeps it (PHP's too)."""
        raw = self.redis.get(KEYS.job(item.pid)) if item.pid else None
        return raw is not None and envelope.decode(raw)["timestamp"] > time.time()

    def _looked_at(self, side: str, scan: int) -> set[str]:
        """The processing pids one sweep looks at: queue 5's cursor window (``scan`` entries
        ending ``retained`` from the tail; reset once spent), and for ours also the newest
        ``scan`` (where the deliveries of a consumer that just died are)."""
        pids = [pid.decode() for pid in self.redis.lrange(KEYS.processing, 0, -1)]
        stored = self.redis.get(KEYS.reap_cursor)
        assert stored is None or re.fullmatch(rb"-?\d+:-?\d+", stored), f"cursor {stored!r}"
        retained, remaining = map(int, stored.split(b":")) if stored else (0, 0)
        size = len(pids)
        if retained < 0 or retained >= size or remaining <= 0:
            retained, remaining = 0, size
        length = min(scan, remaining, size - retained)
        start = max(0, size - retained - length)
        return {*pids[start:start + length], *(pids[:scan] if side == "ours" else ())}

    def _new_uid(self) -> str:
        self.serial += 1
        return f"u{self.serial}"

    def _add(self, item: Item) -> None:
        assert item.uid not in self.items
        self.items[item.uid] = item
        if item.pid is not None:
            item.pids.append(item.pid)
        if not item.valid:
            self.malformed[item.raw] = item.uid

    def _identify(self, raw: bytes) -> tuple[Item, dict[str, Any] | None]:
        """The model's item for raw bytes found in Redis (and the envelope, if valid)."""
        if raw in self.malformed:
            return self.items[self.malformed[raw]], None
        try:
            decoded = envelope.decode(raw)
        except envelope.MalformedEnvelope as error:
            raise AssertionError(f"unknown malformed payload {raw[:80]!r}: {error}") from None
        payload = decoded["payload"]
        item = self.items.get(payload.get("uid", "")) if isinstance(payload, dict) else None
        assert item is not None and item.valid, f"unknown message {raw[:120]!r} in Redis"
        return item, decoded

    def _ready_uids(self) -> list[str]:
        """The ready list, producer end (head) first."""
        return [self._identify(raw)[0].uid for raw in self.redis.lrange(KEYS.ready, 0, -1)]

    @staticmethod
    def _short(key: str) -> str:
        return key.rpartition(".")[2][:8]

    # -- what time does by itself, done on purpose ------------------------------------

    def _tick(self) -> None:
        """Live actors renew their claims, as the renewal loops do; a claim nobody renews is
        deleted, and a reservation getting close to its deadline gets one in the past, before
        either could lapse by itself."""
        self.clock += TICK
        now = self.clock
        for actor in self._acting():
            owned = [self._item(d) for d in self._owned(actor)]
            if not actor.stalled and actor.renews and (any(
                not item.claim or now - item.renewed > RENEW_AFTER for item in owned
            ) or (actor.registered and now - actor.record_renewed > RENEW_AFTER)):
                note(f"(renewal loop of {actor.name})")
                self._renew(actor)
        now = self.clock
        for actor in self.actors.values():
            if actor.record and now - actor.record_renewed > CLAIM_GUARD:
                note(f"(the record of {actor.name} lapses)")
                self._lapse_record(actor)
        for item in self._in(PROCESSING):
            if item.claim and now - item.renewed > CLAIM_GUARD:
                note(f"(the claim of {item.uid} lapses)")
                self._lapse(item)
        for res in list(self.res.values()):
            if res.registered and not res.expired and now - res.started > RESERVATION_GUARD:
                note(f"(reservation {self._short(res.key)} reaches its deadline)")
                self._expire(res)

    def _lapse(self, item: Item) -> None:
        assert item.pid is not None
        self.redis.delete(KEYS.claim(item.pid))
        item.claim = False

    def _lapse_record(self, actor: Actor) -> None:
        self.redis.delete(KEYS.supervisor(actor.name))
        actor.record = False

    def _expire(self, res: Res) -> None:
        self.forced += 1
        changed = self.redis.zadd(KEYS.reservations, {res.key: self.forced}, xx=True, ch=True)
        assert changed == 1, f"{res.key} was not registered"
        res.expired = True

    def _renew(self, actor: Actor) -> None:
        if actor.ours:
            self.run(self._extend_ours(actor))
        else:
            self._extend_php(actor)

    async def _extend_ours(self, actor: Actor) -> None:
        assert actor.broker is not None
        expected = [self._owns(d) for d in actor.held]
        started = self.clock
        owned = await actor.broker.extend(actor.held)
        assert owned == expected, (
            f"extend by {actor.name} of {[d.pid for d in actor.held]}: {owned}, "
            f"expected {expected}"
        )
        if not all(owned):
            event("extend reports a stale delivery")
        self._renewed(actor, started)

    def _extend_php(self, actor: Actor) -> None:
        assert actor.php is not None
        started = self.clock
        if actor.held:
            actor.php.extend(*actor.held)
        if not actor.renews:
            event("a PHP worker that never renews (Workerman) is asked to extend: no-op")
            return
        self._renewed(actor, started)

    def _renewed(self, actor: Actor, started: float) -> None:
        actor.stalled = False
        if actor.ours:
            actor.registered = actor.record = True
            actor.record_renewed = started
        for delivery in self._owned(actor):
            item = self._item(delivery)
            item.claim, item.renewed = True, started

    # -- model transitions --------------------------------------------------------------

    def _reserved(
        self, actor: Actor, handle: Any, key: str, payloads: list[bytes], started: float,
        wait: int = 0,
    ) -> None:
        uids = []
        for raw in payloads:
            item, _ = self._identify(raw)
            assert item.place == READY, f"{item.uid} reserved from {item.place}"
            item.place, item.reservation = RESERVED, key
            uids.append(item.uid)
        self.res[key] = Res(key, uids, started, wait)
        actor.pending.append(handle)
        note(f"{actor.name} reserved {uids} in {self._short(key)}")

    def _claimed(self, actor: Actor, item: Item, token: str, started: float) -> None:
        assert TOKEN.fullmatch(token), f"owner token {token!r} is not 32 lowercase hex"
        item.place, item.reservation, item.owner, item.holder = PROCESSING, None, token, actor.name
        item.claim, item.renewed = True, started
        self.claims += 1

    @staticmethod
    def _unhold(item: Item) -> None:
        item.owner, item.holder, item.claim = None, None, False

    def _returned(self, res: Res) -> list[str]:
        """A reservation's payloads went back to the ready list (consumer end)."""
        del self.res[res.key]
        for uid in res.uids:
            item = self.items[uid]
            item.place, item.reservation = READY, None
        return res.uids

    def _recovered_ours(self, items: list[Item], by_owner: bool = False) -> list[str]:
        """Our recovery (``by_owner``: the owner's own requeue at exit): the same pid
        requeued with attempts + 1, or dead at the limit. Returns the uids requeued. A
        sweep never takes a delivery from a living holder (see ``Actor.holds_live``)."""
        requeued = []
        for item in items:
            holder = self.actors.get(item.holder or "")
            if not by_owner and holder is not None and not holder.dead \
                    and holder.holds_live(item):
                raise AssertionError(
                    f"our recovery took {item.uid} from {holder.name}, alive and holding it")
            self._unhold(item)
            if item.oversized and not by_owner:
                # Too long for a sweep to read (records.lua): recovered unread, to dead, as it
                # is (only once old by its pid: see _recoverable).
                event("our sweep moves an oversized record to dead unread")
                item.place = DEAD
            elif ran_before(item.attempts) + 1 >= MAX_ATTEMPTS:
                event("our recovery dead-letters at max_attempts")
                item.place = DEAD
            else:
                item.place, item.attempts, item.old = READY, ran_before(item.attempts) + 1, False
                requeued.append(item.uid)
        return requeued

    def _recovered_php(self, items: list[Item], max_attempts: int | None) -> list[str]:
        """PHP's reap: a new pid requeued with attempts + 1, or (C) dead. Returns the uids
        requeued."""
        requeued = []
        for item in items:
            self._unhold(item)
            if max_attempts is not None and item.attempts >= max_attempts:
                event("PHP's reap dead-letters at reapMaxAttempts")
                item.place = DEAD
            else:
                item.place, item.attempts, item.old = READY, item.attempts + 1, False
                item.pid = None
                requeued.append(item.uid)
        if requeued:
            self._find_new_pids()
        return requeued

    def _find_new_pids(self) -> None:
        for raw in self.redis.lrange(KEYS.ready, 0, -1):
            item, decoded = self._identify(raw)
            if decoded is not None and item.pid is None:
                assert decoded["pid"] not in item.pids, f"PHP requeued {item.uid} with its pid"
                item.pid = decoded["pid"]
                item.pids.append(item.pid)
        lost = [i.uid for i in self.items.values() if i.valid and i.pid is None]
        assert not lost, f"requeued by PHP but not in the ready list: {lost}"

    def _check_ends(self, head: list[str], tail: list[list[str]]) -> None:
        """Requeued ones are at the producer end; returned reservations at the consumer end,
        each in the order it was taken (the first taken rightmost)."""
        ready = self._ready_uids()
        if head:
            assert set(ready[:len(head)]) == set(head), f"requeued {head}, ready {ready}"
        returned = [uid for group in tail for uid in group]
        if returned:
            assert set(ready[len(ready) - len(returned):]) == set(returned), (
                f"returned {tail}, ready {ready}"
            )
        for group in tail:
            positions = [ready.index(uid) for uid in group]
            assert positions == sorted(positions, reverse=True), (
                f"returned {group} out of order: ready {ready}"
            )

    # -- publishing -------------------------------------------------------------------

    @precondition(lambda self: self._room())
    @rule(
        who=st.sampled_from(["ours", "php", "crafted"]), count=st.integers(1, 3),
        old=st.booleans(), keyed=st.booleans(), extreme=st.booleans(),
        attempts=st.integers(0, MAX_ATTEMPTS - 1) | st.sampled_from(EXTREME_ATTEMPTS),
        depth=st.just(0) | st.integers(248, 509),
    )
    def publish(self, who: str, count: int, old: bool, attempts: int, keyed: bool,
                extreme: bool, depth: int) -> None:
        """Fresh messages through ``publish_many`` or PHP's ``publish``; old ones, or ones with
        attempts already made, as another producer (or a retry) wrote them, with LPUSH
        (``keyed``: with a fresh coalescing key, its marker set as PHP's coalesce does).
        Hostile ones PHP accepts too: ``depth`` (250 to 511 levels in all), attempts from
        -2**63 up, ``extreme`` timestamps (-2**63 when old, 2**63 - 1 when young)."""
        self._tick()
        uids = [self._new_uid() for _ in range(count)]
        phps = self._acting(ours=False)
        if who == "crafted" or old or attempts or extreme or (who == "php" and not phps):
            timestamp = int(time.time()) - (OLD if old else 0)
            if extreme:
                timestamp = INT64_MIN if old else INT64_MAX
            for uid in uids:
                item = Item(uid, True, pid=f"p{uid}", attempts=attempts, old=old, depth=depth)
                fields: dict[str, Any] = {}
                if keyed:
                    item.key = fields["key"] = f"k{uid}"
                    assert self.redis.set(KEYS.pending(item.key), item.pid, nx=True, ex=86400)
                self.redis.lpush(KEYS.ready, envelope.encode({
                    "pid": item.pid, "queue": QUEUE, "timestamp": timestamp,
                    "payload": item.payload, "attempts": attempts, **fields,
                }))
                self._add(item)
            return
        items = [Item(uid, True, depth=depth) for uid in uids]
        if who == "ours":
            broker = self._acting(ours=True)[0].broker
            assert broker is not None
            pids = self.run(broker.publish_many(QUEUE, [item.payload for item in items]))
        else:
            worker = phps[0].php
            assert worker is not None
            pids = [worker.publish(item.payload) for item in items]
        for item, pid in zip(items, pids, strict=True):
            item.pid = pid
            self._add(item)
        note(f"published {uids} as {pids}")

    @precondition(lambda self: self._room() and self._acting(ours=False))
    @rule(p=pick, reuse=st.integers(0, 3))
    def php_coalesce(self, p: int, reuse: int) -> None:
        """PHP's ``coalesce()``: published only while no pending message holds the key (its
        marker ``pending.{q}.{hex key}``, freed by the holder's commit, reject or dead letter,
        kept by a retry or a release, moved to the successor pid by PHP's requeue).
        ``reuse``: a key used before (0: a fresh one)."""
        self._tick()
        actor = self._pick(p, self._acting(ours=False))
        assert actor.php is not None
        used = sorted({item.key for item in self.items.values() if item.key})
        key = used[reuse % len(used)] if reuse and used else f"ku{self.serial + 1}"
        held = [i.uid for i in self.items.values() if i.key == key and i.place in PENDING]
        item = Item(self._new_uid(), True, key=key)
        published = actor.php.coalesce(item.payload, key)
        assert published == (not held), f"coalesce on {key}: {published}, holders {held}"
        if not published:
            event("coalesce: the key is pending, nothing published")
            return
        if used and key in used:
            event("coalesce: a key freed by its holder's settlement is used again")
        self._add(item)
        self._find_new_pids()

    @precondition(lambda self: self._room())
    @rule(
        batch=st.lists(st.booleans(), min_size=1, max_size=4).filter(any),
        old=st.booleans(), attempts=st.integers(0, MAX_ATTEMPTS - 1),
        pad=st.integers(1, 4096),
    )
    def publish_oversized(self, batch: list[bool], old: bool, attempts: int, pad: int) -> None:
        """Hostile: envelopes over our ENVELOPE_LIMIT (``True`` in ``batch``), otherwise valid,
        pushed in one LPUSH beside good ones, as a PHP producer (which has no limit) writes
        them. An old one has an old ``uniqid`` pid too (its age is all a sweep of ours can
        know of a record it does not read); a young one a pid that is no ``uniqid``."""
        self._tick()
        now = int(time.time())
        raws = []
        for big in batch[:MAX_ITEMS - len(self.items)]:
            uid = self._new_uid()
            pid = f"{now - OLD:08x}{self.serial:05x}" if big and old else f"p{uid}"
            item = Item(uid, True, pid=pid, attempts=attempts, old=old, pad=pad if big else 0)
            raw = envelope.encode({
                "pid": pid, "queue": QUEUE, "timestamp": now - (OLD if old else 0),
                "payload": item.payload, "attempts": attempts,
            })
            assert (len(raw) > ENVELOPE_LIMIT) == big, len(raw)
            raws.append(raw)
            self._add(item)
        self.redis.lpush(KEYS.ready, *raws)
        note(f"pushed {[(len(raw), raw[:20]) for raw in raws]}")

    @precondition(lambda self: self._room())
    @rule(kind=st.integers(0, len(MALFORMED) - 1))
    def publish_malformed(self, kind: int) -> None:
        self._tick()
        uid = self._new_uid()
        raw = MALFORMED[kind] % self.serial
        self.redis.lpush(KEYS.ready, raw)
        self._add(Item(uid, False, raw))
        note(f"{uid} = {raw!r}")

    # -- receiving: ours --------------------------------------------------------------

    @rule(c=pick, n=st.integers(1, 4), then_claim=st.booleans())
    def reserve(self, c: int, n: int, then_claim: bool) -> None:
        """Reserve up to n; with ``then_claim`` this is ``receive`` (reserve, then claim)."""
        self._tick()
        actor = self._pick(c, self._acting(ours=True))
        reservation = self.run(self._reserve_ours(actor, n))
        if reservation is not None and then_claim:
            self.run(self._claim_ours(actor, reservation))

    async def _receive_ours(self, actor: Actor, n: int) -> None:
        reservation = await self._reserve_ours(actor, n)
        if reservation is not None:
            await self._claim_ours(actor, reservation)

    async def _reserve_ours(self, actor: Actor, n: int) -> Reservation | None:
        assert actor.broker is not None
        ready = self.redis.lrange(KEYS.ready, 0, -1)
        registry = self.redis.zcard(KEYS.reservations)
        started = self.clock
        reservation = await actor.broker.reserve(n, 0)
        taken = ready[::-1][:n]
        assert reservation.payloads == [raw for raw in taken if len(raw) <= ENVELOPE_LIMIT], (
            "reserve must take from the right, all but the oversized")
        big = [raw for raw in taken if len(raw) > ENVELOPE_LIMIT]
        assert reservation.oversized == [len(raw) for raw in big], reservation.oversized
        self._parked(big)
        if not reservation.payloads:
            assert self.redis.zcard(KEYS.reservations) == registry, "empty reservation kept"
            return None
        self._reserved(actor, reservation, reservation.key, reservation.payloads, started)
        return reservation

    @precondition(lambda self: self._room() and not self._in(READY))
    @rule(c=pick, big=st.booleans())
    def reserve_blocking(self, c: int, big: bool) -> None:
        """On an empty queue: a message published while the consumer waits is reserved;
        ``big``: an oversized one, which the blocking move takes and claim.lua poisons (its
        bytes are dropped unread)."""
        self._tick()
        actor = self._pick(c, self._acting(ours=True))
        assert actor.broker is not None
        broker = actor.broker
        item = Item(self._new_uid(), True, pad=1 if big else 0)
        item.pid, raw = envelope.build(QUEUE, item.payload)
        self._add(item)

        async def wait_and_publish() -> Reservation:
            waiting = asyncio.ensure_future(broker.reserve(2, 3.0))  # 3 s for the push
            await asyncio.sleep(0.03)
            self.redis.lpush(KEYS.ready, raw)
            return await waiting

        started = self.clock
        reservation = self.run(wait_and_publish())
        if big:
            assert (reservation.payloads, reservation.oversized) == ([], [len(raw)]), reservation
            self._parked([raw])
            return
        assert reservation.payloads == [raw]
        self._reserved(actor, reservation, reservation.key, reservation.payloads, started, 3)

    @precondition(lambda self: self._room() and not self._in(READY))
    @rule(c=pick, recovered_by=st.sampled_from(["ours", "php", "nobody"]))
    def frozen_blocking_receive(self, c: int, recovered_by: str) -> None:
        """A blocking receive frozen (SIGSTOP, a VM pause) between registering its empty
        reservation and the BLMOVE, past the deadline; recovery runs meanwhile (an expired
        empty reservation is just unregistered); a message arrives; then the late BLMOVE
        lands in the reservation and the claim follows. (RedisBroker skips a BLMOVE after a
        freeze this long: this drives the lower level, the worst case.) The claim must put
        the payload back, whether the reservation is still registered or not."""
        self._tick()
        actor = self._pick(c, self._acting(ours=True))
        assert actor.broker is not None
        token = secrets.token_hex(16)
        key = KEYS.reservation(token)
        started = self.clock
        moved = self.run(actor.broker.scripts.call(
            "reserve", [KEYS.ready, KEYS.reservations, key], [2, LEASE, 1]
        ))
        assert moved == [] and self.redis.zscore(KEYS.reservations, key) is not None
        res = self.res[key] = Res(key, [], started, 1)
        note(f"{actor.name} registered blocking reservation {self._short(key)}, then froze")
        self._expire(res)
        phps = self._acting(ours=False)
        if recovered_by == "ours":
            sweeper = self._pick(c + 1, self._acting(ours=True))
            self.run(self._maintain_ours(sweeper, force=True))
        elif recovered_by == "php" and phps:
            self._php_maintain(self._pick(c, phps))
        item = Item(self._new_uid(), True)
        item.pid, raw = envelope.build(QUEUE, item.payload)
        self.redis.lpush(KEYS.ready, raw)
        self._add(item)
        late = self.redis.blmove(KEYS.ready, key, 1, "RIGHT", "LEFT")
        assert late is not None
        moved_item, _ = self._identify(late)
        moved_item.place, moved_item.reservation = RESERVED, key
        if key not in self.res:
            event("a late blocking move lands in a reservation already recovered")
            self.res[key] = Res(key, [], started, expired=True, registered=False)
        self.res[key].uids.append(moved_item.uid)
        reservation = Reservation(key, token, [late])
        actor.pending.append(reservation)
        self.run(self._claim_ours(actor, reservation))

    @precondition(lambda self: any(a.pending for a in self._acting(ours=True)))
    @rule(c=pick, r=st.integers(0, 3))
    def claim(self, c: int, r: int) -> None:
        self._tick()
        actor = self._pick(c, [a for a in self._acting(ours=True) if a.pending])
        self.run(self._claim_ours(actor, actor.pending[r % len(actor.pending)]))

    async def _claim_ours(self, actor: Actor, reservation: Reservation) -> None:
        assert actor.broker is not None
        actor.pending.remove(reservation)
        items = [self._identify(raw)[0] for raw in reservation.payloads]
        res = self.res.get(reservation.key)
        started = self.clock
        received = await actor.broker.claim(reservation)
        if res is None or not res.registered or res.expired:
            event("our claim of an expired or recovered reservation")
            if any(item.valid for item in items):  # it checked ownership with extend,
                actor.registered = actor.record = True  # which writes the record
                actor.record_renewed = started
            assert not received.deliveries and not received.poisoned, (
                f"{actor.name} claimed from expired {reservation.key}: {received}"
            )
            if res is not None:
                returned = self._returned(res)
                assert self._ready_uids()[::-1][:len(returned)] == returned, (
                    f"{returned} not back at the consumer end in taken order"
                )
            return
        good = [item for item in items if item.valid]
        assert [d.pid for d in received.deliveries] == [item.pid for item in good]
        assert [p.raw for p in received.poisoned] == [i.raw for i in items if not i.valid]
        assert received.deferred == 0
        for delivery, item in zip(received.deliveries, good, strict=True):
            assert (delivery.attempts, delivery.payload) == (item.attempts, item.payload)
            self._claimed(actor, item, delivery.receipt, started)
        assert len({d.receipt for d in received.deliveries}) <= 1, "one token per reservation"
        self._poisoned(items)
        del self.res[reservation.key]
        actor.held += received.deliveries
        note(f"{actor.name} holds {[(d.pid, d.receipt[:6]) for d in received.deliveries]}")

    def _parked(self, raws: list[bytes]) -> None:
        """Oversized envelopes our side poisoned unread: kept in poison byte for byte."""
        for raw in raws:
            item, _ = self._identify(raw)
            assert item.oversized and item.place == READY, f"{item.uid} in {item.place}"
            event("our reserve poisons an oversized envelope unread")
            item.place, item.raw = POISON, raw
            self.malformed[raw] = item.uid

    def _poisoned(self, items: list[Item]) -> None:
        for item in items:
            if not item.valid:
                event("claim poisons a malformed payload")
                item.place, item.reservation = POISON, None

    # -- receiving: PHP ---------------------------------------------------------------

    @precondition(lambda self: self._acting(ours=False))
    @rule(p=pick, n=st.integers(1, 4), then_claim=st.booleans())
    def php_receive(self, p: int, n: int, then_claim: bool) -> None:
        """PHP's receive(); without ``then_claim`` it stops between reserve and claim."""
        self._tick()
        actor = self._pick(p, self._acting(ours=False))
        self._php_reserve(actor, n, then_claim)

    def _php_reserve(self, actor: Actor, n: int, then_claim: bool) -> None:
        assert actor.php is not None
        ready = self.redis.lrange(KEYS.ready, 0, -1)
        started = self.clock
        reservation = actor.php.receive_reserve_only(n)
        assert reservation.batch == ready[::-1][:n], "PHP reserves from the right"
        if reservation.batch:
            self._reserved(actor, reservation, reservation.key, reservation.batch, started)
            if then_claim:
                self._claim_php(actor, reservation)

    @precondition(lambda self: self._room() and not self._in(READY) and self._acting(ours=False))
    @rule(p=pick)
    def php_receive_blocking(self, p: int) -> None:
        """PHP on an empty queue: registers first, blocks in BRPOPLPUSH, a message arrives."""
        self._tick()
        actor = self._pick(p, self._acting(ours=False))
        assert actor.php is not None
        item = Item(self._new_uid(), True)
        item.pid, raw = envelope.build(QUEUE, item.payload)
        self._add(item)
        producer = threading.Timer(0.03, self.redis.lpush, (KEYS.ready, raw))
        started = self.clock
        producer.start()
        try:
            reservation = actor.php.receive_reserve_only(2, timeout=3)  # 3 s for the push
        finally:
            producer.join()
        assert reservation.batch == [raw]
        self._reserved(actor, reservation, reservation.key, reservation.batch, started, 3)
        self._claim_php(actor, reservation)

    @precondition(lambda self: any(a.pending for a in self._acting(ours=False)))
    @rule(p=pick, r=st.integers(0, 3))
    def php_claim(self, p: int, r: int) -> None:
        self._tick()
        actor = self._pick(p, [a for a in self._acting(ours=False) if a.pending])
        self._claim_php(actor, actor.pending[r % len(actor.pending)])

    def _claim_php(self, actor: Actor, reservation: Any) -> None:
        assert actor.php is not None
        actor.pending.remove(reservation)
        items = [self._identify(raw)[0] for raw in reservation.batch]
        res = self.res.get(reservation.key)
        started = self.clock
        if res is None or not res.registered or res.expired:
            event("a PHP claim of an expired reservation fails (recovery returns it)")
            with pytest.raises(redis.ResponseError, match="Queue reservation expired"):
                actor.php.claim(reservation)
            return
        messages = actor.php.claim(reservation)
        good = [item for item in items if item.valid]
        assert [m.pid for m in messages] == [item.pid for item in good]
        for message, item in zip(messages, good, strict=True):
            assert (message.attempts, message.payload) == (item.attempts, item.payload)
            self._claimed(actor, item, message.receipt, started)
        self._poisoned(items)
        del self.res[reservation.key]
        actor.held += messages
        note(f"{actor.name} holds {[(m.pid, m.receipt[:6]) for m in messages]}")

    # -- the plain path -----------------------------------------------------------------

    @rule()
    def advance(self) -> None:
        """The plain path, one step: the first actor holding work settles its oldest delivery
        (commit, reject, commit, release, in turn); else the first with a reservation claims
        it; else one of ours or a PHP worker, in turn, receives up to 3."""
        self._tick()
        acting = self._acting()
        step = self.advances
        self.advances += 1
        holder = next((a for a in acting if a.held), None)
        if holder is not None:
            delivery = holder.held[0]
            if holder.ours:
                action = ADVANCE_ACTIONS[step % len(ADVANCE_ACTIONS)]
                note(f"{holder.name} settles {delivery.pid}: {action.value}")
                self.run(self._settle_ours(holder, [(delivery, action)]))
            else:
                op = PHP_OPS[step % len(PHP_OPS)]
                note(f"{holder.name} settles {delivery.pid}: {op}")
                self._settle_php(holder, delivery, op)
                holder.held.remove(delivery)
            return
        claimer = next((a for a in acting if a.pending), None)
        if claimer is not None:
            if claimer.ours:
                self.run(self._claim_ours(claimer, claimer.pending[0]))
            else:
                self._claim_php(claimer, claimer.pending[0])
            return
        phps = self._acting(ours=False)
        if step % 2 and phps:
            self._php_reserve(phps[0], 3, True)
            return
        self.run(self._receive_ours(self._acting(ours=True)[0], 3))

    # -- settling and renewing --------------------------------------------------------

    @precondition(lambda self: any(a.held for a in self._acting(ours=True)))
    @rule(
        c=pick,
        picks=st.lists(
            st.tuples(st.integers(0, 7), st.sampled_from(list(Action))), min_size=1, max_size=3
        ),
    )
    def settle(self, c: int, picks: list[tuple[int, Action]]) -> None:
        self._tick()
        actor = self._pick(c, [a for a in self._acting(ours=True) if a.held])
        chosen = [(actor.held[i % len(actor.held)], action) for i, action in picks]
        self.run(self._settle_ours(actor, chosen))

    async def _settle_ours(self, actor: Actor, chosen: list[tuple[Any, Action]]) -> None:
        assert actor.broker is not None
        expected = self._expect_settle(chosen)
        results = await actor.broker.settle(_settlements(chosen))
        released, retried = self._settled(actor, chosen, results, expected)
        # Releases go back to the consumer end in their order, retries to the producer end.
        ready = self._ready_uids()
        assert ready[::-1][:len(released)] == released, f"released {released}, ready {ready}"
        assert ready[:len(retried)] == retried[::-1], f"retried {retried}, ready {ready}"

    def _expect_settle(self, chosen: list[tuple[Any, Action]]) -> list[Outcome]:
        """Applied if still owned (the same delivery twice in one call: only the first)."""
        expected, applied = [], set()
        for delivery, _ in chosen:
            mine = self._owns(delivery) and delivery.pid not in applied
            expected.append(Outcome.OK if mine else Outcome.STALE)
            if mine:
                applied.add(delivery.pid)
        return expected

    def _settled(
        self, actor: Actor, chosen: list[tuple[Any, Action]], results: list[Result],
        expected: list[Outcome],
    ) -> tuple[list[str], list[str]]:
        """Check the outcomes and apply them; returns (released, retried) uids."""
        outcomes = [result.outcome for result in results]
        assert outcomes == expected, (
            f"{actor.name} settled {[(d.pid, a.value) for d, a in chosen]}: {outcomes}, "
            f"expected {expected}"
        )
        released, retried = [], []
        for (delivery, action), result in zip(chosen, results, strict=True):
            outcome = result.outcome
            if outcome is not Outcome.OK:
                event("settle of a delivery no longer owned is stale")
                continue
            item = self._item(delivery)
            if not item.claim:
                event("settle after the claim lapsed still applies")
            event(f"settle {action.value}: ok")
            self._unhold(item)
            if action is Action.COMMIT:
                item.place = DONE
                self.commits += 1
            elif action is Action.RELEASE:
                item.place = READY
                released.append(item.uid)
            else:
                self.fails += 1
                if ran_before(delivery.attempts) + 1 >= MAX_ATTEMPTS:
                    event("reject at max_attempts: failed")
                    item.place = FAILED  # the record kept as it was
                else:
                    item.place, item.attempts = READY, ran_before(delivery.attempts) + 1
                    item.old = False
                    if self._waits(actor, item, ran_before(delivery.attempts), result):
                        continue
                    retried.append(item.uid)
        for delivery, _ in chosen:
            if delivery in actor.held:
                actor.held.remove(delivery)
        return released, retried

    @staticmethod
    def _waits(actor: Actor, item: Item, runs: int, result: Result) -> bool:
        """A retry of a consumer with a backoff waits in the delayed set: True, and the
        model has it there; its delay is the policy's, jittered (half to all of it)."""
        assert actor.broker is not None
        policy = actor.broker.retry
        if not policy.backoff:
            assert result.detail == "retrying in 0 s", result
            return False
        ceiling = policy.delay(runs)
        waited = int((result.detail or "").removeprefix("retrying in ").removesuffix(" s"))
        assert math.ceil(ceiling / 2) <= waited <= ceiling, (result, ceiling)
        event("a retry waits for its backoff")
        item.place, item.waited, item.due = DELAYED, waited, False
        return True

    @precondition(lambda self: any(item.place == DELAYED and not item.due
                                   for item in self.items.values()))
    @rule(i=st.integers(0, 29))
    def backoff_passes(self, i: int) -> None:
        """A waiting retry's backoff passes: it is due, and the time stamped in its envelope
        is its failure's, now as far in the past as its delay (as versions before issue 39
        parked it: the promotion must stamp it anew, or it would look that old)."""
        self._tick()
        waiting = [item for item in self._in(DELAYED) if not item.due]
        self._backoff_passes(waiting[i % len(waiting)])

    def _backoff_passes(self, item: Item) -> None:
        for member in self.redis.zrange(KEYS.delayed, 0, -1):
            found, parked = self._identify(member)
            if found is item and parked is not None:
                failed_at = self._server_now() - item.waited - 1
                older = envelope.requeued(parked, parked["attempts"], failed_at)
                self.redis.zrem(KEYS.delayed, member)
                self.redis.zadd(KEYS.delayed, {older: 1})
                item.due = True
                note(f"the backoff of {item.uid} passes")
                return
        raise AssertionError(f"{item.uid} is not in the delayed set")

    def _promote(self, promoted: int, since: int) -> None:
        """Our maintenance moved ``promoted`` retries to the ready list: exactly the due
        ones, each stamped with the server's time of the promotion (from ``since`` on)."""
        due = [item for item in self._in(DELAYED) if item.due]
        assert promoted == len(due), f"promoted {promoted}, due {[i.uid for i in due]}"
        stamps = {}
        for raw in self.redis.lrange(KEYS.ready, 0, -1):
            item, decoded = self._identify(raw)
            if decoded is not None:
                stamps[item.uid] = decoded["timestamp"]
        for item in due:
            assert stamps.get(item.uid, -1) >= since, (
                f"{item.uid} promoted with the timestamp {stamps.get(item.uid)}, before {since}")
            item.place, item.due = READY, False
        if due:
            event("our maintenance promotes due retries, stamped with the server's time")

    def _server_now(self) -> int:
        return int(self.redis.time()[0])

    @precondition(lambda self: any(a.held for a in self._acting(ours=False)))
    @rule(
        p=pick,
        picks=st.lists(
            st.tuples(st.integers(0, 7), st.sampled_from(["commit", "reject", "release"])),
            min_size=1, max_size=3,
        ),
    )
    def php_settle(self, p: int, picks: list[tuple[int, str]]) -> None:
        """PHP settles one message per call; the same one twice: the second is NotOwned."""
        self._tick()
        actor = self._pick(p, [a for a in self._acting(ours=False) if a.held])
        chosen = [(actor.held[i % len(actor.held)], op) for i, op in picks]
        for message, op in chosen:
            self._settle_php(actor, message, op)
        for message, _ in chosen:
            if message in actor.held:
                actor.held.remove(message)

    def _settle_php(self, actor: Actor, message: Any, op: str) -> None:
        assert actor.php is not None
        settle = getattr(actor.php, op)
        if not self._owns(message):
            event("a PHP settlement of a delivery no longer owned: NotOwned")
            with pytest.raises(NotOwned):
                settle(message)
            return
        item = self._item(message)
        if not item.claim:
            event("a PHP worker settles after its claim lapsed (its handler outlasted it)")
        settle(message)
        self._unhold(item)
        if op == "commit":
            item.place = DONE
            self.commits += 1
        elif op == "reject":
            item.place = FAILED
            self.fails += 1
        else:
            item.place = READY
            assert self._ready_uids()[-1] == item.uid, "PHP releases to the consumer end"

    @precondition(lambda self: any(self._owned(a) for a in self._acting(ours=False)))
    @rule(p=pick)
    def php_release_all(self, p: int) -> None:
        """A PHP worker stopping gracefully releases what it holds, in order."""
        self._tick()
        actor = self._pick(p, [a for a in self._acting(ours=False) if self._owned(a)])
        assert actor.php is not None
        owned = self._owned(actor)
        actor.php.release(*owned)
        for message in owned:
            self._unhold(self._item(message))
            self._item(message).place = READY
            actor.held.remove(message)
        uids = [self._item(m).uid for m in owned]
        assert self._ready_uids()[::-1][:len(uids)] == uids, "released out of order"

    @rule(c=pick)
    def extend(self, c: int) -> None:
        self._tick()
        self.run(self._extend_ours(self._pick(c, self._acting(ours=True))))

    @precondition(lambda self: self._acting(ours=False))
    @rule(p=pick)
    def php_extend(self, p: int) -> None:
        self._tick()
        self._extend_php(self._pick(p, self._acting(ours=False)))

    # -- faults -----------------------------------------------------------------------

    @precondition(lambda self: any(item.claim for item in self._in(PROCESSING)))
    @rule(i=st.integers(0, 29))
    def lapse_claim(self, i: int) -> None:
        """A delivery's claim expires: its owner stalled past the lease (it may come back:
        extending renews it, settling still applies until someone recovers it)."""
        self._tick()
        live = [item for item in self._in(PROCESSING) if item.claim]
        if not live:  # _tick may have let them all lapse
            return
        item = live[i % len(live)]
        self._lapse(item)
        holder = self.actors.get(item.holder or "")
        if holder is not None and not holder.dead:
            holder.stalled = True
        note(f"the claim of {item.uid} ({item.holder}) lapsed")

    @precondition(lambda self: any(not r.expired and r.registered for r in self.res.values()))
    @rule(r=st.integers(0, 7))
    def expire_reservation(self, r: int) -> None:
        self._tick()
        live = [res for res in self.res.values() if res.registered and not res.expired]
        if live:  # _tick may have expired them all
            self._expire(live[r % len(live)])

    def _die(self, actor: Actor, lapsed: bool) -> None:
        """The actor stops for good. ``lapsed``: and its leases have run out already."""
        if lapsed:
            if actor.record:
                self._lapse_record(actor)
            for delivery in self._owned(actor):
                if self._item(delivery).claim:
                    self._lapse(self._item(delivery))
            for handle in actor.pending:
                res = self.res.get(handle.key)
                if res is not None and res.registered and not res.expired:
                    self._expire(res)
        if actor.pending:
            event("an actor dies between reserve and claim")
        if self._owned(actor):
            event("an actor dies holding deliveries")
        actor.dead, actor.held, actor.pending = True, [], []

    @precondition(
        lambda self: len(self._acting(ours=True)) > 1 or self.spawned["ours"] < MAX_OURS
    )
    @rule(c=pick, abandon=st.integers(0, 3), lapsed=st.booleans())
    def die(self, c: int, abandon: int, lapsed: bool) -> None:
        """One of ours stops for good, giving up the claims of its first ``abandon``
        deliveries at exit; a new consumer replaces it (while fewer than MAX_OURS started)."""
        self._tick()
        actor = self._pick(c, self._acting(ours=True))
        assert actor.broker is not None
        if abandon:
            # At exit its record goes and what it still owns it requeues itself, as
            # recovery would (the killed runs count); the registry entry stays.
            chosen = actor.held[:abandon]
            owned = [self._item(d) for d in chosen if self._owns(d)]
            self.run(actor.broker.abandon(chosen))
            actor.record = False
            self._check_ends(self._recovered_ours(owned, by_owner=True), [])
            if owned:
                event("a consumer requeues what it still owns at exit")
        self._die(actor, lapsed)
        if self.spawned["ours"] < MAX_OURS:
            note(f"{self._spawn_ours().name} replaces {actor.name}")

    @precondition(lambda self: self._acting(ours=False))
    @rule(p=pick, lapsed=st.booleans())
    def php_die(self, p: int, lapsed: bool) -> None:
        """A PHP worker is killed (its claims stay until its leases run out)."""
        self._tick()
        actor = self._pick(p, self._acting(ours=False))
        self._die(actor, lapsed)
        if self.spawned["php"] < MAX_PHP:
            note(f"{self._spawn_php().name} replaces {actor.name}")

    @precondition(lambda self: any(i.owner for i in self._in(PROCESSING)))
    @rule(i=st.integers(0, 29))
    def make_legacy(self, i: int) -> None:
        """Delete an owner key and its claim: the entry looks like a utopia-php/queue 1.x
        consumer's (never renewed, no owner)."""
        self._tick()
        owned = [item for item in self._in(PROCESSING) if item.owner]
        item = owned[i % len(owned)]
        assert item.pid is not None
        self.redis.delete(KEYS.owner(item.pid), KEYS.claim(item.pid))
        self._unhold(item)

    @rule()
    def script_flush(self) -> None:
        self._tick()
        self.redis.script_flush()

    # -- maintenance ------------------------------------------------------------------

    @rule(c=pick, mode=st.sampled_from(["interval", "locked", "forced"]))
    def maintain(self, c: int, mode: str) -> None:
        """Our sweep: the lock deleted first (the interval passed), held by another member
        of the fleet (skipped: nothing changes), or forced (the operator's ``recover``)."""
        self._tick()
        actor = self._pick(c, self._acting(ours=True))
        assert actor.broker is not None
        if mode == "locked":
            self.redis.set(KEYS.reap_lock, str(int(time.time())), ex=60)
            since = self._server_now()
            report = self.run(actor.broker.maintain())
            assert report.skipped and report.total == 0, report
            self._promote(report.promoted, since)  # every pass promotes, lock or not
            self.redis.delete(KEYS.reap_lock)
            return
        self.run(self._maintain_ours(actor, force=mode == "forced"))

    async def _maintain_ours(self, actor: Actor, *, force: bool) -> None:
        assert actor.broker is not None
        if not force:
            self.redis.delete(KEYS.reap_lock)
        expired, candidates = self._expired(), self._recoverable("ours", LIMIT)
        for item in self._in(PROCESSING):
            holder = self.actors.get(item.holder or "")
            if not item.claim and holder is not None and not holder.dead \
                    and holder.holds_live(item):
                who = "consumer of ours" if holder.ours else "PHP worker"
                event(f"our sweep keeps a living {who}'s delivery whose claim lapsed")
        since = self._server_now()
        report = await actor.broker.maintain(force=force)
        self._promote(report.promoted, since)
        expected = (
            sum(len(r.uids) for r in expired),
            sum(1 for item in candidates if item.owner is not None),
            sum(1 for item in candidates if item.owner is None),
        )
        actual = (report.expired_reservations, report.dead_consumers, report.legacy)
        assert actual == expected and not report.skipped, (
            f"maintain by {actor.name}: (reservations, dead, legacy) = {actual}, "
            f"expected {expected}"
        )
        tail = [self._returned(r) for r in expired]
        self._check_ends(self._recovered_ours(candidates), tail)
        if expected[1]:
            event("our sweep recovers deliveries whose claim lapsed")
        if expected[2]:
            event("our sweep recovers an old owner-less entry")

    @precondition(lambda self: self._acting(ours=False))
    @rule(p=pick, locked=st.booleans())
    def php_maintain(self, p: int, locked: bool) -> None:
        """PHP's sweep: the same lock (another holds it: skipped), then its own recovery."""
        self._tick()
        actor = self._pick(p, self._acting(ours=False))
        assert actor.php is not None
        if locked:
            self.redis.set(KEYS.reap_lock, str(int(time.time())), ex=5)
            assert actor.php.maintain() is None
            self.redis.delete(KEYS.reap_lock)
            return
        self._php_maintain(actor)

    def _php_maintain(self, actor: Actor) -> None:
        assert actor.php is not None
        self.redis.delete(KEYS.reap_lock)
        expired = self._expired()
        candidates = self._recoverable("php", 2 * LIMIT, actor.php.reap_after)
        requeued = actor.php.maintain()
        tail = [self._returned(r) for r in expired]
        head = self._recovered_php(candidates, actor.php.max_attempts)
        assert requeued == len(head), f"PHP's reap requeued {requeued}, expected {head}"
        self._check_ends(head, tail)
        if candidates:
            event("PHP's sweep recovers entries without a claim")
        if actor.php.reap_after and any(not i.claim and not i.old for i in self._in(PROCESSING)):
            event("PHP's sweep at the default reapAfter keeps young entries without a claim")

    @precondition(lambda self: any(self._owned(a) for a in self._acting()))
    @rule(
        c=pick, o=pick,
        meanwhile=st.sampled_from(
            ["extend", "commit", "maintain", "php_maintain", "redelivered"]
        ),
    )
    def maintain_racing(self, c: int, o: int, meanwhile: str) -> None:
        """Our sweep while something happens between its reads and its recovery script: an
        owner (ours or PHP) whose claims had lapsed renews them (``extend``) or commits its
        oldest delivery, or another sweep (ours, or PHP's) runs in full, or (``redelivered``)
        another of ours recovers them (the same pids), takes everything ready and stalls in
        turn (its claims lapse too). The scripts re-check: what was renewed, settled,
        recovered or re-owned meanwhile is untouched (the owner is no longer the one read),
        and the sweeps together recover each message once."""
        self._tick()
        sweeper = self._pick(c, self._acting(ours=True))
        assert sweeper.broker is not None
        holders = [a for a in self._acting() if self._owned(a)]
        if not holders:  # _tick may have changed who owns what
            return
        other = self._pick(o, holders)
        for delivery in self._owned(other):  # it stalled: its work looks abandoned
            if self._item(delivery).claim:
                self._lapse(self._item(delivery))
        if other.record:  # ours: its record lapses with its claims
            self._lapse_record(other)
        other.stalled = True
        phps = self._acting(ours=False)
        if meanwhile == "php_maintain" and not phps:
            meanwhile = "maintain"
        self.redis.delete(KEYS.reap_lock)
        expired = self._expired()
        read: list[tuple[Item, str | None, str | None]] = []

        async def act() -> None:
            if meanwhile == "extend":
                if other.ours:
                    await self._extend_ours(other)
                else:
                    self._extend_php(other)
            elif meanwhile == "commit":
                delivery = self._owned(other)[0]
                if other.ours:
                    await self._settle_ours(other, [(delivery, Action.COMMIT)])
                else:
                    self._settle_php(other, delivery, "commit")
                    other.held.remove(delivery)
            elif meanwhile == "maintain":
                await self._maintain_ours(self._pick(o + 1, self._acting(ours=True)), force=True)
            elif meanwhile == "redelivered":
                party = self._pick(o + 1, self._acting(ours=True))
                await self._maintain_ours(party, force=True)
                before = set(map(id, party.held))
                await self._receive_ours(party, MAX_ITEMS)
                for delivery in party.held:
                    if id(delivery) not in before and self._owns(delivery):
                        self._lapse(self._item(delivery))
                party.stalled = True
            else:
                self._php_maintain(self._pick(o, phps))

        original = recovery._read_state
        fired: list[bool] = []
        due = sum(1 for item in self._in(DELAYED) if item.due)
        since = self._server_now()

        async def read_then_act(*args: Any, **options: Any) -> Any:
            state = await original(*args, **options)
            if not fired:
                fired.append(True)
                self._promote(due, since)  # the pass promoted first, then read
                for res in expired:  # recovered before the reads
                    self._returned(res)
                read.extend((i, i.pid, i.owner) for i in self._recoverable("ours", LIMIT))
                await act()
            return state

        recovery._read_state = read_then_act
        try:
            report = self.run(sweeper.broker.maintain())
        finally:
            recovery._read_state = original
        assert fired, "someone owns work, so the sweep reads the processing entries"
        assert report.promoted == due, f"promoted {report.promoted}, due {due}"
        if read:
            event(f"{meanwhile} between our sweep's reads and its recovery script")
        recovered = [
            item for item, pid, owner in read
            if item.place == PROCESSING and (item.pid, item.owner) == (pid, owner)
            and not item.claim
        ]
        expected = (
            sum(len(r.uids) for r in expired),
            sum(1 for item in recovered if item.owner is not None),
            sum(1 for item in recovered if item.owner is None),
        )
        actual = (report.expired_reservations, report.dead_consumers, report.legacy)
        assert actual == expected and not report.skipped, (
            f"maintain by {sweeper.name} with {meanwhile} by {other.name} meanwhile: "
            f"(reservations, dead, legacy) = {actual}, expected {expected}"
        )
        self._recovered_ours(recovered)

    @rule(
        c=pick, side=st.sampled_from(["ours", "php", "both"]), scan=st.integers(1, 3),
        until_done=st.booleans(),
    )
    def sweep(self, c: int, side: str, scan: int, until_done: bool) -> None:
        """Sweeps with a tiny scan window: one pass may do part of the work. ``until_done``:
        passes one after another (ours, PHP's, or the two alternating on the shared cursor)
        reach every abandoned entry in a bounded number of passes."""
        self._tick()
        ours = self._pick(c, self._acting(ours=True))
        phps = self._acting(ours=False)
        php = self._pick(c, phps) if phps else None
        sides = {"ours": ["ours"], "php": ["php"], "both": ["ours", "php"]}[side]
        if php is None:
            sides = ["ours"]
        if not until_done:
            self._sweep_pass(sides[0], ours, php, scan)
            return
        # PHP's sweeps (reap_after 0) also take young owner-less entries, which ours leave:
        # taking turns with ours on the cursor they need not reach those.
        target = "php" if sides == ["php"] else "ours"
        reap_after = php.php.reap_after if php is not None and php.php is not None else 0
        # Strictly alternating, the shared cursor can livelock: each PHP pass leaves it where
        # our next pass looks at the newest end only, so an old entry only our sweep takes (a
        # dead supervisor of ours) is never in our window. Real sweeps take the lock in no
        # fixed order; two of ours in a row reach it.
        turns = ["ours", "php", "ours"] if len(sides) == 2 else sides
        bound = len(turns) * (2 * math.ceil(len(self._in(PROCESSING)) / scan) + 3)
        for passes in range(bound):
            if not self._recoverable(target, reap_after=reap_after) and (
                    sides == ["php"] or not self._expired()):
                if passes > len(sides):
                    event("a sweep took several passes")
                return
            self._sweep_pass(turns[passes % len(turns)], ours, php, scan)
        left = [item.uid for item in self._recoverable(target, reap_after=reap_after)]
        raise AssertionError(f"{bound} passes of scan {scan} by {sides} left {left}")

    def _sweep_pass(self, side: str, ours: Actor, php: Actor | None, scan: int) -> None:
        """One sweep with a tiny scan: it takes exactly the recoverable entries it looks at."""
        reap_after = php.php.reap_after if php is not None and php.php is not None else 0
        candidates = self._recoverable(side, scan, reap_after)
        if side == "ours":
            assert ours.broker is not None
            broker = ours.broker
            expired = self._expired()
            report = self.run(recovery.maintain(
                broker.client, broker.scripts, KEYS, lock_seconds=5, recovery_age=RECOVERY_AGE,
                max_attempts=MAX_ATTEMPTS, scan=scan, force=True,
                max_record_bytes=ENVELOPE_LIMIT,  # as RedisBroker.maintain passes it
            ))
            actual = (report.expired_reservations, report.dead_consumers, report.legacy)
            expected = (
                sum(len(r.uids) for r in expired),
                sum(1 for item in candidates if item.owner is not None),
                sum(1 for item in candidates if item.owner is None),
            )
            assert actual == expected, f"our sweep(scan={scan}) reported {actual}, not {expected}"
            tail = [self._returned(r) for r in expired]
            self._check_ends(self._recovered_ours(candidates), tail)
        else:
            assert php is not None and php.php is not None
            worker = php.php
            requeued = worker.reap(
                worker.reap_after, limit=LIMIT, max_attempts=worker.max_attempts,
                newer_than=worker.newer_than, scan=scan,
            )
            head = self._recovered_php(candidates, worker.max_attempts)
            assert requeued == len(head), f"PHP's reap(scan={scan}) said {requeued}, not {head}"
            self._check_ends(head, [])
        if candidates:
            event(f"a sweep with a tiny scan ({side}) recovers entries")

    # -- the invariant ----------------------------------------------------------------

    @invariant()
    def every_message_is_in_exactly_one_place(self) -> None:
        r = self.redis
        pipe = r.pipeline(transaction=False)
        for key in (KEYS.ready, KEYS.processing, KEYS.failed, KEYS.dead, KEYS.poison):
            pipe.lrange(key, 0, -1)
        pipe.zrange(KEYS.reservations, 0, -1, withscores=True)
        pipe.mget([KEYS.stat(name) for name in STATS])
        pipe.keys(f"{NS}.*")
        pipe.time()
        pipe.zrange(KEYS.delayed, 0, -1, withscores=True)
        ready, processing, failed, dead, poison, registry, stats, keys, now, delayed = (
            pipe.execute())
        keys = {key.decode() for key in keys}
        markers = sorted(k for k in keys if k.startswith(KEYS.pending("")))
        registry = {key.decode(): score for key, score in registry}
        lists = sorted(k for k in keys if k.startswith(KEYS.reservations + "."))
        places = [(PROCESSING, processing), (FAILED, failed), (DEAD, dead)]
        entries = [(place, pid.decode()) for place, pids in places for pid in pids]

        pipe = r.pipeline(transaction=False)
        for key in lists:
            pipe.lrange(key, 0, -1)
        for _, pid in entries:
            pipe.get(KEYS.job(pid))
            pipe.get(KEYS.owner(pid))
            pipe.get(KEYS.claim(pid))
            pipe.pttl(KEYS.claim(pid))
        for key in markers:
            pipe.get(key)
        replies = pipe.execute()
        contents = dict(zip(lists, replies, strict=False))
        records = replies[len(lists):len(replies) - len(markers)]
        holders = {
            key: value.decode() for key, value in zip(
                markers, replies[len(replies) - len(markers):], strict=True
            )
        }

        seen: dict[str, list[str]] = {}

        def found(item: Item, place: str, decoded: dict[str, Any] | None) -> None:
            seen.setdefault(item.uid, []).append(place)
            if decoded is not None:
                got = (decoded["pid"], decoded["attempts"], decoded["payload"], decoded.get("key"))
                want = (item.pid, item.attempts, item.payload, item.key)
                assert got == want, f"{item.uid} in {place}: {got}, expected {want}"

        for raw in ready:
            item, decoded = self._identify(raw)
            found(item, READY, decoded)

        for member, score in delayed:  # due: in whole seconds of the server clock
            item, decoded = self._identify(member)
            found(item, DELAYED, decoded)
            assert score == int(score) and (score <= now[0]) == item.due, (
                f"{item.uid} delayed until {score} (now {now[0]}), expected due: {item.due}")
            assert item.due or score <= now[0] + item.waited, (
                f"{item.uid} delayed until {score}, more than {item.waited} s after {now[0]}")

        expected_registry = {key for key, res in self.res.items() if res.registered}
        assert set(registry) == expected_registry, (
            f"registered reservations {sorted(map(self._short, registry))}, expected "
            f"{sorted(map(self._short, expected_registry))}"
        )
        for key in lists:
            assert key in registry, f"stranded: a list no registry names: {key} {contents[key]}"
        for key, res in self.res.items():
            uids = []
            for raw in reversed(contents.get(key, [])):  # the last taken is at the head
                item, decoded = self._identify(raw)
                found(item, f"reservation {self._short(key)}", decoded)
                uids.append(item.uid)
            assert uids == res.uids, f"{key} holds {uids}, expected {res.uids}"
            if res.registered:
                score = registry[key]
                assert (score <= now[0]) == res.expired, (
                    f"{key} deadline {score} (now {now[0]}), expected expired: {res.expired}"
                )
                # Whole seconds of the server clock: now + lease (+ the blocking timeout).
                due = now[0] + LEASE + res.wait
                assert res.expired or (score == int(score) and score <= due), (
                    f"{key} deadline {score}: not now + {LEASE} (+ {res.wait}) s (now {now[0]})"
                )

        by_pid = {item.pid: item for item in self.items.values() if item.pid is not None}
        for index, (place, pid) in enumerate(entries):
            item = by_pid.get(pid)
            assert item is not None, f"{place} holds unknown pid {pid!r}"
            record, owner, claim, ttl = records[4 * index:4 * index + 4]
            assert record is not None, f"{pid} in {place} without a job record"
            found(item, place, envelope.decode(record))
            if place == PROCESSING:
                assert (owner.decode() if owner else None) == item.owner, (
                    f"{item.uid} ({pid}) in processing: owner {owner!r}, expected {item.owner}"
                )
                assert (claim is not None) == item.claim, (
                    f"{item.uid} ({pid}): claim {claim!r}, expected a claim: {item.claim}"
                )
                assert claim is None or claim == owner, f"{pid}: claim {claim!r} owner {owner!r}"
                assert claim is None or 0 < ttl <= LEASE * 1000, f"{pid}: claim for {ttl} ms"
            else:
                assert owner is None and claim is None, f"{pid} in {place} still owned"

        for raw in poison:
            assert raw in self.malformed, f"poison holds {raw[:80]!r}, not a malformed payload"
            found(self.items[self.malformed[raw]], POISON, None)

        for item in self.items.values():
            expected = {
                READY: [READY], PROCESSING: [PROCESSING], FAILED: [FAILED], DEAD: [DEAD],
                POISON: [POISON], DONE: [], DELAYED: [DELAYED],
                RESERVED: [f"reservation {self._short(item.reservation or '')}"],
            }[item.place]
            assert seen.get(item.uid, []) == expected, (
                f"{item.uid} is in {seen.get(item.uid, [])}, expected {expected}"
            )

        expected_holders = {
            KEYS.pending(i.key): i.pid for i in self.items.values() if i.key and i.place in PENDING
        }
        assert holders == expected_holders, (
            f"coalescing markers {holders}, expected {expected_holders}"
        )

        # No key the model cannot explain (records, owners and claims of settled work gone).
        held = self._in(PROCESSING)
        explained = {
            *KEYS.all_fixed(), KEYS.dead, *lists,
            *(KEYS.job(pid) for _, pid in entries),
            *(KEYS.owner(i.pid) for i in held if i.owner and i.pid),
            *(KEYS.claim(i.pid) for i in held if i.claim and i.pid),
            *(KEYS.supervisor(a.name) for a in self.actors.values() if a.ours),
            *markers,
            # Our failure records of the pids in failed or dead (issue 25.2).
            *(KEYS.error(pid) for place, pid in entries if place in (FAILED, DEAD)),
            # Failure histories (issue 41.7): of any pid that failed an attempt; checked
            # below to be bounded and to expire (a PHP commit leaves one until then).
            *(key for key in keys if key.startswith(KEYS.failures(""))),
        }
        assert keys <= explained, f"unexplained keys: {sorted(keys - explained)}"
        # Each of our failure records and histories expires, even with job_ttl 0 (issue
        # 39.4), and a history holds at most the first failure and the last FAILURES_KEPT.
        errors = sorted(key for key in keys if key.startswith(KEYS.error(""))
                        or key.startswith(KEYS.failures("")))
        pipe = r.pipeline(transaction=False)
        for key in errors:
            pipe.ttl(key)
            pipe.type(key)
            pipe.llen(key) if key.startswith(KEYS.failures("")) else pipe.strlen(key)
        replies = pipe.execute()
        for index, key in enumerate(errors):
            lives, kind, size = replies[3 * index:3 * index + 3]
            assert 0 < lives <= RECORD_TTL_WITHOUT_JOB_TTL, f"{key} kept for {lives} s"
            if key.startswith(KEYS.failures("")):
                assert kind == b"list" and 0 < size <= FAILURES_KEPT + 1, (key, kind, size)

        counted = dict(zip(STATS, (int(v or 0) for v in stats), strict=True))
        expected_stats = {
            "total": self.claims, "processing": len(processing), "success": self.commits,
            "failed": self.fails,
        }
        assert counted == expected_stats, f"counters {counted}, expected {expected_stats}"
        assert len(processing) == len(held), f"processing {processing}, model {held}"

    # -- the end: drain ---------------------------------------------------------------

    def _drain(self) -> None:
        """Faults stop; live actors settle what they hold; the leases of the dead run out;
        recovery and a fresh consumer run until nothing is left but done, failed, dead and
        poison."""
        note("drain")
        for actor in self._acting():
            actor.stalled = False
            for handle in list(actor.pending):
                if actor.ours:
                    self.run(self._claim_ours(actor, handle))
                else:
                    self._claim_php(actor, handle)
            owned = self._owned(actor)
            if actor.ours and owned:
                self.run(self._settle_ours(actor, [(d, Action.COMMIT) for d in owned]))
            for message in owned if not actor.ours else []:
                self._settle_php(actor, message, "commit")
            actor.held = []
        self.every_message_is_in_exactly_one_place()
        ours, php = self._spawn_ours(), self._spawn_php(max_attempts=MAX_ATTEMPTS, reap_after=0)
        assert ours.broker is not None
        for _ in range(5):
            for res in self.res.values():
                if res.registered and not res.expired:
                    self._expire(res)
            for item in self._in(PROCESSING):
                if item.claim:
                    self._lapse(item)
            for item in self._in(DELAYED):
                if not item.due:
                    self._backoff_passes(item)
            self.run(self._maintain_ours(ours, force=True))
            self._php_maintain(php)  # owner-less entries younger than RECOVERY_AGE too
            for _ in range(MAX_ITEMS):
                if not self._in(READY):
                    break
                self.run(self._receive_ours(ours, 10))
                if ours.held:
                    self.run(self._settle_ours(ours, [(d, Action.COMMIT) for d in ours.held]))
            self.every_message_is_in_exactly_one_place()
            if not any(self._in(place) for place in (READY, RESERVED, PROCESSING, DELAYED)):
                break
        future = [i for i in self.items.values() if self._stranded_by_its_timestamp(i)]
        left = {i.uid: i.place for i in self.items.values() if i.place not in (
            DONE, FAILED, DEAD, POISON) and i not in future}
        assert not left, f"drain left {left}"
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(KEYS.ready)
        pipe.llen(KEYS.processing)
        pipe.exists(KEYS.reservations, KEYS.delayed)
        pipe.get(KEYS.stat("processing"))
        pipe.keys(f"{NS}.*")
        ready, processing, registry, in_process, keys = pipe.execute()
        assert (ready, processing, registry, int(in_process or 0)) == (
            0, len(future), 0, len(future))
        kept = {f".{i.pid}".encode() for i in future}
        stranded = [
            k for k in keys
            if re.match(rb".*\.(reservations|owners|claims)\." + QUEUE.encode() + rb"\.", k)
            and not any(k.endswith(pid) for pid in kept)
        ]
        assert not stranded, f"keys left after the drain: {stranded}"
        assert self.commits == len(self._in(DONE))


def _settlements(chosen: list[tuple[Any, Action]]) -> list[Settlement]:
    return [
        Settlement(action, delivery, "handler failed" if action is Action.REJECT else None)
        for delivery, action in chosen
    ]


@pytest.mark.parametrize("shard", range(SHARDS))
def test_redis_broker_protocol(redis_url: str, shard: int) -> None:
    """Every message stays in exactly one place through any interleaving of the rules
    (``SHARDS`` runs with seeds ``SEED + shard``: xdist spreads them over its workers)."""
    machine = seed(SEED + shard)(
        type("RedisBrokerProtocol", (BrokerProtocol,), {"url": redis_url}))
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
            suppress_health_check=list(HealthCheck), print_blob=True,
        ))
    except BaseException as error:
        error.add_note(f"reproduce with QS_PROPERTY_SEED={SEED + shard} QS_PROPERTY_SHARDS=1")
        raise

