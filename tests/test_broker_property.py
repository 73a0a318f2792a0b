"""A property test of the Redis broker protocol (SPEC §5) against its guarantee (SPEC §9).

A hypothesis state machine interleaves, on one private redis-server, the operations of up to
three ``RedisBroker`` consumers (different consumer ids, a 3 s lease) with the faults the
protocol must survive:

- publish (``publish_many``; crafted envelopes, some with an old timestamp or a few attempts
  already made; malformed raw bytes pushed with LPUSH, as a broken producer would),
- reserve (non-blocking, and blocking on an empty queue with a message arriving meanwhile),
  and claim -- or no claim: a consumer that dies between the move and the claim,
- settle: commit, reject (retry, or failed at ``max_attempts``), release; several in one call,
  the same delivery twice in one call included,
- extend (also done automatically, as the renewal loop would, for every consumer whose
  heartbeat is alive and older than lease/3),
- heartbeat expiry (DEL of a consumer's heartbeat: the consumer is stalled, it may come back
  and act later), a reservation's deadline passing (ZADD of a score in the past; done
  automatically before a reservation could expire by itself), consumer death (it stops acting
  and its heartbeat is deleted), an owner key deleted (the entry looks like a legacy PHP
  consumer's),
- maintenance from any consumer still acting: ``maintain()`` (the lock deleted first, or held
  by someone else: then the run is skipped and changes nothing); maintenance while another
  consumer renews or commits between maintenance's reads and its recovery script (the
  script's re-checks decide); sweeps with a tiny batch, each of which may do part of the
  work, and which one after another must reach every abandoned entry (the cursor),
- SCRIPT FLUSH.

The model knows where every message is and what each consumer believes it holds. After every
step the real Redis state is compared with it (SPEC §9): each published pid is in exactly one
place -- the ready list, a registered reservation list (one that is a member of the
reservations zset), processing (the pid in the processing list, a job record, and the owner
token of its delivery, or no owner key when the test made it legacy), failed (job record
kept), or done (committed: nowhere, no job record, no owner key). Malformed payloads are in
the ready list, a reservation, or poison; poison never holds a valid envelope. Nothing is in
two places, nothing valid is in none unless it was committed, no key is left that the model
cannot explain, and each envelope still carries its payload and the attempts the model
counted.

Counters (as ``lua/claim.lua``, ``lua/settle.lua`` and ``lua/recover_processing.lua`` keep
them):

- ``stats.total`` = deliveries claimed (a redelivery counts again) + payloads poisoned;
- ``stats.processing`` = LLEN processing (claims add, every applied settlement and every
  recovered entry subtracts);
- ``stats.success`` = commits that returned ``ok``;
- ``stats.failed`` = rejects at ``max_attempts`` that returned ``ok`` + payloads poisoned.

Outcomes are predicted, not just observed: a settlement or renewal of a delivery whose owner
token is no longer the one it holds (recovered, re-delivered, made legacy, or settled earlier
in the same call) must return ``stale`` (``False`` from extend) and change nothing; every other
one must apply. A claim of an expired or recovered reservation claims nothing.

Reserve must take from the consumer end (right); a release goes back to that end in order, a
retry to the producer end. A zero-argument rule, ``advance``, walks the plain path (reserve,
claim, settle) so that most examples get far enough for the faults to matter.

Size: ``QS_PROPERTY_EXAMPLES`` (default 30) examples of up to ``QS_PROPERTY_STEPS`` (default
50) steps, a few seconds; a longer hunt is e.g. ``QS_PROPERTY_EXAMPLES=500
QS_PROPERTY_STEPS=100``. ``QS_PROPERTY_SEED`` fixes hypothesis's seed (a failure names the seed
it ran with, and prints the shrunk sequence of steps with what each one did). Wall-clock time
only enters through the automatic renewals and deadlines above, so a seed replays the same
steps unless a step is slower than about a second.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
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

from broker import envelope, recovery
from broker.base import Action, Delivery, Outcome, Result, Settlement
from broker.keys import QueueKeys, owner_consumer
from broker.redis import RedisBroker, Reservation
from broker.scripts import Scripts

#: A passing run takes seconds; a failing one also shrinks its example, which can take minutes.
pytestmark = pytest.mark.timeout(300)

NS = "utopia-queue"
QUEUE = "stats-usage"
KEYS = QueueKeys(NS, QUEUE)

LEASE = 3.0
MAX_ATTEMPTS = 3
RECOVERY_AGE = 90_000
OLD = 100_000  # an old envelope is this many seconds older than now: past RECOVERY_AGE
RENEW_AFTER = LEASE / 3  # a live consumer's heartbeat is renewed when older than this
EXPIRE_GUARD = LEASE - 1.0  # a reservation this old is expired on purpose before it can lapse

MAX_ITEMS = 30  # messages published per example
MAX_CONSUMERS = 6  # consumers started per example (at most three acting at once)

EXAMPLES = int(os.environ.get("QS_PROPERTY_EXAMPLES", "30"))
STEPS = int(os.environ.get("QS_PROPERTY_STEPS", "50"))
SEED = int(os.environ.get("QS_PROPERTY_SEED") or random.randrange(2**32))

#: Malformed payloads (``%d`` keeps each one unique, so the model can follow it).
MALFORMED = (
    b"{not json %d",
    b'["an array", %d]',
    b'{"pid":"m%d","queue":"stats-usage","payload":{}}',  # no timestamp
    b'{"pid":"m%d","queue":"stats-usage","timestamp":"1710000000","payload":{}}',
    b'{"pid":"","queue":"stats-usage","timestamp":%d,"payload":{}}',
    b'{"pid":"m%d","queue":"stats-usage","timestamp":1,"payload":"text"}',
    b'{"pid":"m%d","queue":"stats-usage","timestamp":1,"payload":{},"attempts":-1}',
)

#: What the ``advance`` rule does with deliveries, in turn.
ADVANCE_ACTIONS = (Action.COMMIT, Action.REJECT, Action.COMMIT, Action.RELEASE)

# Where a message is (the model's view).
READY, RESERVED, PROCESSING, FAILED, POISON, DONE = (
    "ready", "reserved", "processing", "failed", "poison", "done",
)


@dataclass
class Item:
    """One published message: a valid envelope (named by its pid) or malformed bytes."""

    name: str
    raw: bytes
    valid: bool
    payload: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    old: bool = False  # published long ago (legacy recovery applies to it)
    place: str = READY
    reservation: str | None = None  # the reservation key while RESERVED
    owner: str | None = None  # the owner token while PROCESSING (None: made legacy)


@dataclass
class Registered:
    """A reservation registered in the reservations zset, as the model expects it."""

    key: str
    names: list[str]  # in reservation order
    started: float  # monotonic time before the reserve call
    expired: bool = False  # its deadline was moved into the past


@dataclass
class Consumer:
    name: str
    broker: RedisBroker
    dead: bool = False
    heartbeat: bool = False  # the heartbeat key exists
    renewed: float = 0.0  # monotonic time before the last heartbeat write
    held: list[Delivery] = field(default_factory=list)  # claimed, not settled by it
    pending: list[Reservation] = field(default_factory=list)  # reserved, not claimed


consumer_pick = st.integers(0, 5)


class BrokerProtocol(RuleBasedStateMachine):
    url = ""  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.redis = redis.Redis.from_url(self.url)
        self.redis.flushall()
        self.redis.script_flush()
        self.loop = asyncio.new_event_loop()
        self.items: dict[str, Item] = {}
        self.malformed: dict[bytes, str] = {}  # raw -> name
        self.registered: dict[str, Registered] = {}
        self.consumers: list[Consumer] = []
        self.serial = 0
        self.forced = 0  # deadlines moved into the past so far
        self.claims = self.poisoned = self.commits = self.fails = 0
        self.advances = 0
        for _ in range(3):
            self._spawn()

    def teardown(self) -> None:
        for consumer in self.consumers:
            self.run(consumer.broker.close())
        self.loop.close()
        self.redis.close()

    # -- helpers ----------------------------------------------------------------------

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def _spawn(self) -> Consumer:
        name = f"c{len(self.consumers)}"
        broker = RedisBroker(
            self.url, QUEUE, namespace=NS, consumer_id=name, lease=LEASE,
            max_attempts=MAX_ATTEMPTS, recovery_age=RECOVERY_AGE,
        )
        consumer = Consumer(name, broker)
        self.consumers.append(consumer)
        return consumer

    def _acting(self) -> list[Consumer]:
        return [consumer for consumer in self.consumers if not consumer.dead]

    def _pick(self, index: int, consumers: list[Consumer] | None = None) -> Consumer:
        consumers = self._acting() if consumers is None else consumers
        return consumers[index % len(consumers)]

    def _by_id(self, consumer_id: str) -> Consumer:
        return next(c for c in self.consumers if c.name == consumer_id)

    def _room(self) -> bool:
        return len(self.items) < MAX_ITEMS

    def _in(self, place: str) -> list[Item]:
        return [item for item in self.items.values() if item.place == place]

    def _owns(self, delivery: Delivery) -> bool:
        item = self.items[delivery.pid]
        return item.place == PROCESSING and item.owner == delivery.receipt

    def _identify(self, raw: bytes) -> tuple[Item, dict[str, Any] | None]:
        """The model's item for raw bytes found in Redis (and the envelope, if valid)."""
        if raw in self.malformed:
            return self.items[self.malformed[raw]], None
        try:
            decoded = envelope.decode(raw)
        except envelope.MalformedEnvelope as error:
            raise AssertionError(f"unknown malformed payload {raw[:80]!r}: {error}") from None
        item = self.items.get(decoded["pid"])
        assert item is not None and item.valid, f"unknown pid {decoded['pid']!r} in Redis"
        return item, decoded

    def _add(self, item: Item) -> None:
        assert item.name not in self.items
        self.items[item.name] = item
        if not item.valid:
            self.malformed[item.raw] = item.name

    def _tick(self) -> None:
        """What wall-clock time would do by itself, done on purpose so the model knows.

        Live consumers renew their heartbeat every lease/3, as the supervisor's renewal loop
        does; a reservation that is getting close to its deadline gets a deadline in the past.
        """
        now = time.monotonic()
        for consumer in self._acting():
            if consumer.heartbeat and now - consumer.renewed > RENEW_AFTER:
                note(f"(renewal loop of {consumer.name})")
                self._extend(consumer)
        for registered in list(self.registered.values()):
            if not registered.expired and now - registered.started > EXPIRE_GUARD:
                note(f"(reservation {self._short(registered.key)} reaches its deadline)")
                self._expire(registered)

    def _expire(self, registered: Registered) -> None:
        self.forced += 1
        score = {registered.key: self.forced}
        changed = self.redis.zadd(KEYS.reservations, score, xx=True, ch=True)
        assert changed == 1, f"{registered.key} was not registered"
        registered.expired = True

    def _extend(self, consumer: Consumer) -> None:
        expected = [self._owns(delivery) for delivery in consumer.held]
        started = time.monotonic()
        owned = self.run(consumer.broker.extend(consumer.held))
        self._extended(consumer, owned, expected, started)

    def _extended(
        self, consumer: Consumer, owned: list[bool], expected: list[bool], started: float
    ) -> None:
        consumer.heartbeat, consumer.renewed = True, started
        assert owned == expected, (
            f"extend by {consumer.name} of {[d.pid for d in consumer.held]}: {owned}, "
            f"expected {expected}"
        )
        if not all(owned):
            event("extend reports a stale delivery")

    @staticmethod
    def _short(key: str) -> str:
        return key.rpartition(".")[2]

    # -- publishing -------------------------------------------------------------------

    @precondition(lambda self: self._room())
    @rule(
        c=consumer_pick, count=st.integers(1, 3), old=st.booleans(),
        attempts=st.integers(0, MAX_ATTEMPTS - 1),
    )
    def publish(self, c: int, count: int, old: bool, attempts: int) -> None:
        """Fresh messages through ``publish_many``; old ones, or ones with attempts already
        made, as another producer (or a retry) wrote them, with a raw LPUSH."""
        self._tick()
        payloads = [{"n": self.serial + i, "url": "https://example.com/a/b"} for i in range(count)]
        self.serial += count
        if not old and not attempts:
            pids = self.run(self._pick(c).broker.publish_many(QUEUE, payloads))
            for pid, payload in zip(pids, payloads, strict=True):
                self._add(Item(pid, b"", True, payload))
            note(f"published {pids}")
            return
        timestamp = int(time.time()) - (OLD if old else 0)
        for payload in payloads:
            pid = f"p{payload['n']}"
            raw = envelope.encode({
                "pid": pid, "queue": QUEUE, "timestamp": timestamp, "payload": payload,
                "attempts": attempts,
            })
            self.redis.lpush(KEYS.ready, raw)
            self._add(Item(pid, raw, True, payload, attempts, old))

    @precondition(lambda self: self._room())
    @rule(kind=st.integers(0, len(MALFORMED) - 1))
    def publish_malformed(self, kind: int) -> None:
        self._tick()
        self.serial += 1
        raw = MALFORMED[kind] % self.serial
        self.redis.lpush(KEYS.ready, raw)
        self._add(Item(f"m{self.serial}", raw, False))
        note(f"m{self.serial} = {raw!r}")

    # -- receiving --------------------------------------------------------------------

    @rule(c=consumer_pick, n=st.integers(1, 4), then_claim=st.booleans())
    def reserve(self, c: int, n: int, then_claim: bool) -> None:
        """Reserve up to n; with ``then_claim`` this is ``receive`` (reserve, then claim)."""
        self._tick()
        consumer = self._pick(c)
        ready = self.redis.lrange(KEYS.ready, 0, -1)
        registry = self.redis.zcard(KEYS.reservations)
        started = time.monotonic()
        reservation = self.run(consumer.broker.reserve(n, 0))
        assert reservation.payloads == ready[::-1][:n], "reserve must take from the right"
        if not reservation.payloads:
            assert self.redis.zcard(KEYS.reservations) == registry, "empty reservation kept"
            return
        self._reserved(consumer, reservation, started)
        if then_claim:
            self._claim(consumer, reservation)

    @precondition(lambda self: self._room() and not self._in(READY))
    @rule(c=consumer_pick)
    def reserve_blocking(self, c: int) -> None:
        """On an empty queue: a message published while the consumer waits is reserved."""
        self._tick()
        consumer = self._pick(c)
        self.serial += 1
        pid, raw = envelope.build(QUEUE, {"n": self.serial})
        self._add(Item(pid, raw, True, {"n": self.serial}))

        async def wait_and_publish() -> Reservation:
            waiting = asyncio.ensure_future(consumer.broker.reserve(2, 1.0))
            await asyncio.sleep(0.03)
            self.redis.lpush(KEYS.ready, raw)
            return await waiting

        started = time.monotonic()
        reservation = self.run(wait_and_publish())
        assert reservation.payloads == [raw]
        self._reserved(consumer, reservation, started)

    def _reserved(self, consumer: Consumer, reservation: Reservation, started: float) -> None:
        names = []
        for raw in reservation.payloads:
            item, _ = self._identify(raw)
            assert item.place == READY, f"{item.name} reserved from {item.place}"
            item.place, item.reservation = RESERVED, reservation.key
            names.append(item.name)
        self.registered[reservation.key] = Registered(reservation.key, names, started)
        consumer.pending.append(reservation)
        note(f"{consumer.name} reserved {names} in {self._short(reservation.key)}")

    @precondition(lambda self: any(c.pending for c in self._acting()))
    @rule(c=consumer_pick, r=st.integers(0, 3))
    def claim(self, c: int, r: int) -> None:
        self._tick()
        consumer = self._pick(c, [c for c in self._acting() if c.pending])
        self._claim(consumer, consumer.pending[r % len(consumer.pending)])

    def _claim(self, consumer: Consumer, reservation: Reservation) -> None:
        consumer.pending.remove(reservation)
        items = [self._identify(raw)[0] for raw in reservation.payloads]
        registered = self.registered.get(reservation.key)
        started = time.monotonic()
        received = self.run(consumer.broker.claim(reservation))
        if registered is None or registered.expired:
            event("claim of an expired or recovered reservation")
            assert not received.deliveries and not received.poisoned, (
                f"{consumer.name} claimed from expired {reservation.key}: {received}"
            )
            if any(item.valid for item in items):  # the ownership check renewed the heartbeat
                consumer.heartbeat, consumer.renewed = True, started
            return
        good = [item for item in items if item.valid]
        assert [d.pid for d in received.deliveries] == [item.name for item in good]
        assert [p.raw for p in received.poisoned] == [i.raw for i in items if not i.valid]
        for delivery, item in zip(received.deliveries, good, strict=True):
            assert (delivery.attempts, delivery.payload) == (item.attempts, item.payload)
            item.place, item.reservation, item.owner = PROCESSING, None, delivery.receipt
            self.claims += 1
        for item in items:
            if not item.valid:
                event("claim poisons a malformed payload")
                item.place, item.reservation = POISON, None
                self.poisoned += 1
        del self.registered[reservation.key]
        consumer.held += received.deliveries
        consumer.heartbeat, consumer.renewed = True, started
        note(f"{consumer.name} holds {[(d.pid, d.receipt) for d in received.deliveries]}")

    @rule()
    def advance(self) -> None:
        """The plain path, one step: the first consumer holding work settles its oldest
        delivery (commit, reject, commit, release, in turn); else the first with a reservation
        claims it; else one reserves up to 3 and claims them."""
        self._tick()
        acting = self._acting()
        holder = next((c for c in acting if c.held), None)
        if holder is not None:
            action = ADVANCE_ACTIONS[self.advances % len(ADVANCE_ACTIONS)]
            self.advances += 1
            note(f"{holder.name} settles {holder.held[0].pid}: {action.value}")
            self._settle(holder, [(holder.held[0], action)])
            return
        claimer = next((c for c in acting if c.pending), None)
        if claimer is not None:
            self._claim(claimer, claimer.pending[0])
            return
        self.reserve(self.serial, 3, True)

    # -- settling and renewing --------------------------------------------------------

    @precondition(lambda self: any(c.held for c in self._acting()))
    @rule(
        c=consumer_pick,
        picks=st.lists(
            st.tuples(st.integers(0, 7), st.sampled_from(list(Action))), min_size=1, max_size=3
        ),
    )
    def settle(self, c: int, picks: list[tuple[int, Action]]) -> None:
        self._tick()
        consumer = self._pick(c, [c for c in self._acting() if c.held])
        self._settle(consumer, [(consumer.held[i % len(consumer.held)], a) for i, a in picks])

    def _settle(self, consumer: Consumer, chosen: list[tuple[Delivery, Action]]) -> None:
        expected = self._expect_settle(chosen)
        results = self.run(consumer.broker.settle(_settlements(chosen)))
        released, retried = self._settled(consumer, chosen, results, expected)
        # Releases go back to the consumer end in their order, retries to the producer end.
        ready = [self._identify(raw)[0].name for raw in self.redis.lrange(KEYS.ready, 0, -1)]
        assert ready[::-1][:len(released)] == released, f"released {released}, ready {ready}"
        assert ready[:len(retried)] == retried[::-1], f"retried {retried}, ready {ready}"

    def _expect_settle(self, chosen: list[tuple[Delivery, Action]]) -> list[Outcome]:
        """Applied if still owned (the same delivery twice in one call: only the first)."""
        expected, applied = [], set()
        for delivery, _ in chosen:
            mine = self._owns(delivery) and delivery.pid not in applied
            expected.append(Outcome.OK if mine else Outcome.STALE)
            if mine:
                applied.add(delivery.pid)
        return expected

    def _settled(
        self, consumer: Consumer, chosen: list[tuple[Delivery, Action]], results: list[Result],
        expected: list[Outcome],
    ) -> tuple[list[str], list[str]]:
        """Check the outcomes and apply them; returns (released, retried) names."""
        outcomes = [result.outcome for result in results]
        assert outcomes == expected, (
            f"{consumer.name} settled {[(d.pid, a.value) for d, a in chosen]}: {outcomes}, "
            f"expected {expected}"
        )
        released, retried = [], []
        for (delivery, action), outcome in zip(chosen, outcomes, strict=True):
            if outcome is not Outcome.OK:
                event("settle of a delivery no longer owned is stale")
                continue
            event(f"settle {action.value}: ok")
            item = self.items[delivery.pid]
            item.owner = None
            if action is Action.COMMIT:
                item.place = DONE
                self.commits += 1
            elif action is Action.RELEASE:
                item.place = READY
                released.append(item.name)
            else:
                item.attempts = delivery.attempts + 1
                if item.attempts >= MAX_ATTEMPTS:
                    event("reject at max_attempts: failed")
                    item.place = FAILED
                    self.fails += 1
                else:
                    item.place = READY
                    retried.append(item.name)
        for delivery, _ in chosen:
            if delivery in consumer.held:
                consumer.held.remove(delivery)
        return released, retried

    @rule(c=consumer_pick)
    def extend(self, c: int) -> None:
        self._tick()
        self._extend(self._pick(c))

    # -- faults -----------------------------------------------------------------------

    @precondition(lambda self: any(c.heartbeat for c in self._acting()))
    @rule(c=consumer_pick)
    def expire_heartbeat(self, c: int) -> None:
        """The consumer stalls past its lease; it may act again later."""
        self._tick()
        consumer = self._pick(c, [c for c in self._acting() if c.heartbeat])
        self.redis.delete(KEYS.consumer(consumer.name))
        consumer.heartbeat = False

    @precondition(lambda self: any(not r.expired for r in self.registered.values()))
    @rule(r=st.integers(0, 7))
    def expire_reservation(self, r: int) -> None:
        self._tick()
        live = [k for k, v in self.registered.items() if not v.expired]  # oldest first
        if live:  # _tick may have expired them all
            self._expire(self.registered[live[r % len(live)]])

    @precondition(lambda self: len(self._acting()) > 1 or len(self.consumers) < MAX_CONSUMERS)
    @rule(c=consumer_pick)
    def die(self, c: int) -> None:
        """The consumer stops for good: what it holds or reserved is left to maintenance.
        A new consumer replaces it (while fewer than MAX_CONSUMERS were started)."""
        self._tick()
        consumer = self._pick(c)
        self.redis.delete(KEYS.consumer(consumer.name))
        consumer.dead, consumer.heartbeat = True, False
        if consumer.pending:
            event("a consumer dies between reserve and claim")
        consumer.held, consumer.pending = [], []
        if len(self.consumers) < MAX_CONSUMERS:
            note(f"{self._spawn().name} replaces {consumer.name}")

    @precondition(lambda self: any(i.place == PROCESSING and i.owner for i in self.items.values()))
    @rule(i=st.integers(0, 29))
    def make_legacy(self, i: int) -> None:
        """Delete an owner key: the entry looks like a legacy consumer's (never renewed)."""
        self._tick()
        owned = [n for n, it in self.items.items() if it.place == PROCESSING and it.owner]
        item = self.items[owned[i % len(owned)]]
        self.redis.delete(KEYS.owner(item.name))
        item.owner = None

    @rule()
    def script_flush(self) -> None:
        self._tick()
        self.redis.script_flush()

    # -- maintenance ------------------------------------------------------------------

    def _abandoned(self) -> tuple[list[Item], list[Item]]:
        """Processing entries maintenance must recover: (owner's heartbeat gone, legacy)."""
        dead, legacy = [], []
        for item in self._in(PROCESSING):
            if item.owner is None:
                if item.old:
                    legacy.append(item)
            elif not self._by_id(owner_consumer(item.owner)).heartbeat:
                dead.append(item)
        return dead, legacy

    @rule(c=consumer_pick, locked=st.booleans())
    def maintain(self, c: int, locked: bool) -> None:
        self._tick()
        consumer = self._pick(c)
        if locked:
            self.redis.set(KEYS.reap_lock, "another-supervisor:1", px=60_000)
            report = self.run(consumer.broker.maintain())
            assert report.skipped and report.total == 0, report
            self.redis.delete(KEYS.reap_lock)
            return
        self.redis.delete(KEYS.reap_lock)
        expired = [r for r in self.registered.values() if r.expired]
        dead, legacy = self._abandoned()
        report = self.run(consumer.broker.maintain())
        expected = (sum(len(r.names) for r in expired), len(dead), len(legacy))
        actual = (report.expired_reservations, report.dead_consumers, report.legacy)
        assert actual == expected and not report.skipped, (
            f"maintain by {consumer.name}: (reservations, dead, legacy) = {actual}, "
            f"expected {expected}"
        )
        for registered in expired:
            self._requeue_reservation(registered)
        for item in dead + legacy:
            item.place, item.owner = READY, None
        if dead:
            event("maintain recovers a dead consumer's deliveries")
        if legacy:
            event("maintain recovers a legacy entry")

    @precondition(lambda self: any(c.held for c in self._acting()))
    @rule(
        c=consumer_pick, o=consumer_pick, stalled=st.booleans(),
        meanwhile=st.sampled_from(["extend", "commit", "maintain"]),
    )
    def maintain_racing(self, c: int, o: int, stalled: bool, meanwhile: str) -> None:
        """Maintenance while something happens between its reads and its recovery script:
        a consumer holding work renews its heartbeat (``extend``) or commits its oldest
        delivery, or a second maintenance pass runs in full (the lock expired under the
        first). The scripts re-check: what was renewed, settled or recovered meanwhile is
        untouched, and the two passes together recover each message once.
        ``stalled``: the consumer's heartbeat expired just before, so its work looks
        abandoned."""
        self._tick()
        consumer = self._pick(c)
        holders = [c for c in self._acting() if c.held]
        other = self._pick(o, sorted(holders, key=lambda c: c.heartbeat))  # stalled first
        if stalled:
            self.redis.delete(KEYS.consumer(other.name))
            other.heartbeat = False
        self.redis.delete(KEYS.reap_lock)
        expired = [r for r in self.registered.values() if r.expired]
        dead, legacy = self._abandoned()
        chosen = [(other.held[0], Action.COMMIT)]
        expected: list[Any] = {
            "extend": lambda: [self._owns(delivery) for delivery in other.held],
            "commit": lambda: self._expect_settle(chosen),
            "maintain": lambda: [],
        }[meanwhile]()
        started = time.monotonic()
        done: list[Any] = []

        async def act() -> None:
            if meanwhile == "extend":
                done.append(await other.broker.extend(other.held))
            elif meanwhile == "commit":
                done.append(await other.broker.settle(_settlements(chosen)))
            else:
                await self._expire_lock(other)
                done.append(await other.broker.maintain())

        # A second pass races best on the first script the first pass runs.
        hook = "recover_reservations" if meanwhile == "maintain" and expired else (
            "recover_processing"
        )
        scripts = _Interleaved(consumer.broker.client, hook, act)
        report = self.run(recovery.maintain(
            consumer.broker.client, scripts, KEYS, consumer_id=consumer.name,
            lease_ms=int(LEASE * 1000), recovery_age=RECOVERY_AGE,
        ))
        if not done:  # nothing looked abandoned: the script never ran; act now
            self.run(act())
        elif meanwhile == "maintain" or any(
            owner_consumer(item.owner or "") == other.name for item in dead
        ):
            event(f"{meanwhile} between maintenance's reads and its recovery script")
        if meanwhile == "extend":
            self._extended(other, done[0], expected, started)
        elif meanwhile == "commit":
            self._settled(other, chosen, done[0], expected)
        still_dead, still_legacy = (set(map(id, items)) for items in self._abandoned())
        dead = [item for item in dead if id(item) in still_dead]
        legacy = [item for item in legacy if id(item) in still_legacy]
        expected_report = (sum(len(r.names) for r in expired), len(dead), len(legacy))
        reports = [report] + ([done[0]] if meanwhile == "maintain" else [])
        actual = tuple(
            sum(getattr(r, kind) for r in reports)
            for kind in ("expired_reservations", "dead_consumers", "legacy")
        )
        assert actual == expected_report and not any(r.skipped for r in reports), (
            f"maintain by {consumer.name} with {meanwhile} by {other.name} meanwhile: "
            f"(reservations, dead, legacy) = {actual}, expected {expected_report}, "
            f"reports {reports}"
        )
        for registered in expired:
            self._requeue_reservation(registered)
        for item in dead + legacy:
            item.place, item.owner = READY, None

    async def _expire_lock(self, consumer: Consumer) -> None:
        """The first pass's lock expires (deleted with the second pass's connection)."""
        await consumer.broker.client.delete(KEYS.reap_lock)

    def _requeue_reservation(self, registered: Registered) -> None:
        del self.registered[registered.key]
        for name in registered.names:
            item = self.items[name]
            item.place, item.reservation = READY, None

    def _bounded_maintain(self, consumer: Consumer, batch: int) -> int:
        """One sweep with a tiny batch: it may do part of the work; what it did must add up."""
        self.redis.delete(KEYS.reap_lock)
        expired = {r.key: r for r in self.registered.values() if r.expired}
        dead, legacy = self._abandoned()
        broker = consumer.broker
        report = self.run(recovery.maintain(
            broker.client, broker.scripts, KEYS, consumer_id=consumer.name,
            lease_ms=int(LEASE * 1000), recovery_age=RECOVERY_AGE, batch=batch,
        ))
        registry = {key.decode() for key in self.redis.zrange(KEYS.reservations, 0, -1)}
        processing = {pid.decode() for pid in self.redis.lrange(KEYS.processing, 0, -1)}
        moved = 0
        for key, registered in expired.items():
            if key not in registry:
                moved += len(registered.names)
                self._requeue_reservation(registered)
        recovered = {"dead": 0, "legacy": 0}
        for kind, items in (("dead", dead), ("legacy", legacy)):
            for item in items:
                if item.name not in processing:  # the invariant checks it is in ready now
                    recovered[kind] += 1
                    item.place, item.owner = READY, None
        actual = (report.expired_reservations, report.dead_consumers, report.legacy)
        assert actual == (moved, recovered["dead"], recovered["legacy"]), (
            f"maintain(batch={batch}) reported {actual}, the state shows "
            f"{(moved, recovered['dead'], recovered['legacy'])}"
        )
        return report.total

    @rule(c=consumer_pick, batch=st.integers(1, 3), until_done=st.booleans())
    def sweep(self, c: int, batch: int, until_done: bool) -> None:
        """Maintenance with a tiny batch: one pass may do part of the work. ``until_done``:
        passes one after another reach every abandoned entry (the cursor) in a bounded number
        of passes."""
        self._tick()
        consumer = self._pick(c)
        if not until_done:
            self._bounded_maintain(consumer, batch)
            return
        bound = 2 * math.ceil(len(self._in(PROCESSING)) / batch) + 3
        for passes in range(bound):
            dead, legacy = self._abandoned()
            if not dead and not legacy and not any(r.expired for r in self.registered.values()):
                if passes > 1:
                    event("a sweep took several passes")
                return
            self._bounded_maintain(consumer, batch)
        dead, legacy = self._abandoned()
        left = [item.name for item in dead + legacy]
        left += [r.key for r in self.registered.values() if r.expired]
        raise AssertionError(f"{bound} passes of batch {batch} left {left} unrecovered")

    # -- the invariant ----------------------------------------------------------------

    @invariant()
    def every_message_is_in_exactly_one_place(self) -> None:
        r = self.redis
        pipe = r.pipeline(transaction=False)
        pipe.lrange(KEYS.ready, 0, -1)
        pipe.lrange(KEYS.processing, 0, -1)
        pipe.lrange(KEYS.failed, 0, -1)
        pipe.lrange(KEYS.poison, 0, -1)
        pipe.zrange(KEYS.reservations, 0, -1, withscores=True)
        pipe.mget([KEYS.stat(name) for name in ("total", "processing", "success", "failed")])
        pipe.keys(f"{NS}.*")
        pipe.time()
        ready, processing, failed, poison, registry, stats, keys, now = pipe.execute()
        now_ms = now[0] * 1000 + now[1] // 1000
        keys = {key.decode() for key in keys}
        registry = {key.decode(): score for key, score in registry}
        reservation_lists = sorted(k for k in keys if k.startswith(KEYS.reservations + "."))
        processing = [pid.decode() for pid in processing]
        failed = [pid.decode() for pid in failed]

        pipe = r.pipeline(transaction=False)
        for key in reservation_lists:
            pipe.lrange(key, 0, -1)
        for pid in processing + failed:
            pipe.get(KEYS.job(pid))
            pipe.get(KEYS.owner(pid))
        replies = pipe.execute()
        contents = dict(zip(reservation_lists, replies, strict=False))
        records = replies[len(reservation_lists):]

        seen: dict[str, list[str]] = {}

        def found(item: Item, place: str, decoded: dict[str, Any] | None) -> None:
            seen.setdefault(item.name, []).append(place)
            if decoded is not None:
                got = (decoded["attempts"], decoded["payload"])
                assert got == (item.attempts, item.payload), (
                    f"{item.name} in {place}: (attempts, payload) {got}, "
                    f"expected {(item.attempts, item.payload)}"
                )

        for raw in ready:
            item, decoded = self._identify(raw)
            found(item, "ready", decoded)

        assert set(registry) == set(self.registered), (
            f"registered reservations {sorted(map(self._short, registry))}, expected "
            f"{sorted(map(self._short, self.registered))}"
        )
        for key in reservation_lists:
            assert key in registry, f"unregistered reservation list {key}: {contents[key]}"
        for key, registered in self.registered.items():
            names = []
            for raw in contents.get(key, []):
                item, decoded = self._identify(raw)
                found(item, f"reservation {self._short(key)}", decoded)
                names.append(item.name)
            assert names == registered.names, f"{key} holds {names}, expected {registered.names}"
            assert (registry[key] <= now_ms) == registered.expired, (
                f"{key} deadline {registry[key]} (now {now_ms}), expected expired: "
                f"{registered.expired}"
            )

        for index, pid in enumerate(processing + failed):
            place = PROCESSING if index < len(processing) else FAILED
            item = self.items.get(pid)
            assert item is not None and item.valid, f"{place} holds unknown pid {pid!r}"
            record, owner = records[2 * index], records[2 * index + 1]
            assert record is not None, f"{pid} in {place} without a job record"
            found(item, place, envelope.decode(record))
            expected_owner = item.owner if place == PROCESSING else None
            assert (owner.decode() if owner else None) == expected_owner, (
                f"{pid} in {place}: owner {owner!r}, expected {expected_owner!r}"
            )

        for raw in poison:
            assert raw in self.malformed, f"poison holds {raw[:80]!r}, not a malformed payload"
            found(self.items[self.malformed[raw]], "poison", None)

        for item in self.items.values():
            expected = {
                READY: ["ready"], PROCESSING: [PROCESSING], FAILED: [FAILED], POISON: ["poison"],
                DONE: [],
                RESERVED: [f"reservation {self._short(item.reservation or '')}"],
            }[item.place]
            places = seen.get(item.name, [])
            assert places == expected, f"{item.name} is in {places}, expected {expected}"

        # No key the model cannot explain (job records and owners of settled work are gone).
        explained = {
            KEYS.ready, KEYS.processing, KEYS.failed, KEYS.poison, KEYS.reservations,
            KEYS.reap_cursor, *(KEYS.stat(n) for n in ("total", "processing", "success", "failed")),
            *reservation_lists,
            *(KEYS.job(pid) for pid in processing + failed),
            *(KEYS.owner(i.name) for i in self._in(PROCESSING) if i.owner),
            *(KEYS.consumer(c.name) for c in self.consumers if c.heartbeat),
        }
        assert keys <= explained, f"unexplained keys: {sorted(keys - explained)}"
        for consumer in self.consumers:
            assert (KEYS.consumer(consumer.name) in keys) == consumer.heartbeat, (
                f"heartbeat of {consumer.name}: expected {consumer.heartbeat}"
            )

        total, in_process, success, failures = (int(v or 0) for v in stats)
        counted = {
            "total": total, "processing": in_process, "success": success, "failed": failures,
        }
        expected_stats = {
            "total": self.claims + self.poisoned, "processing": len(processing),
            "success": self.commits, "failed": self.fails + self.poisoned,
        }
        assert counted == expected_stats, f"counters {counted}, expected {expected_stats}"


def _settlements(chosen: list[tuple[Delivery, Action]]) -> list[Settlement]:
    return [
        Settlement(action, delivery, "handler failed" if action is Action.REJECT else None)
        for delivery, action in chosen
    ]


class _Interleaved(Scripts):
    """Scripts that run ``before()`` once, just before the first call of script ``name``:
    another consumer acts between maintenance's reads and its recovery script."""

    def __init__(self, client: Any, name: str, before: Callable[[], Awaitable[None]]) -> None:
        super().__init__(client)
        self.name = name
        self.before: Callable[[], Awaitable[None]] | None = before

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        if name == self.name and self.before is not None:
            before, self.before = self.before, None
            await before()
        return await super().call(name, keys, args)


def test_redis_broker_protocol(redis_url: str) -> None:
    """Every message stays in exactly one place through any interleaving of the rules."""
    machine = seed(SEED)(type("RedisBrokerProtocol", (BrokerProtocol,), {"url": redis_url}))
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
            suppress_health_check=list(HealthCheck), print_blob=True,
        ))
    except BaseException as error:
        error.add_note(f"reproduce with QS_PROPERTY_SEED={SEED}")
        raise

