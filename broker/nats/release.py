"""Handing a delivery back to the queue without spending an attempt (a graceful stop
releases what never started; ``close`` what arrived after its receive gave up).

The message is republished under the id ``<pid>.released.<stream seq>``, then the delivery
acknowledged, so it keeps its whole budget, as queue 5's newest line does. On a work stream
with size limits (where a republish could push out another message) a NAK delayed by
``RELEASE_DELAY`` instead. Nothing at all (STALE) for a delivery no longer ours: its
renewals failed for longer than the server's wait (it delivers the message again), or the
stream no longer stores the message (another consumer's ACK took it after a redelivery):
a copy would be a duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from nats.aio.msg import Msg

from broker import envelope
from broker.base import BrokerError, Delivery, Outcome, Result
from broker.nats import api
from broker.nats.acks import ACK, NAK, nak_after
from broker.nats.adoption import Adoption
from broker.nats.dead import CONTENT_TYPE, header_token
from broker.nats.held import Holdings
from broker.nats.receipt import NatsReceipt, delivery_of, receipt_of
from broker.nats.requester import Requester
from broker.nats.setup import QueueNames

log = logging.getLogger("broker.nats")

#: Seconds a released message waits on a size-limited stream (queue 5's release delay).
RELEASE_DELAY = 5.0
#: JetStream's error code for a stream sequence it does not store ("no message found").
MSG_NOT_FOUND = 10037


class Releaser:
    """The releases of one queue's broker."""

    def __init__(self, names: QueueNames, requester: Requester, adoption: Adoption,
                 held: Holdings, max_bytes: int | None) -> None:
        self._names = names
        self._requester = requester
        self._adoption = adoption
        self._held = held
        self._max_bytes = max_bytes

    async def release(self, delivery: Delivery, gone: bool) -> Result:
        """Back to the queue without spending an attempt: republish, then ACK.

        Not when the delivery is no longer ours: its renewals failed for longer than the
        server waits (it delivers the message again, perhaps did: our ACK would take it
        from the consumer running it, the copy would run once more), or the message is no
        longer stored (another consumer's ACK took it: the copy would be a duplicate left
        in the queue). Either way the message is not lost: it comes back, or it was
        handled; nothing is sent. ``gone``: the stream said it no longer stores it
        (``not_stored``)."""
        receipt: NatsReceipt = delivery.receipt
        delayed = nak_after(RELEASE_DELAY)
        if self._adoption.current().bounded:
            return await self._requester.respond(receipt, delayed)
        lapsed = self._lapsed(receipt)
        if lapsed is not None:
            return Result(Outcome.STALE, lapsed)
        if gone:
            return Result(Outcome.STALE, "no copy: the message is no longer stored (acknowledged "
                                         "by another consumer after its redelivery)")
        headers = {"Nats-Msg-Id": f"{header_token(delivery.pid)}.released.{receipt.stream_seq}"}
        if receipt.content_type is not None:
            headers[CONTENT_TYPE] = receipt.content_type
        try:
            await self._requester.js_publish(receipt.subject or self._names.subject,
                                             delivery.raw, headers)
        except BrokerError as error:
            log.warning("release of stream seq %d by republishing failed (%s); NAK with "
                        "delay instead (spends an attempt)", receipt.stream_seq, error)
            return await self._requester.respond(receipt, delayed)
        result = await self._requester.respond(receipt, ACK)
        if result.ok:
            return result
        # The copy is stored; unless the ACK landed, the original comes back too.
        return Result(result.outcome, f"republished, but ACK: {result.detail}")

    def _lapsed(self, receipt: NatsReceipt) -> str | None:
        """Why the server has certainly let this delivery go, if it has: renewals failing
        since longer than its longest wait (ack wait or backoff) ago."""
        since = self._held.unrenewed_since(receipt.stream_seq, receipt.delivered)
        if since is None:
            return None
        policy = self._adoption.current()
        longest = max((policy.ack_wait, *policy.backoff))
        failing = time.monotonic() - since
        if failing <= longest:
            return None
        return (f"no copy: renewals failed for {failing:.1f}s, longer than the server's "
                f"{longest:g}s wait: it delivers the message again")

    async def not_stored(self, receipts: Sequence[NatsReceipt]) -> set[int]:
        """The stream seqs of ``receipts`` the work stream certainly no longer stores
        (acknowledged, or deleted); not those it cannot tell (the release goes ahead as
        before). Only a release asks (at a stop, mostly): never on the commit path."""
        if not receipts or self._adoption.current().bounded:
            return set()
        answers = await asyncio.gather(*(self._not_stored_one(r.stream_seq) for r in receipts))
        return {r.stream_seq for r, gone in zip(receipts, answers, strict=True) if gone}

    async def _not_stored_one(self, seq: int) -> bool:
        try:
            found = await self._requester.api(api.stream_msg_get(self._names.stream), {"seq": seq})
        except BrokerError:
            return False
        error = found.get("error")
        return isinstance(error, dict) and error.get("err_code") == MSG_NOT_FOUND

    async def release_unreturned(self, msg: Msg) -> None:
        """Close: a message that arrived after its receive gave up goes back the same way."""
        receipt = receipt_of(msg)
        if receipt is None:
            return
        try:
            decoded = envelope.decode_nats(msg.data, self._max_bytes)
        except envelope.MalformedEnvelope:
            await self._requester.respond(receipt, NAK)  # dead-lettered at its next delivery
            return
        gone = receipt.stream_seq in await self.not_stored([receipt])
        await self.release(delivery_of(msg, receipt, decoded), gone)
