"""The NATS JetStream broker: the same interface as the Redis one, JetStream semantics.

JetStream itself keeps the pending deliveries and the recovery of abandoned work
(redelivery after ``ack_wait``), so this adapter is thin:

- receive: a pull that waits for the first message, then no-wait top-ups for the rest of
  the room (``broker.nats_pull``). Undecodable messages go to the dead stream, then TERM.
- commit: an ack sent as a request, so the server's reply confirms it (``ack_sync``
  style). Many are in flight at once; each result is reported when its own reply arrives.
  A reply lost to a timeout or a broken connection is UNCERTAIN and is never replayed.
- reject: NAK with a backoff delay while the delivery count (JetStream's
  ``num_delivered``) is below ``max_attempts``; at ``max_attempts`` the payload is
  published to the dead subject (PubAck awaited), then the message is TERMinated.
- release: NAK without delay. JetStream counts every delivery, so a released message
  comes back with ``attempts`` one higher and has used one of its ``max_attempts``,
  unlike on Redis. A worker or supervisor that dies holding a delivery uses one too.
- extend: ``+WPI`` (in progress) for every delivery, as requests. The server answers the
  same way whether or not the delivery is still pending, so ``False`` is reported only
  for what we know is gone: a delivery superseded by a newer delivery of the same message
  that reached us, or one whose consumer no longer exists.
- maintain: nothing to do (JetStream recovers); abandon: nothing to do either, since an
  unacknowledged delivery is redelivered by the server once its ``ack_wait`` runs out.

Attempts are counted here, not by JetStream. ``max_attempts`` (the job's) decides when a
rejected delivery is dead-lettered; ``max_deliver`` is only the consumer's MaxDeliver and
defaults to -1 (unlimited). With a MaxDeliver equal to ``max_attempts``, a delivery whose
last attempt ended without a settlement (its supervisor was killed, or a graceful stop
released it) would never be redelivered, dead-lettered or acknowledged: it would stay in
the work stream until the stream's max_age. Unlimited, it comes back once more, and a
delivery received with ``num_delivered > max_attempts`` is dead-lettered at once (PubAck
awaited, then TERM), never handed to a handler, and reported in ``Received.poisoned``.
If that dead letter is not confirmed, the delivery is left alone and comes back after
``ack_wait``: nothing is TERMinated without its dead letter. An existing consumer with a
positive MaxDeliver is used as configured; at or below ``max_attempts`` a warning says
what it risks.

The connection is replaced, never repaired (``broker.nats_link``): operations in flight
when it breaks end UNCERTAIN (or ERROR when they were never sent); every other delivery
stays valid, since its acks go to its own reply subject from whichever connection is live.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from broker import envelope
from broker.base import (
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
)
from broker.nats_conn import Connection, ConnectionLost, RequestTimeout
from broker.nats_link import Link
from broker.nats_pull import Puller
from broker.nats_setup import UNLIMITED, ConsumerSettings, QueueNames, ensure_queue

log = logging.getLogger("broker.nats")

ACK, NAK, TERM, WPI = b"+ACK", b"-NAK", b"+TERM", b"+WPI"


@dataclass(frozen=True, slots=True)
class NatsReceipt:
    """Proof of one delivery: its ack subject (valid from any connection) and counters."""

    reply: str  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...
    stream_seq: int
    delivered: int  # JetStream's num_delivered for this delivery (1 = first)


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
        max_deliver: int = UNLIMITED,
        retry_backoff: float = 0.0,
        max_envelope_bytes: int = envelope.MAX_ENVELOPE_BYTES,
        lease: float | None = None,
        job_ttl: float = 0.0,
        request_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        ping_interval: float = 10.0,
        options: dict[str, Any] | None = None,
    ) -> None:
        """``max_attempts`` is the handler's attempts (a rejected delivery is dead-lettered
        at that delivery count); ``max_deliver`` is only the consumer's MaxDeliver (-1 =
        unlimited, see the module docstring). ``lease``, when given, is the supervisor's
        lease and becomes the ``ack_wait``: both say how long an unrenewed delivery stays
        ours. ``job_ttl`` (s, 0 = forever) is the max age of dead letters in a dead stream
        we create. ``options`` go to ``nats.connect`` (credentials, TLS)."""
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if max_deliver != UNLIMITED and max_deliver < 1:
            raise ValueError("max_deliver must be -1 (unlimited) or at least 1")
        self.queue = queue
        self._max_attempts = max_attempts
        self._names = QueueNames.of(queue)
        self._settings = ConsumerSettings(
            ack_wait=float(lease if lease is not None else ack_wait),
            max_deliver=max_deliver, job_ttl=job_ttl,
        )
        if self._settings.ack_wait <= 0:
            raise ValueError("ack_wait must be positive")
        self._retry_backoff = retry_backoff
        self._max_bytes = max_envelope_bytes
        self._timeout = request_timeout
        self._connect_timeout = connect_timeout
        self._puller = Puller(self._names.next_subject, request_timeout, self._suspect)
        connect_options = {
            "name": f"queue-supervisor {queue}", "connect_timeout": connect_timeout,
            "ping_interval": ping_interval, "max_outstanding_pings": 2,
            # nats.connect retries a refused server itself (60 x 2 s by default) even
            # without reconnects: keep it to a quick second try, our backoff does the rest.
            "max_reconnect_attempts": 1, "reconnect_time_wait": 0.1, **(options or {}),
        }
        self._link = Link(url, on_pulled=self._puller.on_pulled, prepare=self._prepare,
                          options=connect_options)
        # stream seq -> highest num_delivered we received: an older delivery is stale.
        self._latest: dict[int, int] = {}

    @property
    def names(self) -> QueueNames:
        return self._names

    @property
    def reconnects(self) -> int:
        """How many times the connection was replaced (for status output and tests)."""
        return max(0, self._link.generation - 1)

    # -- lifecycle ---------------------------------------------------------------------

    async def connect(self) -> None:
        await self._connection(self._connect_timeout)
        max_deliver = self._settings.max_deliver
        if max_deliver != UNLIMITED and max_deliver <= self._max_attempts:
            log.warning(
                "NATS consumer %r on %s has max_deliver %d, not above max_attempts %d: a "
                "delivery lost on its last allowed attempt (a killed supervisor, a release at "
                "a graceful stop) is never redelivered nor dead-lettered and stays in the "
                "stream until its max_age. Use max_deliver = -1 (unlimited) or above "
                "max_attempts.", self._names.consumer, self._names.stream, max_deliver,
                self._max_attempts)

    async def close(self) -> None:
        """Release what arrived but was never returned, then close the connection."""
        leftovers = self._puller.take_backlog()
        conn = self._link.connection
        if leftovers and conn is not None:
            await asyncio.gather(
                *(self._request(conn, m.reply, NAK) for m in leftovers if m.reply))
        await self._link.close()
        self._latest.clear()

    async def maintain(self) -> MaintenanceReport:
        return MaintenanceReport()  # JetStream redelivers abandoned work itself

    async def abandon(self, deliveries: Sequence[Delivery] = ()) -> None:
        """Nothing to do: JetStream redelivers unacknowledged deliveries after ack_wait."""

    # -- receive -----------------------------------------------------------------------

    async def receive(self, max_messages: int, block_timeout: float) -> Received:
        if not 0 < max_messages <= MAX_BATCH:
            raise ValueError(f"max_messages must be between 1 and {MAX_BATCH}")
        conn = await self._connection(max(block_timeout, self._connect_timeout))
        msgs = await self._puller.pull(conn, max_messages, block_timeout)
        received = Received()
        poison: list[asyncio.Future[Poisoned | None]] = []
        for msg in msgs:
            receipt = _receipt(msg)
            if receipt is None:
                continue
            self._latest[receipt.stream_seq] = max(
                self._latest.get(receipt.stream_seq, 0), receipt.delivered)
            try:
                decoded = envelope.decode(msg.data, self._max_bytes)
            except envelope.MalformedEnvelope as error:
                poisoned = self._poison(msg, receipt, str(error), f"malformed: {error}")
            else:
                if receipt.delivered <= self._max_attempts:
                    received.deliveries.append(_delivery(msg, receipt, decoded))
                    continue
                reason = self._out_of_attempts(receipt)
                poisoned = self._poison(msg, receipt, reason, reason, malformed=False)
            poison.append(asyncio.ensure_future(poisoned))
        received.poisoned = [p for p in await asyncio.gather(*poison) if p is not None]
        return received

    def _out_of_attempts(self, receipt: NatsReceipt) -> str:
        """Why a delivery past max_attempts is not handled (its last attempt was used up by
        a release or by a worker or supervisor that died holding it)."""
        return (f"out of attempts after {receipt.delivered} deliveries (max_attempts "
                f"{self._max_attempts}); releases and lost workers count as deliveries on "
                f"JetStream")

    async def _poison(
        self, msg: Msg, receipt: NatsReceipt, reason: str, dead_reason: str,
        malformed: bool = True,
    ) -> Poisoned | None:
        """Never handed on: dead stream first (confirmed), then TERM. A dead letter that is
        not confirmed leaves the delivery alone: it comes back after ack_wait."""
        try:
            await self._dead_letter(msg.data, receipt, dead_reason)
        except BrokerError as error:
            log.warning("stream seq %d not dead-lettered yet (%s), it comes back after "
                        "ack_wait: %s", receipt.stream_seq, dead_reason, error)
            return None
        result = await self._respond(receipt, TERM)
        # The caller logs what it gets back (once); this line adds where it went.
        log.debug("stream seq %d moved to %s (%s); TERM %s", receipt.stream_seq,
                  self._names.dead_stream, dead_reason, result.outcome)
        self._forget(receipt, result)
        return Poisoned(msg.data, reason, malformed)

    # -- settle ------------------------------------------------------------------------

    async def settle(
        self, settlements: Sequence[Settlement], on_result: ResultCallback | None = None
    ) -> list[Result]:
        if len(settlements) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} settlements per call")

        async def settle_one(index: int, settlement: Settlement) -> Result:
            result = await self._settle_one(settlement)
            if on_result is not None:
                on_result(index, result)  # as soon as its own reply is in
            return result

        results = list(await asyncio.gather(
            *(settle_one(index, s) for index, s in enumerate(settlements))))
        _log_unsure(results, "settle")
        return results

    async def _settle_one(self, settlement: Settlement) -> Result:
        receipt: NatsReceipt = settlement.delivery.receipt
        action = settlement.action
        if action is not Action.COMMIT and self._is_stale(receipt):
            # A newer delivery of this message reached us: a NAK/TERM here would hit it.
            return Result(Outcome.STALE, "superseded by a newer delivery")
        if action is Action.COMMIT:
            result = await self._respond(receipt, ACK)
        elif action is Action.RELEASE:
            result = await self._respond(receipt, NAK)
        elif receipt.delivered >= self._max_attempts:
            result = await self._bury(settlement)
        else:
            result = await self._respond(receipt, self._nak_with_backoff(receipt))
        self._forget(receipt, result)
        return result

    async def _bury(self, settlement: Settlement) -> Result:
        """Out of attempts: publish to the dead subject (PubAck awaited), then TERM."""
        receipt: NatsReceipt = settlement.delivery.receipt
        try:
            await self._dead_letter(settlement.delivery.raw, receipt, settlement.error or "")
        except BrokerError as error:
            return Result(Outcome.ERROR, f"dead letter not stored, delivery kept: {error}")
        result = await self._respond(receipt, TERM)
        if result.ok:
            return result
        return Result(result.outcome, f"dead-lettered, but TERM: {result.detail}")

    def _nak_with_backoff(self, receipt: NatsReceipt) -> bytes:
        delay = self._retry_backoff * 2 ** (receipt.delivered - 1)
        if delay <= 0:
            return NAK
        return NAK + b" " + orjson.dumps({"delay": int(delay * 1e9)})

    # -- extend ------------------------------------------------------------------------

    async def extend(self, deliveries: Sequence[Delivery]) -> list[bool]:
        results = await asyncio.gather(*(self._renew(d.receipt) for d in deliveries))
        _log_unsure(results, "renewal")
        return [r.outcome is not Outcome.STALE for r in results]

    async def _renew(self, receipt: NatsReceipt) -> Result:
        if self._is_stale(receipt):
            return Result(Outcome.STALE, "superseded by a newer delivery")
        return await self._respond(receipt, WPI)

    # -- publish -----------------------------------------------------------------------

    async def publish(self, queue: str, payload: dict[str, Any]) -> str:
        pid, raw = envelope.build(queue, payload)
        await self._js_publish(QueueNames.of(queue).subject, raw, {"Nats-Msg-Id": pid})
        return pid

    async def publish_many(self, queue: str, payloads: Sequence[dict[str, Any]]) -> list[str]:
        """Publishes concurrently (1,000 at a time); raises if any was not confirmed."""
        built = [envelope.build(queue, payload) for payload in payloads]
        subject = QueueNames.of(queue).subject
        failed: list[BaseException] = []
        for start in range(0, len(built), MAX_BATCH):
            chunk = built[start:start + MAX_BATCH]
            outcomes = await asyncio.gather(
                *(self._js_publish(subject, raw, {"Nats-Msg-Id": pid}) for pid, raw in chunk),
                return_exceptions=True,
            )
            failed += [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise BrokerError(f"{len(failed)} of {len(built)} messages not confirmed "
                              f"(the others are stored): {failed[0]}")
        return [pid for pid, _ in built]

    async def _dead_letter(self, raw: bytes, receipt: NatsReceipt, reason: str) -> None:
        # The id makes a repeated dead-lettering of the same message a no-op (dedup window).
        headers = {"Nats-Msg-Id": f"{self._names.stream}:{receipt.stream_seq}",
                   "Queue-Attempts": str(receipt.delivered)}
        if reason:
            headers["Queue-Reason"] = _header_value(reason)
        await self._js_publish(self._names.dead_subject, raw, headers)

    async def _js_publish(self, subject: str, raw: bytes, headers: dict[str, str]) -> None:
        """JetStream publish, PubAck awaited. Every caller sets Nats-Msg-Id, so sending
        again after a lost reply is deduplicated by the stream: safe to retry."""
        last: BrokerError | None = None
        for _ in range(3):
            conn = await self._connection(self._timeout)
            try:
                reply = await conn.request(subject, raw, timeout=self._timeout, headers=headers)
            except (ConnectionLost, RequestTimeout) as error:
                if isinstance(error, RequestTimeout):
                    self._suspect(conn)
                last = error
                continue
            _check_puback(subject, reply)
            return
        raise BrokerError(f"publish to {subject} not confirmed: {last}")

    # -- plumbing ----------------------------------------------------------------------

    async def _connection(self, timeout: float) -> Connection:
        return await self._link.current(timeout)

    async def _prepare(self, conn: Connection) -> None:
        await ensure_queue(conn, self._names, self._settings, self._timeout)

    def _suspect(self, conn: Connection) -> None:
        self._link.suspect(conn, self._timeout)

    async def _respond(self, receipt: NatsReceipt, body: bytes) -> Result:
        """Send an ack-family message as a request on the live connection."""
        for _ in range(2):  # a second try only when the first was certainly not sent
            try:
                conn = await self._connection(self._timeout)
            except BrokerError as error:
                return Result(Outcome.ERROR, f"not sent: {error}")
            result = await self._request(conn, receipt.reply, body)
            if result.outcome is not Outcome.ERROR:
                return result
        return result

    async def _request(self, conn: Connection, reply: str, body: bytes) -> Result:
        try:
            answer = await conn.request(reply, body, timeout=self._timeout)
        except ConnectionLost as error:
            return Result(Outcome.UNCERTAIN if error.sent else Outcome.ERROR, str(error))
        except RequestTimeout as error:
            self._suspect(conn)
            return Result(Outcome.UNCERTAIN, str(error))
        if (answer.headers or {}).get("Status") == "503":
            return Result(Outcome.STALE, "no responder: the consumer no longer exists")
        return Result(Outcome.OK)

    def _is_stale(self, receipt: NatsReceipt) -> bool:
        return self._latest.get(receipt.stream_seq, 0) > receipt.delivered

    def _forget(self, receipt: NatsReceipt, result: Result) -> None:
        """A settled delivery needs no staleness tracking any more."""
        if result.ok and self._latest.get(receipt.stream_seq) == receipt.delivered:
            del self._latest[receipt.stream_seq]


def _receipt(msg: Msg) -> NatsReceipt | None:
    try:
        meta = msg.metadata
    except (NotJSMessageError, ValueError, IndexError):
        log.warning("ignored a message without JetStream metadata on the pull inbox")
        return None
    return NatsReceipt(msg.reply, meta.sequence.stream, meta.num_delivered)


def _delivery(msg: Msg, receipt: NatsReceipt, decoded: dict[str, Any]) -> Delivery:
    return Delivery(
        pid=decoded["pid"], queue=decoded["queue"], timestamp=decoded["timestamp"],
        attempts=receipt.delivered - 1, payload=decoded["payload"], raw=msg.data,
        receipt=receipt, envelope=decoded,
    )


def _check_puback(subject: str, reply: Msg) -> None:
    if (reply.headers or {}).get("Status") == "503":
        raise BrokerError(f"no JetStream stream stores {subject!r}: create the queue's "
                          f"stream first (connect a broker for that queue)")
    try:
        ack = orjson.loads(reply.data)
    except orjson.JSONDecodeError:
        raise BrokerError(
            f"unexpected reply to a publish on {subject}: {reply.data[:200]!r}") from None
    if "error" in ack:
        raise BrokerError(f"publish on {subject} refused: {ack['error'].get('description')}")


def _header_value(text: str) -> str:
    return " ".join(text.split())[:1024]


def _log_unsure(results: Sequence[Result], what: str) -> None:
    unsure = [r for r in results if r.outcome in (Outcome.UNCERTAIN, Outcome.ERROR)]
    if unsure:
        log.warning("%s: %d of %d without a confirmed outcome (first: %s %s)", what,
                    len(unsure), len(results), unsure[0].outcome, unsure[0].detail)
