"""The Redis broker: reserve, claim, settle and extend, one Lua script call per batch.

Python prepares arguments and interprets results; the scripts in ``lua/`` make every state
change atomically (the per-message state contract is in ``broker.redis.keys``). A message moves
ready -> reservation (``reserve``) -> processing with an owner token (``claim``) -> done,
ready again, failed or poison (``settle``). Every settlement and renewal is conditional on
the owner token, so a consumer whose work was recovered can no longer change anything.

Connection errors are never retried blindly: a lost claim reply is resolved by running the
(idempotent) claim again and checking ownership; a lost settle reply is reported as
``Outcome.UNCERTAIN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from broker import envelope
from broker.base import (
    APPLIED,
    MAX_BATCH,
    Action,
    BrokerError,
    BrokerRefused,
    Delivery,
    MaintenanceReport,
    Outcome,
    Poisoned,
    Received,
    Result,
    ResultCallback,
    Settlement,
    check_receive_limit,
)
from broker.errors import describe
from broker.failure import Failure, record_ttl
from broker.redis import recovery, seeds, settling
from broker.redis import version as server_version
from broker.redis.ahead import Command, ReserveAhead
from broker.redis.blocking import Abandoned, BlockingMove
from broker.redis.connection import (
    CLUSTER_ERRORS,
    CONNECTION_ERRORS,
    NO_CLIENT_INFO,
    broker_errors,
    connection_class,
)
from broker.redis.keys import QueueKeys, hash_tag
from broker.redis.placement import check_placement
from broker.redis.replication import NONE as NO_WAIT
from broker.redis.replication import NotReplicated, Replication
from broker.redis.reservation import Reservation
from broker.redis.scripts import Scripts
from broker.redis.wire import Oversized, Wire
from broker.retry import BACKOFF_MAX, RetryPolicy
from broker.tls import TlsSettings
from broker.urls import redact

log = logging.getLogger(__name__)

#: What a connect raises when the server refuses this client's credentials or permissions.
_REFUSALS = (
    redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError, redis.exceptions.NoPermissionError,
)

#: What a failed connect raises (the cluster client has its own exception family).
_UNREACHABLE = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)

#: Pause after a receive that found only copies of pids already being processed.
DUPLICATE_PAUSE = 0.25
#: Characters of a poison reason kept beside the poison list (claim.lua's reason store).
POISON_REASON_CHARS = 500
#: recover.lua's grace that keeps an empty reservation registered whatever its deadline.
KEEP_REGISTERED = 9_999_999_999
#: The longest tail envelope the progress line reads for its age without a size limit.
PEEK_LIMIT = 1 << 20
#: Socket timeout of the (non-blocking) command connection, in seconds.
COMMAND_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0

_COMMIT = Action.COMMIT
_RESULTS = {
    b"ok": APPLIED,
    b"stale": Result(Outcome.STALE),
    b"missing": Result(Outcome.MISSING),
}


@dataclass(slots=True)
class _ClaimPlan:
    """The arguments of one claim call, kept so a lost reply can be resolved later."""

    reservation: Reservation
    keys: list[str]
    args: list[Any]
    items: list[Delivery | Poisoned]  # one per payload, in the order taken


def default_consumer_id() -> str:
    """``<hostname>-<pid>-<6 random hex>``: names this supervisor's informational record."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def has_hash_tag(namespace: str) -> bool:
    """True if every key of the namespace hashes by a non-empty ``{...}`` tag in it."""
    return hash_tag(namespace) is not None


