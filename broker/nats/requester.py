"""Requests to JetStream on whichever connection is live, each confirmed by its reply.

Three kinds, each for one caller's need: an ack-family message of one delivery (``+ACK``,
``-NAK``, ``+TERM``, ``+WPI``; tried again through a cluster's leader election, see
``respond``), a JetStream API call (``api``), and a publish whose PubAck is awaited
(``js_publish``). A request that times out marks its connection as suspect (``Link``), so a
dead one is replaced rather than waited on. A settle call's many acks go as one write
instead (``broker.nats.acks``) and fall back to ``respond`` for what was certainly not
applied.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from nats.aio.msg import Msg

from broker.base import BrokerError, Outcome, Result
from broker.nats import acks, api
from broker.nats.acks import NO_RESPONDERS
from broker.nats.conn import Connection, ConnectionLost, RequestTimeout
from broker.nats.link import Link
from broker.nats.receipt import NatsReceipt
from broker.nats.setup import QueueNames

#: First and longest pause (s) between tries of an ack answered 503.
LEADERLESS_BACKOFF = (0.1, 1.0)


class Requester:
    """The requests of one queue's broker, on its ``Link``, each waiting ``timeout`` s."""

    def __init__(self, link: Link, names: QueueNames, timeout: float) -> None:
        self._link = link
        self._names = names
        self._timeout = timeout
        self._gone: asyncio.Future[bool] | None = None  # see consumer_gone
        self._gone_until = 0.0

    async def connection(self, timeout: float) -> Connection:
        return await self._link.current(timeout)

    async def max_payload(self) -> int:
        """The server's max_payload (a dead letter's failure record fits in what it leaves)."""
        return (await self.connection(self._timeout)).client.max_payload

    def suspect(self, conn: Connection) -> None:
        self._link.suspect(conn, self._timeout)

    async def js_publish(self, subject: str, raw: bytes, headers: dict[str, str]) -> None:
        """JetStream publish, PubAck awaited. Every caller sets Nats-Msg-Id, so sending
        again after a lost reply is deduplicated by the stream: safe to retry."""
        last: BrokerError | None = None
        for _ in range(3):
            conn = await self.connection(self._timeout)
            try:
                reply = await conn.request(subject, raw, timeout=self._timeout, headers=headers)
            except (ConnectionLost, RequestTimeout) as error:
                if isinstance(error, RequestTimeout):
                    self.suspect(conn)
                last = error
                continue
            check_puback(subject, reply)
            return
        raise BrokerError(f"publish to {subject} not confirmed: {last}")

    async def api(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = await self.connection(self._timeout)
        try:
            reply = await conn.request(subject, orjson.dumps(body), timeout=self._timeout)
            answer: dict[str, Any] = orjson.loads(reply.data)
            return answer
        except (ConnectionLost, RequestTimeout, orjson.JSONDecodeError) as error:
            raise BrokerError(f"{subject}: {error}") from error

    async def respond(self, receipt: NatsReceipt, body: bytes) -> Result:
        """Send an ack-family message as a request on the live connection.

        Not sent: one more try at once. Answered 503 (nobody serves the consumer: a
        JetStream cluster elects its new leader within seconds): tried again with backoff
        for up to the request timeout; then STALE if the consumer no longer exists, else
        ERROR (certainly not applied: the caller settles or renews it again later).
        """
        unsent = 0
        pause, deadline = LEADERLESS_BACKOFF[0], time.monotonic() + self._timeout
        while True:
            try:
                conn = await self.connection(self._timeout)
            except BrokerError as error:
                return Result(Outcome.ERROR, f"not sent: {error}")
            result = await self.request(conn, receipt.reply, body)
            if result.outcome is not Outcome.ERROR:
                return result
            if result.detail != NO_RESPONDERS:
                unsent += 1
                if unsent == 2:
                    return result
                continue
            if time.monotonic() + pause > deadline:
                if await self.consumer_gone():
                    return Result(Outcome.STALE, "no responder: the consumer no longer exists")
                return result
            await asyncio.sleep(pause)
            pause = min(pause * 2, LEADERLESS_BACKOFF[1])

    async def request(self, conn: Connection, reply: str, body: bytes) -> Result:
        try:
            answer = await conn.request(reply, body, timeout=self._timeout)
        except (ConnectionLost, RequestTimeout) as error:
            if isinstance(error, RequestTimeout):
                self.suspect(conn)
            return acks.error_result(error)
        return acks.reply_result(answer)

    async def consumer_gone(self) -> bool:
        """Whether the JetStream API says the consumer does not exist: one question at a
        time (and its answer kept for a second), however many acks got a 503."""
        if self._gone is None or (self._gone.done() and time.monotonic() > self._gone_until):
            self._gone = asyncio.ensure_future(self._ask_consumer_gone())
            self._gone_until = time.monotonic() + 1.0
        return await asyncio.shield(self._gone)

    async def _ask_consumer_gone(self) -> bool:
        names = self._names
        try:
            info = await self.api(api.consumer_info(names.stream, names.consumer), {})
        except BrokerError:
            return False  # no answer (still electing): not known to be gone
        return (info.get("error") or {}).get("code") == 404


def check_puback(subject: str, reply: Msg) -> None:
    if (reply.headers or {}).get("Status") == "503":
        raise BrokerError(f"no JetStream stream stores {subject!r} (or the one that does "
                          f"has no leader now: a cluster electing one); create the queue's "
                          f"stream first (connect a broker for that queue)")
    try:
        ack = orjson.loads(reply.data)
    except orjson.JSONDecodeError:
        raise BrokerError(
            f"unexpected reply to a publish on {subject}: {reply.data[:200]!r}") from None
    if "error" in ack:
        raise BrokerError(f"publish on {subject} refused: {ack['error'].get('description')}")
