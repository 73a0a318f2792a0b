"""The NATS JetStream broker: the same interface as the Redis one, queue 5's JetStream protocol.

JetStream itself keeps the pending deliveries and recovers abandoned work (redelivery after
the ack wait), so this adapter is thin. It shares a queue with PHP queue-5 workers
(``broker.nats.setup`` adopts their stream and consumer) and counts attempts as they do:

- attempts = JetStream's ``num_delivered`` - 1. The budget is read from the consumer
  (MaxDeliver, minus the spare delivery queue 5 marks in its metadata).
- receive: a pull that waits for the first message, then no-wait top-ups for the rest of
  the room (``broker.nats.pull``). A delivery at the spare (every earlier run of it died
  unsettled) and an undecodable one go to the dead stream, then TERM, never to a handler.
- commit: an ack sent as a request, so the server's reply confirms it. The acks of a
  settle call leave in one write (``broker.nats.acks``), followed by a no-wait pull for the
  room they make (``Puller.ahead``: the next receive finds those messages there); each
  result is reported when its own reply arrives. A reply lost to a timeout or a broken
  connection is UNCERTAIN and is never replayed.
- reject: below the budget a NAK with the backoff (the consumer's list, else
  ``retry_backoff`` doubling per delivery, capped by ``retry_backoff_max``); at the budget
  the payload is published to the dead subject (PubAck awaited), then TERM.
- release (a graceful stop hands back what never started; ``broker.nats.release``):
  republished under the id ``<pid>.released.<stream seq>``, then acknowledged, so it
  keeps its whole budget, as queue 5's newest line does. On a work stream with size
  limits (where a republish could push out another message) a NAK delayed by
  ``RELEASE_DELAY`` instead. Nothing at all (STALE) for a delivery no longer ours: its
  renewals failed for longer than the server's wait (it delivers the message again), or
  the stream no longer stores the message (another consumer's ACK took it after a
  redelivery): a copy would be a duplicate.
- extend: ``+WPI`` for every delivery held, and for what arrived but was not handed out
  yet, all in one write (as a settle call's acks). ``False`` only for what we know is
  gone: a delivery superseded by a newer delivery of the same message that reached us, or
  one whose consumer no longer exists.
- maintain: the server's max-deliveries advisories (subscribed in queue 5's queue group, so
  one worker of the fleet acts on each) name messages that ran out of deliveries while
  nobody held them: each is copied to the dead stream, then deleted from the work stream.
- abandon: nothing to do; an unacknowledged delivery comes back after the ack wait.

The connection is replaced, never repaired (``broker.nats.link``): operations in flight
when it breaks end UNCERTAIN (or ERROR when they were never sent); every other delivery
stays valid, since its acks go to its own reply subject from whichever connection is live.
Each new connection adopts the queue's settings again (``broker.nats.adoption``); single
requests, and their tries through a cluster's leader election, are ``broker.nats.requester``'s.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.msg import Msg

from broker import envelope
from broker.base import (
    APPLIED,
    MAX_BATCH,
    Action,
    BrokerError,
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
from broker.failure import Failure
from broker.nats import acks, api, presence
from broker.nats.acks import ACK, TERM, WPI, nak_after
from broker.nats.adoption import Adoption
from broker.nats.conn import Connection
from broker.nats.dead import CONTENT_TYPE, Burial
from broker.nats.held import Holdings
from broker.nats.link import Link, Unavailable
from broker.nats.pull import Puller
from broker.nats.receipt import NatsReceipt, delivery_of, receipt_of
from broker.nats.release import Releaser
from broker.nats.requester import Requester
from broker.nats.setup import Adopted, QueueNames, Wanted, identity
from broker.nats.tls import tls_options
from broker.retry import BACKOFF_MAX, RetryPolicy
from broker.tls import TlsSettings

log = logging.getLogger("broker.nats")

_SUPERSEDED = Result(Outcome.STALE, "superseded by a newer delivery")
JSON = "application/json"
#: Queue 5's queue group for the max-deliveries advisory: one subscriber of the fleet each.
ADVISORY_GROUP = "utopia_queue_dead_letter"
#: Seconds a maintenance pass trusts the consumer's budget as last read (queue 5 re-adopts
#: at most every 30 s); a dead-letter verdict reads it again whatever its age.
POLICY_MAX_AGE = 30.0
#: Filler of a settle's result list until each settlement's own result is in.
_UNSETTLED = Result(Outcome.ERROR, "not settled")


class NatsBroker:
    """One queue on NATS JetStream (see the module docstring for the protocol)."""

    replay_uncertain = False  # JetStream decides: acked, or redelivered after AckWait
    settle_concurrency = 16  # acks are independent: a lost reply holds back nothing after it

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        ack_wait: float = 30.0,
        max_attempts: int = 3,
        retry_backoff: float = 0.0,
        retry_backoff_max: float = BACKOFF_MAX,
        namespace: str = "utopia-queue",
        max_envelope_bytes: int | None = envelope.MAX_ENVELOPE_BYTES,
        job_ttl: float = 0.0,
        replicas: int = 1,
        request_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        ping_interval: float = 10.0,
        options: dict[str, Any] | None = None,
        tls: TlsSettings | None = None,
        announce: bool = False,
    ) -> None:
        """``ack_wait`` and ``max_attempts`` are the settings of a consumer this broker
        creates (MaxDeliver = max_attempts + 1, queue 5's spare delivery); an existing one
        is adopted as it is, and its budget wins. ``namespace`` makes the queue identity
        kept in the stream metadata. ``job_ttl`` (s, 0 = forever) is the max age of dead
        letters in a dead stream we create; ``replicas`` the num_replicas of the streams we
        create (an existing stream keeps its own). ``url`` may list several servers of one
        JetStream cluster, comma-separated: each new connection goes to one that answers.
        ``options`` go to ``nats.connect``. ``tls``: with a tls:// URL or any setting,
        every connection is TLS with these settings
        (a server that does not start TLS is refused, see ``broker.nats.tls``).
        ``announce``: answer ``check`` and ``drain`` (``broker.nats.presence``): the
        supervisor's broker does, an operator command's does not."""
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if ack_wait <= 0:
            raise ValueError("ack_wait must be positive")
        self.queue = queue
        self._names = QueueNames.of(queue)
        self._wanted = Wanted(ack_wait=float(ack_wait), max_attempts=max_attempts,
                              identity=identity(namespace, queue), job_ttl=job_ttl,
                              replicas=replicas)
        self._retry_backoff = retry_backoff
        self._retry_backoff_max = retry_backoff_max
        self._max_bytes = max_envelope_bytes
        self._timeout = request_timeout
        self._connect_timeout = connect_timeout
        self._puller = Puller(self._names.next_subject, request_timeout, self._suspect)
        connect_options = {
            "name": f"queue-supervisor {queue}", "connect_timeout": connect_timeout,
            "ping_interval": ping_interval, "max_outstanding_pings": 2,
            # nats.connect retries a refused server itself (60 x 2 s by default) even
            # without reconnects: keep it to a quick second try, our backoff does the rest.
            "max_reconnect_attempts": 1, "reconnect_time_wait": 0.1,
            **tls_options(url, tls), **(options or {}),
        }
        self._tls = tls or TlsSettings()
        self._tls_on = connect_options.get("tls") is not None
        self._link = Link(url, on_pulled=self._puller.on_pulled, prepare=self._prepare,
                          options=connect_options, on_read=self._read_done)
        self._requester = Requester(self._link, self._names, request_timeout)
        self._adoption = Adoption(queue, self._names, self._wanted, request_timeout,
                                  self._requester.connection)
        self._arrival: Callable[[], None] | None = None  # see on_arrival
        self._arrived_seen = 0  # the puller's arrivals when _read_done last looked
        self._acked = False  # a settle call's ack was answered since _read_done last looked
        self._held = Holdings()
        self._releaser = Releaser(self._names, self._requester, self._adoption, self._held,
                                  max_envelope_bytes)
        self._burial = Burial(self._names, self._requester.js_publish, self._requester.api,
                              self._requester.max_payload)
        self._presence = presence.Answerer(self._names.stream) if announce else None

    @property
    def names(self) -> QueueNames:
        return self._names

    @property
    def policy(self) -> Adopted:
        """The queue's settings as adopted at the last (re)connection."""
        if self._adoption.policy is None:
            raise BrokerError("not connected yet")
        return self._adoption.policy

    @property
    def lease(self) -> float:
        """How long an unrenewed delivery stays ours: the consumer's ack wait (or backoff)."""
        policy = self._adoption.policy
        return policy.lease if policy else self._wanted.ack_wait

    @property
    def reconnects(self) -> int:
        """How many times the connection was replaced (for status output and tests)."""
        return max(0, self._link.generation - 1)

    @property
    def max_attempts(self) -> int:
        """Runs a message gets: the consumer's budget (it wins over [job] max_attempts)."""
        policy = self._adoption.policy
        return policy.budget if policy else self._wanted.max_attempts

    @property
    def held(self) -> int:
        """Messages with a delivery held by this broker (bounded by what is outstanding)."""
        return len(self._held)

    def watch_connection(self, lost: Callable[[str], None], back: Callable[[], None]) -> None:
        """``lost(reason)`` when the connection breaks, ``back()`` once a new one is ready
        (the supervisor tells an outage once each way; see supervisor.outage)."""
        self._link.watch(lost, back)

    # -- lifecycle ---------------------------------------------------------------------

    async def connect(self) -> None:
        try:
            await self._connection(self._connect_timeout)
        except Unavailable as error:
            hint = self._tls.hint(error.last) if error.last and self._tls_on else ""
            if not hint:
                raise
            raise Unavailable(f"{error}{hint}", last=error.last) from error

    async def close(self) -> None:
        """Hand back what arrived but was never returned, then close the connection."""
        leftovers = self._puller.take_backlog()
        if leftovers and self._link.connection is not None:
            await asyncio.gather(*(self._releaser.release_unreturned(msg) for msg in leftovers))
        await self._burial.close(self._timeout)
        self._adoption.close()
        await self._link.close()
        self._held.clear()

    def stop_waiting(self) -> None:
        """A stop began: a receive waiting on an idle queue returns now (see Puller)."""
        self._puller.stop_waiting()

    async def oldest_ready_age(self) -> float | None:
        """Seconds since the oldest message still in the work stream was stored (it may be
        in flight: JetStream keeps it until acknowledged). None: the stream is empty."""
        info = await self._requester.api(api.stream_info(self._names.stream), {})
        state = info.get("state") or {}
        if not state.get("messages") or not state.get("first_ts"):
            return None
        first = datetime.datetime.fromisoformat(state["first_ts"].replace("Z", "+00:00"))
        return max(0.0, time.time() - first.timestamp())

    async def maintain(self) -> MaintenanceReport:
        """Read the consumer's budget when it is old (another worker may have changed it),
        and dead-letter what the max-deliveries advisories named, if a receive has not
        already (JetStream redelivers the rest)."""
        if time.monotonic() - self._adoption.read_at >= POLICY_MAX_AGE:
            await self._adoption.refresh()
        burying = self._burial.announced()
        if burying is not None:
            await asyncio.shield(burying)
        return MaintenanceReport()

    async def abandon(self, deliveries: Sequence[Delivery] = ()) -> None:
        """Nothing to do: JetStream redelivers unacknowledged deliveries after ack_wait."""

    # -- receive -----------------------------------------------------------------------

    async def receive(self, max_messages: int, block_timeout: float) -> Received:
        check_receive_limit(max_messages)
        conn = self._link.connection or await self._connection(
            max(block_timeout, self._connect_timeout))
        self._burial.announced()
        msgs = await self._puller.pull(conn, max_messages, block_timeout)
        received = Received()
        poison: list[asyncio.Future[Poisoned | None]] = []
        reread = False
        for msg in msgs:
            receipt = receipt_of(msg)
            if receipt is None:
                continue
            self._held.add(receipt.stream_seq, receipt.delivered)
            spare = self.policy.spare
            if spare is not None and receipt.delivered >= spare and not reread:
                reread = True  # the consumer is shared: its budget may have grown since
                await self._adoption.refresh()
                spare = self.policy.spare
            if spare is not None and receipt.delivered >= spare:
                reason = (f"out of attempts: delivery {receipt.delivered} of a consumer that "
                          f"allows {self.policy.budget} runs (every earlier one ended "
                          f"unsettled: a killed worker or supervisor, or a release)")
                poison.append(asyncio.ensure_future(
                    self._poison(msg, receipt, reason, malformed=False)))
                continue
            try:
                decoded, plain = envelope.decode_flagged(
                    msg.data, self._max_bytes, cast_timestamp=False)  # as decode_nats
            except envelope.MalformedEnvelope as error:
                poison.append(asyncio.ensure_future(
                    self._poison(msg, receipt, f"malformed: {error}")))
                continue
            received.deliveries.append(delivery_of(msg, receipt, decoded, plain))
        received.poisoned = [p for p in await asyncio.gather(*poison) if p is not None]
        return received

    def on_arrival(self, callback: Callable[[], None]) -> None:
        """``callback()`` after a read of the socket brought pulled messages, or answered
        acks while pulled messages wait (in that read's turn of the event loop): they may
        be taken with ``receive_nowait``."""
        self._arrival = callback

    def _read_done(self) -> None:
        """The server serves a pull ahead as soon as it applied the acks before it, and
        their replies often come after its messages, in a later read: the messages wait
        for the room those replies make, so a read that answered acks tells too."""
        arrived, acked = self._puller.arrived, self._acked
        self._acked = False
        if arrived != self._arrived_seen or (acked and self._puller.waiting):
            self._arrived_seen = arrived
            if self._arrival is not None:
                self._arrival()

    def receive_nowait(self, max_messages: int) -> Received | None:
        """What ``receive(max_messages, ...)`` would return, when it is there already and
        needs nothing awaited: ``max_messages`` arrived (no pull request of its own), each
        one a delivery to hand on (none at the spare delivery, whose verdict reads the
        consumer first, none undecodable, which goes to the dead stream), a connection up.
        None otherwise: ``receive`` does it. Repeats receive()'s per-message steps because
        they are few and this path must not await (see Arbiter.take_arrivals)."""
        check_receive_limit(max_messages)
        msgs = self._puller.ready(max_messages)
        policy = self._adoption.policy
        if msgs is None or self._link.connection is None or policy is None:
            return None
        spare = policy.spare
        deliveries: list[Delivery] = []
        for msg in msgs:
            receipt = receipt_of(msg)
            if receipt is None or (spare is not None and receipt.delivered >= spare):
                return None
            try:
                decoded, plain = envelope.decode_flagged(
                    msg.data, self._max_bytes, cast_timestamp=False)  # as decode_nats
            except envelope.MalformedEnvelope:
                return None
            deliveries.append(delivery_of(msg, receipt, decoded, plain))
        self._puller.take_ready(max_messages)
        for delivery in deliveries:
            self._held.add(delivery.receipt.stream_seq, delivery.receipt.delivered)
        self._burial.announced()
        return Received(deliveries)

    async def _poison(
        self, msg: Msg, receipt: NatsReceipt, reason: str, malformed: bool = True
    ) -> Poisoned | None:
        """Never handed on: dead stream first (confirmed), then TERM. A dead letter that is
        not confirmed leaves the delivery alone: it comes back after ack_wait."""
        self._held.drop(receipt.stream_seq, receipt.delivered)
        failure = Failure(error="MalformedMessage" if malformed else "AttemptsExhausted",
                          message=reason, attempt=receipt.delivered, at=time.time(),
                          outcome="dead")
        try:
            await self._burial.dead_letter(msg.data, receipt.stream_seq, reason,
                                           delivered=receipt.delivered,
                                           content_type=receipt.content_type, failure=failure)
        except BrokerError as error:
            log.warning("stream seq %d not dead-lettered yet (%s), it comes back after "
                        "ack_wait: %s", receipt.stream_seq, reason, error)
            return None
        result = await self._requester.respond(receipt, TERM)
        # The caller logs what it gets back (once); this line adds where it went.
        log.debug("stream seq %d moved to %s (%s); TERM %s", receipt.stream_seq,
                  self._names.dead_stream, reason, result.outcome)
        return Poisoned(msg.data, reason, malformed)

    # -- settle ------------------------------------------------------------------------

    async def settle(
        self, settlements: Sequence[Settlement], on_result: ResultCallback | None = None
    ) -> list[Result]:
        """See ``Broker.settle``. An ``on_result`` with a ``many(indices, result)`` method
        (``supervisor.settlement``) gets the confirmed acks of one read in one call."""
        results: list[Result] = [_UNSETTLED] * len(settlements)
        many: Callable[[list[int], Result], None] | None = getattr(on_result, "many", None)

        def report(index: int, result: Result) -> None:
            results[index] = result
            if on_result is not None:
                on_result(index, result)  # as soon as its own reply is in

        def report_many(indices: list[int], result: Result) -> None:
            for index in indices:
                results[index] = result
            if many is not None:
                many(indices, result)
            elif on_result is not None:
                for index in indices:
                    on_result(index, result)

        gone: set[int] = set()  # stream seqs of released deliveries no longer stored

        async def settle_one(index: int) -> None:
            report(index, await self._settle_one(settlements[index], gone))

        for start in range(0, len(settlements), MAX_BATCH):  # as Redis: any number, 1,000 a go
            chunk = range(start, min(start + MAX_BATCH, len(settlements)))
            commits = [i for i in chunk if settlements[i].action is Action.COMMIT]
            if len(commits) == len(chunk):  # the usual batch: no task for the gather
                await self._commit_all(settlements, commits, report, report_many, settle_one,
                                       ahead=True)
                continue
            # Asked for all releases first, so their copies are still published in order.
            gone |= await self._releaser.not_stored(
                [settlements[i].delivery.receipt for i in chunk
                 if settlements[i].action is Action.RELEASE])
            await asyncio.gather(
                self._commit_all(settlements, commits, report, report_many, settle_one),
                *(settle_one(i) for i in chunk if settlements[i].action is not Action.COMMIT))
        return results  # what is unconfirmed the caller tells (once per call, not here too)

    async def _commit_all(
        self, settlements: Sequence[Settlement], indices: Sequence[int],
        report: Callable[[int, Result], None],
        report_many: Callable[[list[int], Result], None],
        settle_one: Callable[[int], Awaitable[None]], ahead: bool = False,
    ) -> None:
        """The ACKs of a batch as one write (``broker.nats.acks``); what was certainly not
        applied (never sent, or answered 503) is tried again one at a time, as
        ``Requester.respond`` does for a single ack.

        ``ahead``: the next pull rides in the same write (``Puller.ahead``). Only for a
        batch of commits: one that hands jobs back (a retry, a release) leaves them to
        the other workers of the queue rather than pulling them back here at once."""
        if not indices:
            return
        again: list[int] = []

        def first_try(k: int, result: Result) -> None:
            index = indices[k]
            if result.outcome is Outcome.ERROR:
                again.append(index)
                return
            self._acked = True
            receipt: NatsReceipt = settlements[index].delivery.receipt
            self._held.drop(receipt.stream_seq, receipt.delivered)
            report(index, result)

        def confirmed(ks: list[int]) -> None:
            """first_try for the plain confirmations of one read (OK each), together."""
            self._acked = True
            chosen = [indices[k] for k in ks]
            drop = self._held.drop
            for index in chosen:
                receipt: NatsReceipt = settlements[index].delivery.receipt
                drop(receipt.stream_seq, receipt.delivered)
            report_many(chosen, APPLIED)

        try:
            # The live one without two coroutines to get it (once per settle call).
            conn = self._link.connection or await self._connection(self._timeout)
        except BrokerError:
            again = list(indices)  # each gets the one-at-a-time path's own wait and verdict
        else:
            receipts: list[NatsReceipt] = [settlements[i].delivery.receipt for i in indices]
            tail = self._puller.ahead(conn, len(indices)) if ahead else b""
            if await acks.request_all(conn, [r.reply for r in receipts], ACK, self._timeout,
                                      first_try, tail=tail, on_confirmed=confirmed):
                self._suspect(conn)
        if again:
            await asyncio.gather(*(settle_one(index) for index in again))

    async def _settle_one(self, settlement: Settlement, gone: set[int]) -> Result:
        receipt: NatsReceipt = settlement.delivery.receipt
        seq, delivered = receipt.stream_seq, receipt.delivered
        action = settlement.action
        if action is not Action.COMMIT and not self._held.owns(seq, delivered):
            # A newer delivery of this message reached us: a NAK/TERM here would hit it.
            self._held.drop(seq, delivered)
            return _SUPERSEDED
        if action is Action.COMMIT:
            result = await self._requester.respond(receipt, ACK)
        elif action is Action.RELEASE:
            result = await self._releaser.release(settlement.delivery, seq in gone)
        elif await self._out_of_attempts(delivered):
            result = await self._bury(settlement)
        else:
            delay = self._retry().delay(delivered - 1, self.policy.backoff)
            result = await self._requester.respond(receipt, nak_after(delay))
            if result.ok:  # what became of the job, for the supervisor's outcome line
                result = Result(Outcome.OK, f"retrying in {delay:g} s")
        if result.outcome is not Outcome.ERROR:  # on ERROR it is still ours: settled again
            self._held.drop(seq, delivered)
        return result

    async def _out_of_attempts(self, delivered: int) -> bool:
        """The budget's verdict on a rejected delivery. A dead letter is final, and the
        consumer is shared (a queue-5 worker's ensure mode may have raised MaxDeliver since
        we read it): before one, the budget is read again."""
        if not self._retry().exhausted(delivered - 1):
            return False
        await self._adoption.refresh()
        return self._retry().exhausted(delivered - 1)

    async def _bury(self, settlement: Settlement) -> Result:
        """Out of attempts: publish to the dead subject (PubAck awaited), then TERM."""
        receipt: NatsReceipt = settlement.delivery.receipt
        failure = settlement.failure or Failure.from_text(settlement.error)
        try:
            await self._burial.dead_letter(settlement.delivery.raw, receipt.stream_seq,
                                           settlement.error or "", delivered=receipt.delivered,
                                           failure=failure.replace(outcome="dead"))
        except BrokerError as error:
            return Result(Outcome.ERROR, f"dead letter not stored, delivery kept: {error}")
        result = await self._requester.respond(receipt, TERM)
        if result.ok:
            return Result(Outcome.OK, "dead")
        return Result(result.outcome, f"dead-lettered, but TERM: {result.detail}")

    def _retry(self) -> RetryPolicy:
        """The shared policy with the consumer's budget (which may change at a reconnect)."""
        return RetryPolicy(self.policy.budget, self._retry_backoff, self._retry_backoff_max)

    # -- extend ------------------------------------------------------------------------

    async def extend(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """As Redis: raises when no connection can be had (then nothing was renewed).

        The ``+WPI``s leave 1,000 to a write, each confirmed by its own reply, as a settle
        call's acks do (``broker.nats.acks``); one never sent, or answered 503, is tried
        again the one-at-a-time way, with its backoff. Each result is recorded as it comes."""
        conn = await self._connection(self._timeout)
        held = self._held
        results: list[Result] = [_SUPERSEDED] * len(deliveries)
        receipts: list[NatsReceipt] = []
        at: list[int] = []  # the index in ``results`` of each receipt renewed for a delivery
        for index, delivery in enumerate(deliveries):
            receipt: NatsReceipt = delivery.receipt
            if held.owns(receipt.stream_seq, receipt.delivered):
                receipts.append(receipt)
                at.append(index)
            else:
                held.drop(receipt.stream_seq, receipt.delivered)
        # What arrived but was not handed out is kept from redelivery the same way.
        receipts += [r for r in map(receipt_of, self._puller.backlog()) if r is not None]
        began = time.monotonic()
        again: list[int] = []

        def record(k: int, result: Result) -> None:
            if k < len(at):  # (the backlog's results are not reported)
                receipt = receipts[k]
                held.renewed(receipt.stream_seq, receipt.delivered, result.ok, began)
                results[at[k]] = result

        def first_try(offset: int) -> Callable[[int, Result], None]:
            def take(i: int, result: Result) -> None:
                if result.outcome is Outcome.ERROR:
                    again.append(offset + i)
                else:
                    record(offset + i, result)
            return take

        async def once_more(k: int) -> None:
            record(k, await self._requester.respond(receipts[k], WPI))

        for offset in range(0, len(receipts), MAX_BATCH):
            chunk = receipts[offset:offset + MAX_BATCH]
            if await acks.request_all(conn, [r.reply for r in chunk], WPI, self._timeout,
                                      first_try(offset)):
                self._suspect(conn)
        await asyncio.gather(*(once_more(k) for k in again))
        _log_unsure(results, "renewal")
        return [r.outcome is not Outcome.STALE for r in results]

    # -- publish -----------------------------------------------------------------------

    async def publish(self, queue: str, payload: dict[str, Any]) -> str:
        pid, raw = envelope.build(queue, payload)
        await self._requester.js_publish(QueueNames.of(queue).subject, raw, _publish_headers(pid))
        return pid

    async def publish_many(self, queue: str, payloads: Sequence[dict[str, Any]]) -> list[str]:
        """Publishes concurrently (1,000 at a time); raises if any was not confirmed."""
        built = [envelope.build(queue, payload) for payload in payloads]
        subject = QueueNames.of(queue).subject
        failed: list[BaseException] = []
        for start in range(0, len(built), MAX_BATCH):
            chunk = built[start:start + MAX_BATCH]
            outcomes = await asyncio.gather(
                *(self._requester.js_publish(subject, raw, _publish_headers(pid))
                  for pid, raw in chunk),
                return_exceptions=True,
            )
            failed += [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise BrokerError(f"{len(failed)} of {len(built)} messages not confirmed "
                              f"(the others are stored): {failed[0]}")
        return [pid for pid, _ in built]

    # -- plumbing ----------------------------------------------------------------------

    async def _connection(self, timeout: float) -> Connection:
        return await self._link.current(timeout)

    async def _prepare(self, conn: Connection) -> None:
        """Every new connection: adopt the queue's settings, subscribe to the advisory."""
        await self._adoption.adopt(conn)
        await conn.subscribe(self._names.advisory_subject, self._burial.on_advisory,
                             queue=ADVISORY_GROUP)
        if self._presence is not None:
            await self._presence.listen(conn)

    def _suspect(self, conn: Connection) -> None:
        self._link.suspect(conn, self._timeout)


def _publish_headers(pid: str) -> dict[str, str]:
    """As queue 5 publishes: the pid as message id (deduplication), JSON content type."""
    return {"Nats-Msg-Id": pid, CONTENT_TYPE: JSON}


def _log_unsure(results: Sequence[Result], what: str) -> None:
    unsure = [r for r in results if r.outcome in (Outcome.UNCERTAIN, Outcome.ERROR)]
    if unsure:
        log.warning("%s: %d of %d without a confirmed outcome (first: %s %s)", what,
                    len(unsure), len(results), unsure[0].outcome, unsure[0].detail)
