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
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import hiredis
import redis.exceptions
from redis.asyncio.connection import parse_url

from broker.errors import closed_transport
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
        self._write(packed)  # first: a write that raises sent nothing, and queued nothing
        future = self._loop.create_future()
        self._waiting.append(future)
        self._sent_at.append(time.monotonic())
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._timeout / 4, self._watch)
        return future

    def send_joined(self, packed: list[bytes]) -> list[asyncio.Future[Any]]:
        """``send`` for several commands in one write (one syscall, one wake-up of Redis).
        ``send`` stays apart for one command: it runs once per script call, without lists."""
        if self.closed or self._transport is None:
            raise redis.exceptions.ConnectionError("Connection closed.")
        self._write(b"".join(packed))
        futures = [self._loop.create_future() for _ in packed]
        self._waiting.extend(futures)
        self._sent_at.extend([time.monotonic()] * len(packed))
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._timeout / 4, self._watch)
        return futures

    def _write(self, data: bytes) -> None:
        """The transport's write; a reply is never read within it, so the caller queues
        its future after. A write that raises drops the connection (what waits fails)."""
        try:
            self._transport.write(data)
        except BaseException as error:
            self.abort(f"write failed: {error!r}")
            if closed_transport(error):  # uvloop: the transport closed before we heard of it
                raise redis.exceptions.ConnectionError(f"Connection closed: {error}") from error
            raise

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


@dataclass(frozen=True, slots=True)
class Oversized:
    """The reply in place of a bulk string longer than a ``Wire``'s ``bulk_limit``: its
    length (its bytes were never read)."""

    length: int


_INCOMPLETE = object()


class _BoundedReplies(_Replies):
    """Replies parsed here rather than by hiredis, so that a bulk string over ``limit`` bytes
    is never read: its command is answered ``Oversized`` as soon as the length is known, and
    the connection is dropped at once (Redis stops sending). For the blocking connection,
    whose BLMOVE returns whatever payload it moved (issue 28 M1), and which never has a
    command queued behind its BLMOVE. Top-level replies only, the kinds its commands get:
    simple strings, errors, integers, bulk strings and nulls."""

    def __init__(self, timeout: float, limit: int) -> None:
        super().__init__(timeout)
        self._limit = limit
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._buffer += data
        try:
            while (reply := self._parse()) is not _INCOMPLETE:
                future = self._waiting.popleft()
                self._sent_at.popleft()
                if not future.done():  # its caller gave up (cancelled): the reply is dropped
                    future.set_result(reply)
                if isinstance(reply, Oversized):
                    self.abort(f"dropped a reply of {reply.length} bytes unread")
                    return
        except (redis.exceptions.InvalidResponse, ValueError, IndexError) as error:
            self.abort(f"unreadable reply: {error!r}")

    def _parse(self) -> Any:
        buffer = self._buffer
        end = buffer.find(b"\r\n")
        if end < 0:
            if len(buffer) > 65536:
                raise redis.exceptions.InvalidResponse("no reply header in 64 KiB")
            return _INCOMPLETE
        kind, line = bytes(buffer[:1]), bytes(buffer[1:end])
        if kind == b"$" and int(line) >= 0:
            length = int(line)
            if length > self._limit:
                buffer.clear()
                return Oversized(length)
            if len(buffer) < end + 4 + length:
                return _INCOMPLETE
            value = bytes(buffer[end + 2:end + 2 + length])
            del buffer[:end + 4 + length]
            return value
        del buffer[:end + 2]
        if kind == b"+":
            return line
        if kind == b"-":
            return redis.exceptions.ResponseError(line.decode(errors="replace"))
        if kind == b":":
            return int(line)
        if (kind in (b"$", b"*") and line == b"-1") or kind == b"_":
            return None
        raise redis.exceptions.InvalidResponse(f"unexpected reply {bytes(kind + line)[:40]!r}")


class Wire:
    """Commands to one plain Redis (the URL's server and database), as ``call(*args)``.

    With ``bulk_limit``, a bulk string reply longer than that many bytes is never read: it
    comes back as ``Oversized`` (for the blocking connection; see ``_BoundedReplies``)."""

    def __init__(
        self, url: str, tls: TlsSettings, timeout: float, connect_timeout: float,
        bulk_limit: int | None = None,
    ) -> None:
        self._options = parse_url(url)
        self._tls = tls if urlsplit(url).scheme == "rediss" else None
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._bulk_limit = bulk_limit
        self._replies: _Replies | None = None
        self._connecting: asyncio.Lock | None = None
        self.connects = 0  # connections made so far (the metrics count reconnects from it)

    async def call(self, *args: Any) -> Any:
        """The reply of one command; an error reply is raised as ResponseError."""
        replies = self._replies
        if replies is None or replies.closed:
            replies = await self._connect()
        reply = await replies.send(hiredis.pack_command(args))
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply

    async def send(self, *commands: tuple[Any, ...]) -> list[asyncio.Future[Any]]:
        """Send commands back to back on one connection, in one write; the futures of their
        replies (an error reply is the result, a ResponseError, not raised)."""
        replies = self._replies
        if replies is None or replies.closed:
            replies = await self._connect()
        return replies.send_joined([hiredis.pack_command(command) for command in commands])

    async def _connect(self) -> _Replies:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._replies is not None and not self._replies.closed:
                return self._replies  # another task connected meanwhile
            opened: _Replies | None = None
            try:
                async with asyncio.timeout(self._connect_timeout):
                    replies = opened = await self._open()
                    await self._hello(replies)
            except BaseException as error:
                # Connected, then AUTH or SELECT got no answer (a frozen server still
                # accepts connections) or was cancelled: closed, not left open for good.
                if opened is not None:
                    opened.abort("connect gave up")
                if isinstance(error, (OSError, TimeoutError)):
                    raise redis.exceptions.ConnectionError(
                        f"Error connecting: {error!r}") from error
                raise
            self._replies = replies
            self.connects += 1
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
        if self._bulk_limit is not None:
            return _BoundedReplies(self._timeout, self._bulk_limit)
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
