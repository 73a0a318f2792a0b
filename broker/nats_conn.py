"""One NATS connection that never reconnects by itself, with requests that always end.

nats-py's own reconnect replays buffered writes and its ``_close`` leaves pending request
futures waiting for their full timeout. Here a broken connection is simply finished: every
request still waiting for its reply fails at once with ``ConnectionLost(sent=True)`` (the
server may or may not have applied it), and a new ``Connection`` is built by the caller
(see ``broker.nats_link``).

All replies and pulled messages arrive on one wildcard inbox subscription. Replies and
pull statuses carry their request's token in the subject; pulled JetStream messages carry
their original subject instead, so they cannot be matched to a pull request and are
handed to ``on_pulled`` as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker.base import BrokerError

log = logging.getLogger("broker.nats")


class ConnectionLost(BrokerError):
    """The connection closed. ``sent`` says whether the request may have reached the server."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class RequestTimeout(BrokerError):
    """No reply within the timeout: the request may or may not have been applied."""


class Connection:
    """A connected nats-py client (``allow_reconnect=False``) and its reply inbox."""

    def __init__(self, client: Client, on_pulled: Callable[[Msg], None]) -> None:
        self.client = client
        self._on_pulled = on_pulled
        self._prefix = client.new_inbox() + "."
        self._tokens = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._closed = asyncio.get_running_loop().create_future()

    @classmethod
    async def open(
        cls, url: str, on_pulled: Callable[[Msg], None], **options: Any
    ) -> Connection:
        """Connect and subscribe the inbox; raises whatever nats-py raises on failure."""
        holder: list[Connection] = []

        async def closed_cb() -> None:
            if holder:
                holder[0]._finish("connection closed")

        async def error_cb(error: Exception) -> None:
            log.debug("nats client error: %r", error)

        client = await nats.connect(
            url, allow_reconnect=False, closed_cb=closed_cb, error_cb=error_cb, **options
        )
        conn = cls(client, on_pulled)
        holder.append(conn)
        try:
            # No pending limits: the callback only routes, and a limit would drop deliveries.
            await client.subscribe(
                conn._prefix + "*", cb=conn._dispatch, pending_msgs_limit=0,
                pending_bytes_limit=0,
            )
        except BaseException:
            await conn.close()
            raise
        return conn

    @property
    def closed(self) -> bool:
        # nats-py marks itself closed before it runs closed_cb: trust either signal.
        return self._closed.done() or self.client.is_closed

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def expect_reply(self, timeout: float, what: str) -> tuple[str, asyncio.Future[Msg]]:
        """A fresh reply subject and the future its first message resolves.

        The future fails with RequestTimeout after ``timeout`` and with ConnectionLost when
        the connection closes; cancelling it forgets the subject.
        """
        if self.closed:
            raise ConnectionLost("not sent: the connection is closed", sent=False)
        loop = asyncio.get_running_loop()
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = loop.create_future()
        timer = loop.call_later(timeout, self._expire, future, f"no reply to {what} in {timeout}s")
        future.add_done_callback(lambda _: (timer.cancel(), self._waiting.pop(token, None)))
        self._waiting[token] = future
        return self._prefix + token, future

    async def request(
        self, subject: str, payload: bytes = b"", *, timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        """Publish with a reply inbox and wait for the reply (or the timeout, or a close)."""
        reply, future = self.expect_reply(timeout, subject)
        try:
            await self.publish(subject, payload, reply=reply, headers=headers)
            return await future
        finally:
            future.cancel()  # no-op once done; otherwise drops the token (e.g. cancelled)

    async def publish(
        self, subject: str, payload: bytes = b"", *, reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Hand bytes to the client; raises ConnectionLost(sent=False) if it refuses them."""
        try:
            await self.client.publish(subject, payload, reply=reply, headers=headers)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError,
                OSError) as error:
            raise ConnectionLost(f"not sent: {error!r}", sent=False) from error

    async def check(self, timeout: float) -> bool:
        """PING/PONG round trip; a connection that fails it is closed (so requests end)."""
        if self.closed:
            return False
        try:
            await self.client.flush(timeout)
            return True
        except Exception as error:  # any failure means we cannot trust this socket
            log.warning("nats connection failed its health check (%r): closing it", error)
            await self.close()
            return False

    async def close(self, timeout: float = 2.0) -> None:
        """Close the client; pending requests fail with ConnectionLost(sent=True)."""
        self._finish("connection closed by us")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.close(), timeout)

    def _finish(self, reason: str) -> None:
        if not self._closed.done():
            self._closed.set_result(None)
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(ConnectionLost(f"reply lost: {reason}", sent=True))
        self._waiting.clear()

    @staticmethod
    def _expire(future: asyncio.Future[Msg], message: str) -> None:
        if not future.done():
            future.set_exception(RequestTimeout(message))

    async def _dispatch(self, msg: Msg) -> None:
        if msg.subject.startswith(self._prefix):
            future = self._waiting.get(msg.subject[len(self._prefix):])
            if future is not None and not future.done():
                future.set_result(msg)
        else:
            self._on_pulled(msg)