class RedisBroker:
    replay_uncertain = True  # every script checks the owner token: a repeat is harmless
    settle_concurrency = 1  # completions gather while a call runs: the next group is bigger

    """One queue on Redis (or Redis Cluster), as ``broker.base.Broker``."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        namespace: str = "utopia-queue",
        cluster: bool = False,
        consumer_id: str | None = None,
        lease: float = 30.0,
        max_attempts: int = 3,
        job_ttl: int = 0,
        recovery_age: int = 90000,
        maintenance_interval: float = 5.0,
        max_envelope_bytes: int | None = envelope.MAX_ENVELOPE_BYTES,
        tls: TlsSettings | None = None,
        replication: Replication = NO_WAIT,
        retry_backoff: float = 0.0,
        retry_backoff_max: float = BACKOFF_MAX,
    ) -> None:
        """``tls`` applies to a rediss:// URL (default: the system's CAs, hostname checked);
        ``replication``: the replicas that must confirm publishes, blocking registrations,
        claims and settlements (``[broker] wait_replicas``; none by default);
        ``retry_backoff``: a failed attempt's retry waits in ``supervisor-delayed`` (0: it is
        requeued at once, as queue 5 does)."""
        self.url = url
        self.tls = tls or TlsSettings()
        self.queue = queue
        self.namespace = namespace
        self.cluster = cluster
        self.consumer_id = consumer_id or default_consumer_id()
        self.lease = lease
        self.max_attempts = max_attempts
        self.retry = RetryPolicy(max_attempts, retry_backoff, retry_backoff_max)
        self.job_ttl = int(job_ttl)
        self._record_ttl = record_ttl(self.job_ttl)  # a failure record's expiry
        self.recovery_age = recovery_age
        self.maintenance_interval = max(1, math.ceil(maintenance_interval))
        self.max_envelope_bytes = max_envelope_bytes
        self.keys = QueueKeys(namespace, queue)
        self.replication = replication
        #: Writes a replica had not confirmed when WAIT timed out (see _replicated).
        self.unreplicated = 0
        self.client = self._new_client(COMMAND_TIMEOUT)
        # Blocking reads get a connection of their own, which a stop can end at once.
        self._blocking = BlockingMove(
            url, self.tls, self.keys.ready, self.client,
            self._new_client(None) if cluster else None,
            connect_timeout=CONNECT_TIMEOUT, bulk_limit=max_envelope_bytes or None,
        )
        # The scripts of the hot path go over a lean connection of their own (see wire);
        # a cluster keeps redis-py's client, which follows the slot map.
        self._wire = None if cluster else Wire(url, self.tls, COMMAND_TIMEOUT, CONNECT_TIMEOUT)
        self.scripts = Scripts(self.client, self._wire)
        self._lease = max(1, math.ceil(lease))  # claim keys expire in whole seconds
        self._unresolved: list[_ClaimPlan] = []
        self._ahead = ReserveAhead(self._wire, self.scripts, self.keys)  # see reserve_ahead
        self._job_prefix = self.keys.job("")
        self._job_prefix_bytes = len(self._job_prefix.encode())
        self._owner_prefix = self.keys.owner("")
        self._claim_prefix = self.keys.claim("")
        self._record = self.keys.supervisor(self.consumer_id)
        self._record_value = f"{socket.gethostname()} {os.getpid()}"
        self._running = self.keys.running(self.consumer_id)
        #: settle.lua's keys before the items' own (the same for every call).
        self._settle_keys = (
            self.keys.ready, self.keys.processing, self.keys.failed,
            self.keys.stat("processing"), self.keys.stat("success"), self.keys.stat("failed"),
            self.keys.delayed,
        )
        #: Every owner token of this supervisor starts with it; ``extend`` registers it in
        #: ``supervisor-tokens`` with the record (the supervisor's first renewal runs at
        #: start), so recovery can tell our deliveries, and whether we are alive, from a
        #: queue-5 worker's. Until then, queue 5's rule covers them: slower, never unsafe.
        self.token_prefix = secrets.token_hex(recovery.PREFIX_HEX // 2)

    def _new_client(self, socket_timeout: float | None) -> Any:
        options: dict[str, Any] = {
            "decode_responses": False,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": CONNECT_TIMEOUT,
            **NO_CLIENT_INFO,
        }
        if urlsplit(self.url).scheme == "rediss":
            options.update(self.tls.redis_options())
        if self.cluster:
            # The cluster client keeps its retries: they follow failovers. A retried claim
            # is resolved by the ownership check; a retried settle can only turn OK into STALE.
            return seeds.cluster_client(self.url, **options)
        # No automatic retries: a command whose reply was lost must not run a second time.
        return aioredis.Redis.from_url(
            self.url, retry=Retry(NoBackoff(), 0), connection_class=connection_class(self.url),
            **options,
        )

    @property
    def reconnects(self) -> int | None:
        """How many times the scripts' connection was made again (None on a Cluster, whose
        client reconnects inside redis-py)."""
        return None if self._wire is None else max(0, self._wire.connects - 1)

    # -- connection ---------------------------------------------------------------------

    async def connect(self) -> None:
        if self.cluster:
            # Refused before anything moves: no script of a queue whose keys spread over
            # slots could run, and renaming the namespace here would orphan its jobs.
            check_placement(self.keys)
        try:
            await self.client.ping()
            await server_version.check(self.client, f"Redis at {redact(self.url)}")
        except _REFUSALS as error:
            raise BrokerRefused(self._refusal(error)) from error
        except _UNREACHABLE as error:
            # SELECT of a database the server lacks: "DB index is out of range".
            if isinstance(error, redis.exceptions.ResponseError) and "DB index" in str(error):
                database = seeds.settings(self.url).get("db", 0)
                raise BrokerRefused(
                    f"Redis at {redact(self.url)} has no database {database} ({error}): a "
                    "server has `databases` of them, 16 by default, numbered from 0"
                ) from error
            hint = self.tls.hint(error) if urlsplit(self.url).scheme == "rediss" else ""
            raise BrokerError(
                f"cannot reach Redis at {redact(self.url)}: {error}{hint}"
            ) from error

    def _refusal(self, error: Exception) -> str:
        where = f"Redis at {redact(self.url)}"
        if isinstance(error, redis.exceptions.NoPermissionError):
            return f"{where} refused a command to this URL's user ({error}): grant it in its ACL"
        if not seeds.settings(self.url).get("password"):
            return f"{where} requires a password, and the URL gives none ({error})"
        return f"{where} refused the URL's user name or password ({error})"

    async def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        await self._blocking.close()
        await self.client.aclose()

    # -- receiving ----------------------------------------------------------------------

    async def receive(self, max_messages: int, block_timeout: float) -> Received:
        check_receive_limit(max_messages)
        if self._unresolved and len(self._unresolved[0].items) <= max_messages:
            received = await self._resolve_lost_claim()
            if received.deliveries or received.poisoned:
                return received
        reservation = await self._ahead.take(max_messages)  # see reserve_ahead
        if reservation is None:
            reservation = await self.reserve(max_messages, block_timeout)
        poisoned = [Poisoned(b"", f"envelope of {length} bytes exceeds "
                             f"{self.max_envelope_bytes}: moved to poison unread")
                    for length in reservation.oversized]
        if not reservation.payloads:
            return Received(poisoned=poisoned)
        received = await self.claim(reservation)
        received.poisoned += poisoned
        if received.deferred and not (received.deliveries or received.poisoned):
            # Only copies of pids being processed already: they wait behind the rest of the
            # queue. Pausing keeps an otherwise idle queue holding one from spinning.
            await asyncio.sleep(min(block_timeout, DUPLICATE_PAUSE))
        return received

    async def reserve(self, n: int, block_timeout: float) -> Reservation:
        """Move up to ``n`` (1..1000) ready payloads into a fresh registered reservation.

        Returns at once with whatever is available; only when nothing is, waits up to
        ``block_timeout`` seconds for one payload.
        """
        n = min(max(int(n), 1), MAX_BATCH)
        token = self.token_prefix + secrets.token_hex(16 - recovery.PREFIX_HEX // 2)
        key = self.keys.reservation(token)
        keys = self._reserve_keys(key)
        wait = math.ceil(block_timeout) if block_timeout > 0 and not self._blocking.stopped else 0
        reply: list[Any]
        async with broker_errors("reserve"):
            registered_at = time.monotonic()
            block = bool(wait)
            if wait and self.replication.enabled:
                reply, block = await self._reserve_replicated(keys, n, wait)
                registered_at = time.monotonic()
            else:
                reply = await self.scripts.call("reserve", keys, self._reserve_args(n, wait))
            if not reply and block:
                reply = await self._reserve_blocking(key, token, block_timeout, registered_at)
        # reserve.lua answers an oversized payload with its length (an integer) instead
        oversized = [int(item) for item in reply if item.__class__ is not bytes]
        payloads = [item for item in reply if item.__class__ is bytes] if oversized else reply
        return Reservation(key, token, cast(list[bytes], payloads), oversized)

    def _reserve_keys(self, key: str) -> list[str]:
        """reserve.lua's keys (the poison list and reason store: used with a size limit)."""
        return [self.keys.ready, self.keys.reservations, key, self.keys.poison,
                self.keys.poison_reasons, self.keys.poison_times]

    def _reserve_args(self, n: int, wait: int) -> list[int]:
        return [n, self._lease, wait, self.max_envelope_bytes or 0]

    async def _reserve_replicated(
        self, keys: list[str], n: int, wait: int
    ) -> tuple[list[bytes], bool]:
        """Reserve; on an idle queue, register the empty reservation and wait for replicas
        to have it before blocking: a move into a reservation whose registration a failover
        took back would leave a list no registry names. Returns the payloads and whether a
        blocking move may follow (False: the registration was not confirmed)."""
        payloads = await self.scripts.call("reserve", keys, self._reserve_args(n, 0))
        if payloads:
            return payloads, False
        payloads, confirmed = await self.scripts.call_replicated(
            "reserve", keys, self._reserve_args(n, wait), self.replication
        )
        if payloads or self._replicated("reservation", confirmed, 1):
            return payloads, not payloads
        await self.client.zrem(self.keys.reservations, keys[2])  # never block on it
        return [], False

    def _replicated(self, what: str, confirmed: int, count: int) -> bool:
        """False (logged, counted) when fewer replicas than wanted confirmed a write."""
        if confirmed >= self.replication.replicas:
            return True
        self.unreplicated += count
        log.warning("%s", NotReplicated(f"{what} of {count} on {self.queue}", confirmed,
                                        self.replication.replicas))
        return False

    async def _reserve_blocking(
        self, key: str, token: str, timeout: float, registered_at: float
    ) -> list[bytes | int]:
        # reserve.lua registered the empty reservation until lease + timeout from now, so a
        # payload moved into it is discoverable even if we die before we see the reply.
        if time.monotonic() - registered_at > self._lease / 2:
            # Frozen (SIGSTOP, a VM pause) since the registration: it may be recovered and
            # gone already, and a move into an unregistered list would strand the payload.
            await self.client.zrem(self.keys.reservations, key)
            return []
        try:
            payload = await self._blocking.move(key, timeout)
        except Abandoned:
            return await self._give_back(key)
        if payload is None:
            # Only a definite timeout proves the reservation is empty; if this ZREM is lost,
            # maintenance drops the empty registration after its deadline and grace.
            await self.client.zrem(self.keys.reservations, key)
            return []
        if isinstance(payload, Oversized):
            return await self._poison_moved(key, token, payload.length)
        return [payload]

    async def _poison_moved(self, key: str, token: str, length: int) -> list[bytes | int]:
        """The blocking move took a payload over the size limit (its bytes were dropped
        unread): claim.lua moves it from the reservation to poison, inside Redis."""
        keys = [
            self.keys.reservations, key, self.keys.ready, self.keys.processing,
            self.keys.poison, self.keys.stat("total"), self.keys.stat("processing"),
            self.keys.poison_reasons, self.keys.poison_times,
        ]
        reason = (f"envelope of {length} bytes exceeds {self.max_envelope_bytes}: moved to "
                  "poison unread")
        reply = await self.scripts.call(
            "claim", keys, [self._lease, token, 1, "p", self._job_prefix_bytes, reason])
        # Otherwise expired (back in the ready list: reserve.lua poisons it) or left to
        # maintenance ('mismatch'): nothing to report now.
        return [length] if reply == [b"poison"] else []

    def stop_waiting(self) -> None:
        """A stop began: a receive blocked on an idle queue returns now, and no later
        receive blocks (what is there is still taken)."""
        self._blocking.stop()

    async def _give_back(self, key: str) -> list[bytes | int]:
        """The blocking move was abandoned: a payload it may have moved goes back to the
        ready list, and the reservation is marked expired (deadline 0) rather than
        deregistered, so a move the server still completes late is recovered by the next
        maintenance instead of stranded in a list nobody knows."""
        async with broker_errors("give back an abandoned reservation"):
            await self.client.zadd(self.keys.reservations, {key: 0}, xx=True)
            # Moved inside Redis (a payload is never read here: it may be oversized). The
            # grace keeps the empty list registered whatever its deadline; one emptied here
            # is done (a blocking move moves one payload) and goes.
            await self.scripts.call(
                "recover", [self.keys.reservations, self.keys.ready, key],
                [MAX_BATCH, KEEP_REGISTERED])
        return []

    async def claim(self, reservation: Reservation) -> Received:
        """Make the reserved payloads this consumer's deliveries (poison what is malformed)."""
        plan = self._plan_claim(reservation)
        try:
            if self.replication.enabled:
                # A claim a failover takes back runs its deliveries twice: start none
                # before a replica has it (its reservation too: replication is in order).
                reply, confirmed = await self.scripts.call_replicated(
                    "claim", plan.keys, plan.args, self.replication
                )
                self._replicated("claim", confirmed, len(plan.items))
            else:
                reply = await self.scripts.call("claim", plan.keys, plan.args)
        except (*CONNECTION_ERRORS, *CLUSTER_ERRORS) as error:
            # Applied or not, we cannot tell (a cluster error may follow the client's retry
            # of a call whose reply was lost): the next receive runs the claim again.
            self._unresolved.append(plan)
            raise BrokerError(f"claim of {reservation.key} lost its reply: {error}") from error
        return await self._claimed(plan, reply)

    def _plan_claim(self, reservation: Reservation) -> _ClaimPlan:
        keys = [
            self.keys.reservations, reservation.key, self.keys.ready, self.keys.processing,
            self.keys.poison, self.keys.stat("total"), self.keys.stat("processing"),
            self.keys.poison_reasons, self.keys.poison_times,
        ]
        token = reservation.token
        items: list[Delivery | Poisoned] = []
        poisoned = False
        payloads = reservation.payloads
        # _delivery_keys, spelt out: this loop runs once per delivery claimed.
        claim_prefix, job_prefix, owner_prefix = (
            self._claim_prefix, self._job_prefix, self._owner_prefix)
        for raw, result in zip(
                payloads, envelope.decode_many(payloads, self.max_envelope_bytes), strict=True):
            if isinstance(result, envelope.MalformedEnvelope):
                poisoned = True
                items.append(Poisoned(raw, str(result)))
                continue
            decoded, plain = result
            pid = decoded["pid"]
            claim, job, owner = claim_prefix + pid, job_prefix + pid, owner_prefix + pid
            keys += (job, claim, owner)  # claim.lua's order
            items.append(Delivery(
                pid, decoded["queue"], decoded["timestamp"], decoded["attempts"],
                decoded["payload"], raw, token, decoded, (claim, job, owner), plain,
            ))
        # One kind per payload: g(ood) or p(oison); all good but for a rare malformed one.
        kinds = ("".join(["p" if item.__class__ is Poisoned else "g" for item in items])
                 if poisoned else "g" * len(items))
        # The script reads each pid from its jobs key, after the prefix (counted in bytes).
        args: list[Any] = [self._lease, token, len(items), kinds, self._job_prefix_bytes]
        if poisoned:  # why each is poison, kept beside the poison list (claim.lua)
            args += [item.reason[:POISON_REASON_CHARS] for item in items
                     if item.__class__ is Poisoned]
        return _ClaimPlan(reservation, keys, args, items)

    async def _claimed(self, plan: _ClaimPlan, reply: Any) -> Received:
        if reply == b"mismatch":
            log.error(
                "reservation %s no longer holds the %d payloads reserved; left for maintenance",
                plan.reservation.key, len(plan.items),
            )
            return Received()
        if reply[0] == b"expired":
            return await self._owned_after_expiry(plan, int(reply[1]))
        if len(reply) == len(plan.items) == reply.count(b"ok"):  # usual: every one delivered
            return Received(cast(list[Delivery], list(plan.items)))
        received = Received()
        for item, outcome in zip(plan.items, reply, strict=True):
            if outcome == b"deferred":
                received.deferred += 1  # its pid is being processed already
            elif isinstance(item, Delivery):
                received.deliveries.append(item)
            else:
                received.poisoned.append(item)
        return received

    async def _owned_after_expiry(self, plan: _ClaimPlan, returned: int) -> Received:
        """'expired' also answers a claim that already ran (its reply was lost): keep ours."""
        candidates = [item for item in plan.items if isinstance(item, Delivery)]
        owned = await self.extend(candidates) if candidates else []
        deliveries = [delivery for delivery, mine in zip(candidates, owned, strict=True) if mine]
        if deliveries:
            poisoned = [item for item in plan.items if isinstance(item, Poisoned)]
            return Received(deliveries, poisoned)
        log.warning(
            "reservation %s expired before it was claimed; %d payloads went back to the ready "
            "list", plan.reservation.key, returned,
        )
        return Received()

    async def _resolve_lost_claim(self) -> Received:
        # The plan is dropped only once resolved: if this fails too (say the ownership check
        # loses its connection), the next receive tries again, so claimed deliveries are
        # never left owned and renewed by nobody.
        plan = self._unresolved[0]
        async with broker_errors("claim (resolving a lost reply)"):
            reply = await self.scripts.call("claim", plan.keys, plan.args)
            received = await self._claimed(plan, reply)
        self._unresolved.pop(0)
        return received

    # -- reserving ahead, in a settle call's write --------------------------------------

    @property
    def reserves_ahead(self) -> bool:
        """Its settle calls can reserve ahead (``reserve_ahead``): a plain Redis without
        replica confirmation. The supervisor then receives in smaller batches (see
        ``supervisor.arbiter.batch_limit``)."""
        return self._wire is not None and not self.replication.enabled

    def reserve_ahead(self, room: int) -> bool:
        """The next settle call, once applied, makes ``room`` for a receive: reserve that in
        the call's own write, so that the receive after it claims at once instead of waiting
        a round trip for its reserve. The receive takes the reservation only if it asks for
        as many (every settlement applied); else it goes back to the ready list first.
        A plain Redis without replica confirmation only (one connection, in order), and one
        reservation ahead at a time. False: not done (the next settle call reserves nothing)."""
        if room <= 0 or not self._ahead_allowed():
            return False
        self._ahead.wanted = min(room, MAX_BATCH)
        return True

    def _ahead_allowed(self) -> bool:
        return self.reserves_ahead and not (
            self._blocking.stopped or self._unresolved) and self._ahead.idle()

    def _ahead_command(self, wanted: int) -> Command | None:
        """The reserve to send with this settle call, or None."""
        if not wanted or not self._ahead_allowed():
            return None
        token = self.token_prefix + secrets.token_hex(16 - recovery.PREFIX_HEX // 2)
        key = self.keys.reservation(token)
        return "reserve", self._reserve_keys(key), self._reserve_args(wanted, 0)

    # -- settling -----------------------------------------------------------------------

    async def settle(
        self, settlements: Sequence[Settlement], on_result: ResultCallback | None = None
    ) -> list[Result]:
        # One script answers for a whole group at once: results arrive together, so the
        # caller applies the returned list (``on_result`` has nothing to report earlier).
        results: list[Result] = []
        ahead, self._ahead.wanted = self._ahead.wanted, 0  # this call's, or none
        for start in range(0, len(settlements), MAX_BATCH):
            results += await self._settle_batch(settlements[start:start + MAX_BATCH], ahead)
            ahead = 0
        return results

    async def _settle_batch(self, batch: Sequence[Settlement], ahead: int = 0) -> list[Result]:
        keys = list(self._settle_keys)
        tokens = [settlement.delivery.receipt for settlement in batch]
        usual = True  # every one an unkeyed commit: no op, extra or result to build per item
        for settlement in batch:
            delivery = settlement.delivery
            keys += delivery.keys or self._delivery_keys(delivery.pid)  # claims, jobs, owners
            if (settlement.action is not _COMMIT or "key" in delivery.envelope
                    or delivery.attempts):  # a retried job's commit forgets its history
                usual = False
        applied: list[Result] | None = None  # what an applied settlement did, per item
        extras: list[Any] = []
        if usual:
            ops = "c" * len(batch)
        else:
            ops, extras, applied = settling.batch_ops(
                batch, keys, self.keys, self.retry, self.consumer_id)
        # The script reads each pid from its jobs key, after the prefix (counted in bytes).
        args: list[Any] = [self.job_ttl, len(batch), ops, self._job_prefix_bytes,
                           self._record_ttl, *tokens, *extras]
        try:
            if self.replication.enabled:
                # A commit a failover takes back is run again: confirm only what a replica has.
                reply, confirmed = await self.scripts.call_replicated(
                    "settle", keys, args, self.replication
                )
                self._replicated("settlement", confirmed, len(batch))
            elif (command := self._ahead_command(ahead)) is not None:
                reply = await self._ahead.settle_and_reserve(keys, args, command)
            else:
                reply = await self.scripts.call("settle", keys, args)
                if self._wire is not None:
                    self._ahead.settled_on = self._wire.connects  # settle.lua is loaded there
        except (*CONNECTION_ERRORS, *CLUSTER_ERRORS) as error:
            # A cluster error too: it may follow the client's retry of a call whose reply
            # was lost. Settled again either way (every script checks the owner token).
            # A reserve sent ahead is lost with it: given back by the next receive.
            uncertain = Result(Outcome.UNCERTAIN, f"settle reply lost: {describe(error)}")
            return [uncertain] * len(batch)
        if applied is None:
            if reply.count(b"ok") == len(batch):  # the usual reply: one shared result
                return [APPLIED] * len(batch)
            return [APPLIED if outcome == b"ok" else _RESULTS[outcome] for outcome in reply]
        return [done if outcome == b"ok" else _RESULTS[outcome]
                for outcome, done in zip(reply, applied, strict=True)]

    def _delivery_keys(self, pid: str) -> tuple[str, str, str]:
        """A delivery's claims, jobs and owners key (built at the claim: see ``Delivery``)."""
        return self._claim_prefix + pid, self._job_prefix + pid, self._owner_prefix + pid

    async def commit(self, deliveries: Sequence[Delivery]) -> list[Result]:
        return await self.settle([Settlement(Action.COMMIT, d) for d in deliveries])

    async def reject(
        self, deliveries: Sequence[Delivery], errors: Sequence[str | None] | None = None
    ) -> list[Result]:
        errors = errors if errors is not None else [None] * len(deliveries)
        return await self.settle(
            [Settlement(Action.REJECT, d, e) for d, e in zip(deliveries, errors, strict=True)]
        )

    async def release(self, deliveries: Sequence[Delivery]) -> list[Result]:
        return await self.settle([Settlement(Action.RELEASE, d) for d in deliveries])

    # -- renewal, maintenance, publishing -----------------------------------------------

    async def extend(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Renew each delivery's claim; per delivery, True while this consumer owns it."""
        return await self._renew(deliveries, self._lease)

    async def abandon(self, deliveries: Sequence[Delivery] = ()) -> None:
        """At exit: requeue the deliveries still owned (their handlers were killed) as
        recovery would (same pid, new timestamp, ``attempts + 1``, or dead at
        ``max_attempts``), so that nothing this supervisor owns outlives it: a queue-5
        worker would leave such a delivery alone for its ``reapAfter``. The claims and the
        record go first; the registry entry stays, ended (no longer counted alive by
        ``check``), so whatever is still ours (a requeue that failed, a claim whose reply
        was lost) is ours and gone: the next sweep of ours, or ``recover``, takes it at
        once."""
        await self._renew(deliveries, 0)
        # What its handlers ran goes with the record (else it expires as the record would:
        # an ACL user made before the copy existed may not delete it).
        with contextlib.suppress(redis.exceptions.RedisError, OSError):
            await self.client.delete(self._running)
        await self._ahead.give_back_at_exit()
        if not deliveries:
            return
        async with broker_errors("requeue at exit"):
            now, _ = await recovery.server_time(self.client, self.keys.ready)
            candidates = [self._own_candidate(delivery, now) for delivery in deliveries]
            applied = await recovery.reclaim(self.scripts, self.keys, candidates,
                                             job_ttl=self.job_ttl)
        log.info("requeued %d of the %d deliveries still owned at exit (the others were "
                 "settled or recovered meanwhile)", sum(applied), len(deliveries))

    def _own_candidate(self, delivery: Delivery, now: int) -> recovery.Candidate:
        """Recovery's verdict on one of our deliveries (requeue or dead), owner checked."""
        decoded = delivery.envelope or envelope.decode(delivery.raw)
        lost = Failure(
            error="WorkerLost", outcome="dead", at=float(now), consumer=self.consumer_id,
            message=f"supervisor {self.consumer_id} exited while the job ran (its handler "
            "was stopped)",
        )
        return recovery.verdict(delivery.pid, decoded, delivery.receipt, keys=self.keys,
                                now=now, max_attempts=self.max_attempts, lost=lost)

    async def _renew(self, deliveries: Sequence[Delivery], lease: int) -> list[bool]:
        owned: list[bool] = []
        async with broker_errors("extend" if lease else "abandon"):
            for start in range(0, max(len(deliveries), 1), MAX_BATCH):
                batch = deliveries[start:start + MAX_BATCH]
                keys = [self._record, self.keys.supervisor_tokens]
                for delivery in batch:
                    claim, _, owner = delivery.keys or self._delivery_keys(delivery.pid)
                    keys += (claim, owner)
                args: list[Any] = [lease, self._record_value, self.token_prefix,
                                   self.consumer_id]
                args += [delivery.receipt for delivery in batch]
                reply = await self.scripts.call("extend", keys, args)
                owned += [flag == 1 for flag in reply]
        return owned

    async def publish_running(self, record: bytes | None, ttl: int) -> None:
        """This supervisor's running jobs (``supervisor.running``), for ``status`` and the
        dashboard: kept ``ttl`` s, as the supervisor's record is; None deletes them."""
        async with broker_errors("running jobs"):
            if record is None:
                await self.client.delete(self._running)
            else:
                await self.client.set(self._running, record, ex=ttl)

    async def oldest_ready_age(self) -> float | None:
        """Seconds since the next message to be received was published (None: none)."""
        async with broker_errors("oldest ready"):
            raw = await self.scripts.call(
                "oldest", [self.keys.ready], [self.max_envelope_bytes or PEEK_LIMIT])
        if not isinstance(raw, bytes):
            return None  # empty, or over the size limit (its length): not read
        try:
            published: int = envelope.decode(raw, None)["timestamp"]
            return max(0.0, time.time() - published)
        except (envelope.MalformedEnvelope, TypeError):
            return None

    async def maintain(self, *, force: bool = False) -> MaintenanceReport:
        """Promote the retries due (every supervisor, every call: it costs one script call,
        and a retry must not wait for whoever holds the lock), then one bounded recovery
        sweep when the fleet's reap lock allows (``force``: now)."""
        async with broker_errors("maintain"):
            promoted = await recovery.promote(self.scripts, self.keys)
            report = await recovery.maintain(
                self.client, self.scripts, self.keys, lock_seconds=self.maintenance_interval,
                recovery_age=self.recovery_age, max_attempts=self.max_attempts,
                job_ttl=self.job_ttl, force=force,
                max_record_bytes=self.max_envelope_bytes or recovery.RECORD_LIMIT,
            )
        if promoted:
            log.debug("moved %d delayed retries whose backoff was over to the ready list",
                      promoted)
        report.promoted = promoted
        return report

    async def publish(self, queue: str, payload: dict[str, Any]) -> str:
        from broker.redis import publish

        return await publish.publish(
            self.client, self.namespace, queue, payload, self.replication
        )

    async def publish_many(self, queue: str, payloads: Sequence[dict[str, Any]]) -> list[str]:
        from broker.redis import publish

        return await publish.publish_many(
            self.client, self.namespace, queue, payloads, self.replication
        )
