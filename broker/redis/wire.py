"""A lean RESP connection for the scripts on the hot path (reserve, claim, settle, extend).

redis-py's asyncio client spends more CPU on one EVALSHA of a few hundred arguments than on
anything else a delivery costs the supervisor: per call it converts every argument, takes a
connection from its pool, wraps the write in a task for its timeout, and parses the reply
behind another. Here a command is packed by hiredis in one call, written straight to the
transport, and its reply parsed by hiredis as the bytes arrive, into the caller's future.
Commands from several tasks share the connection, pipelined: replies come back in order.

Nothing is ever sent twice. A lost connection (or a reply later than ``timeout``, give or take
a quarter of it) fails every command in flight with redis-py's ConnectionError or
TimeoutError, as redis-py would (the broker treats those as "applied or not, unknown"); the
next call opens a new connection.
A plain Redis only: a Redis Cluster keeps redis-py's client, which follows redirections.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any
from urllib.parse import urlsplit

import hiredis
import redis.exceptions
from redis.asyncio.connection import parse_url

from broker.tls import TlsSettings


class _Replies(asyncio.Protocol):
    """One connection: every command's future, in the order the replies will come.

    The reply timeout is kept by one watchdog per connection, not a timer per command: it
    wakes every ``timeout / 4`` while commands wait and drops the connection once the
    oldest has waited longer than ``timeout``.
    """

    def __init__(self, timeout: float) -> None:
        self._reader = hiredis.Reader(
            protocolError=redis.exceptions.InvalidResponse,
            replyError=redis.exceptions.ResponseError,
        )
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._sent_at: collections.deque[float] = collections.deque()  # one per waiting
        self._transport: Any = None  # uvloop's transports are not asyncio.Transport
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._watchdog: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                future = waiting.popleft()
                self._sent_at.popleft()
                if not future.done():  # its caller gave up (cancelled): the reply is dropped
                    future.set_result(reply)
        except (redis.exceptions.InvalidResponse, IndexError) as error:
            self.abort(f"unreadable reply: {error!r}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reason = "Connection closed by server." if exc is None else f"Connection lost: {exc}"
        self._fail(redis.exceptions.ConnectionError(reason))

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        if self.closed or self._transport is None:
            raise redis.exceptions.ConnectionError("Connection closed.")
        future = self._loop.create_future()
        self._waiting.append(future)
        self._sent_at.append(time.monotonic())
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._timeout / 4, self._watch)
        self._transport.write(packed)
        return future

    def _watch(self) -> None:
        self._watchdog = None
        if self.closed or not self._sent_at:
            return  # idle: the next send arms it again
        if time.monotonic() - self._sent_at[0] > self._timeout:
            self.abort("timeout", redis.exceptions.TimeoutError("Timeout reading from socket"))
            return
        self._watchdog = self._loop.call_later(self._timeout / 4, self._watch)

    def abort(self, reason: str, error: Exception | None = None) -> None:
        """Drop the connection: the order of replies can no longer be trusted."""
        self.closed = True
        self._fail(error or redis.exceptions.ConnectionError(reason))
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, error: Exception) -> None:
        self._sent_at.clear()
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)


class Wire:
    """Commands to one plain Redis (the URL's server and database), as ``call(*args)``."""

    def __init__(
        self, url: str, tls: TlsSettings, timeout: float, connect_timeout: float
    ) -> None:
        self._options = parse_url(url)
        self._tls = tls if urlsplit(url).scheme == "rediss" else None
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._replies: _Replies | None = None
        self._connecting: asyncio.Lock | None = None

    async def call(self, *args: Any) -> Any:
        """The reply of one command; an error reply is raised as ResponseError."""
        replies = self._replies
        if replies is None or replies.closed:
            replies = await self._connect()
        reply = await replies.send(hiredis.pack_command(args))
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply

    async def _connect(self) -> _Replies:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._replies is not None and not self._replies.closed:
                return self._replies  # another task connected meanwhile
            try:
                async with asyncio.timeout(self._connect_timeout):
                    replies = await self._open()
                    await self._hello(replies)
            except (OSError, TimeoutError) as error:
                raise redis.exceptions.ConnectionError(f"Error connecting: {error!r}") from error
            self._replies = replies
            return replies

    async def _open(self) -> _Replies:
        loop = asyncio.get_running_loop()
        options = self._options
        if options.get("path"):
            _, replies = await loop.create_unix_connection(self._protocol, options["path"])
            return replies
        host = options.get("host") or "localhost"
        ssl = self._tls.context() if self._tls is not None else None
        _, replies = await loop.create_connection(
            self._protocol, host, options.get("port") or 6379, ssl=ssl,
            server_hostname=host if ssl is not None else None,
        )
        return replies

    def _protocol(self) -> _Replies:
        return _Replies(self._timeout)

    async def _hello(self, replies: _Replies) -> None:
        """AUTH and SELECT as redis-py does them for the same URL."""
        options = self._options
        password, username = options.get("password"), options.get("username")
        commands: list[tuple[Any, ...]] = []
        if password is not None or username:
            commands.append(("AUTH", username, password or "") if username
                            else ("AUTH", password))
        if options.get("db"):
            commands.append(("SELECT", options["db"]))
        for command in commands:
            reply = await replies.send(hiredis.pack_command(command))
            if isinstance(reply, redis.exceptions.ResponseError):
                replies.abort("refused")
                raise redis.exceptions.ConnectionError(f"{command[0]} refused: {reply}")

    def close(self) -> None:
        if self._replies is not None:
            self._replies.abort("closed")
            self._replies = None
