"""One NATS connection that never reconnects by itself, with requests that always end.

nats-py's own reconnect replays buffered writes and its ``_close`` leaves pending request
futures waiting for their full timeout. Here a broken connection is simply finished: every
request still waiting for its reply fails at once with ``ConnectionLost(sent=True)`` (the
server may or may not have applied it), and a new ``Connection`` is built by the caller
(see ``broker.nats.link``).

All replies and pulled messages arrive on one wildcard inbox subscription. Replies and
pull statuses carry their request's token in the subject; pulled JetStream messages carry
their original subject instead, so they cannot be matched to a pull request and are
handed to ``on_pulled`` as they come. The inbox's messages skip nats-py's per-subscription
queue and task: the client's message hook routes them as the parser hands them over
(``_route``), without a coroutine per message, and their headers are read here.

``request_batch`` sends many requests in one write (each with its own reply subject, as
``request`` does) and hands each reply to a callback; replies are matched by token, in
whatever order they come. Bare replies (an ack's confirmation) that one pass of the parser
read may go to their batch together: one call for the lot rather than a chain of calls each.

Every request keeps its own timeout, but they share one loop timer (``_Deadlines``): at
thousands of acks per second, a timer and a done-callback per request were about a quarter
of the client-side CPU of an ack.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker.base import BrokerError, BrokerRefused
from broker.errors import closed_transport
from broker.nats import parse
from broker.nats import tls as nats_tls
from broker.urls import redact

log = logging.getLogger("broker.nats")


class Slot:
    """One request of a batch whose reply goes to a callback, not a future: called in the
    turn the reply is read, with no hop through the loop's ready queue. What the callback
    raises is logged, never let into nats-py's read loop (which would stop reading).
    ``many``: where bare replies go instead, several at once (``Connection._routed``)."""

    __slots__ = ("_call", "_done", "_index", "_many")

    def __init__(self, index: int, call: Callable[[int, Msg | BaseException], None],
                 many: Callable[[list[int]], None] | None = None) -> None:
        self._index = index
        self._call = call
        self._many = many
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, msg: Msg) -> None:
        self._finish(msg)

    def set_exception(self, error: BaseException) -> None:
        self._finish(error)

    def cancel(self) -> bool:
        """Forget the request: its reply, if any comes, is ignored."""
        if self._done:
            return False
        self._done = True
        return True

    def _finish(self, outcome: Msg | BaseException) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._call(self._index, outcome)
        except Exception:
            log.exception("reply callback failed")


#: What a Slot gets for a reply without headers or payload (a confirmed ack): one shared
#: message, not one built per reply.
BARE_REPLY = Msg(None)  # type: ignore[arg-type]


class Waiter(Protocol):
    """What waits for a reply: a future, or a Slot of a batch."""

    def done(self) -> bool: ...
    def set_result(self, msg: Msg, /) -> None: ...
    def set_exception(self, error: BaseException, /) -> None: ...
    def cancel(self) -> bool: ...


class ConnectionLost(BrokerError):
    """The connection closed. ``sent`` says whether the request may have reached the server."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class RequestTimeout(BrokerError):
    """No reply within the timeout: the request may or may not have been applied."""


#: How nats-server words a refused CONNECT: bad or missing user, password, token or nkey.
_REFUSED_CONNECT = ("authorization violation", "authentication")


def refusal(url: str, error: BaseException) -> BrokerRefused | None:
    """The refusal that ``error``, raised by ``nats.connect(url)``, is, or None.

    nats-py raises a plain ``nats.errors.Error`` carrying the server's ``-ERR`` text.
    """
    if isinstance(error, nats.errors.Error) and any(
        words in str(error).lower() for words in _REFUSED_CONNECT
    ):
        return BrokerRefused(f"NATS at {redact(url)} refused the connection ({error}): wrong "
                             "or missing user, password or token")
    return None


async def quiet_error(error: Exception) -> None:
    """nats-py's default error callback prints a traceback; the caller reports instead."""
    log.debug("nats client error: %r", error)


class Connection:
    """A connected nats-py client (``allow_reconnect=False``) and its reply inbox."""

    def __init__(
        self, client: Client, on_pulled: Callable[[Msg], None],
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        uri = client.connected_url  # None once closed: kept to name it then
        self.server = f"{uri.hostname}:{uri.port}" if uri is not None else "the server"
        self._on_pulled = on_pulled
        self._on_read = on_read  # after each read of the socket (see _read_done)
        self._prefix = client.new_inbox() + "."
        self._prefix_bytes = self._prefix.encode()
        self._tokens = itertools.count(1)
        self._waiting: dict[bytes, Waiter] = {}
        self._loop = asyncio.get_running_loop()
        self._deadlines = _Deadlines(self._loop, self._waiting)
        self._closed = self._loop.create_future()
        #: Slots whose bare reply the parser's current pass routed (see ``_routed``).
        self._confirmed: list[Slot] = []

    @classmethod
    async def open(
        cls, url: str, on_pulled: Callable[[Msg], None],
        on_read: Callable[[], None] | None = None, **options: Any,
    ) -> Connection:
        """Connect and subscribe the inbox; raises ``BrokerRefused`` when the server refuses
        the credentials, otherwise whatever nats-py raises. ``on_pulled(msg)`` for each
        pulled message, ``on_read()`` after each read of the socket was handed on."""
        holder: list[Connection] = []

        async def closed_cb() -> None:
            if holder:
                holder[0]._finish("connection closed")

        try:
            client = await nats_tls.connect(
                url, allow_reconnect=False, closed_cb=closed_cb, error_cb=quiet_error, **options
            )
        except Exception as error:
            refused = refusal(url, error)
            if refused is not None:
                raise refused from error  # final: the link does not retry a BrokerError
            raise
        conn = cls(client, on_pulled, on_read)
        holder.append(conn)
        try:
            # No pending limits: the callback only routes, and a limit would drop deliveries.
            inbox = await client.subscribe(
                conn._prefix + "*", cb=conn._dispatch, pending_msgs_limit=0,
                pending_bytes_limit=0,
            )
        except BaseException:
            await conn.close()
            raise
        conn._hook(inbox._id)
        return conn

    def _hook(self, sid: int) -> None:
        """Take the inbox's messages straight from the parser (see the module docstring).
        Every other subscription (the advisory) keeps nats-py's own path. The socket's
        bytes go through ``broker.nats.parse`` first (MSG/HMSG without regular expressions)."""
        original = self.client._process_msg
        route, routed = self._route, self._routed

        async def process_msg(
            sid_: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
        ) -> None:  # headers: None when the message has none (nats-py's hint says bytes)
            if sid_ == sid:  # nats-py's own parser read it (see parse.install): told at once
                try:
                    route(subject, reply, data, headers)
                finally:
                    routed()
            else:
                await original(sid_, subject, reply, data, headers)

        self.client._process_msg = process_msg  # type: ignore[method-assign,assignment]
        parse.install(self.client, sid, route, self._read_done if self._on_read else None,
                      self._routed)

    def _routed(self) -> None:
        """The end of a parser pass over the inbox's messages (in the turn it read them):
        the bare replies it took go to their batches' ``many`` callbacks, one call for
        each run of one batch's replies (usually the whole read's). Never raises into the
        parser (which would stop reading)."""
        confirmed = self._confirmed
        if not confirmed:
            return
        self._confirmed = []
        for many, slots in itertools.groupby(confirmed, key=_many_of):
            try:
                many([slot._index for slot in slots])
            except Exception:
                log.exception("reply callback failed")

    def _read_done(self) -> None:
        """What the read brought was handed on: tell ``on_read`` (in the read's turn). What
        it raises is logged, never let into nats-py's read loop (which would stop reading)."""
        try:
            self._on_read()  # type: ignore[misc]
        except Exception:
            log.exception("read callback failed")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the connection runs on (asyncio.get_running_loop() asks getpid())."""
        return self._loop

    @property
    def server_info(self) -> dict[str, Any]:
        """The server's INFO as it greeted this connection (version, server_id...)."""
        return dict(self.client._server_info)

    @property
    def closed(self) -> bool:
        # nats-py marks itself closed before it runs closed_cb: trust either signal.
        return self._closed.done() or self.client.is_closed

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def expect_reply(self, timeout: float, what: str) -> tuple[str, asyncio.Future[Msg]]:
        """A fresh reply subject and the future its first message resolves.

        The future fails with RequestTimeout after ``timeout`` and with ConnectionLost when
        the connection closes; cancelling it forgets the subject (a reply to it is ignored).
        """
        return self._expect(timeout, what)[1:]

    def _expect(self, timeout: float, what: str) -> tuple[bytes, str, asyncio.Future[Msg]]:
        if self.closed:
            raise ConnectionLost("not sent: the connection is closed", sent=False)
        number = next(self._tokens)
        token = b"%d" % number
        future: asyncio.Future[Msg] = self._loop.create_future()
        self._waiting[token] = future
        self._deadlines.add(timeout, token, future, what)
        return token, f"{self._prefix}{number}", future

    async def request_batch(
        self, requests: Sequence[tuple[str, bytes]], *, timeout: float,
        on_reply: Callable[[int, Msg | BaseException], None], tail: bytes = b"",
        on_bare: Callable[[list[int]], None] | None = None,
    ) -> list[Slot]:
        """Publish every ``(subject, payload)`` with its own reply subject, all in one
        write. ``on_reply(i, reply or error)`` is called once for each request, in the turn
        its reply is read (``BARE_REPLY`` for one without headers and payload), or its
        timeout or the connection's end (as ``request`` fails), unless its slot was
        cancelled first. Raises ConnectionLost(sent=False) when nothing
        was sent (the connection had closed; a slot it closed on meanwhile was already
        told ConnectionLost(sent=True): the conservative answer).

        The subjects must be ones the server gave us (ack subjects): they are not checked
        as nats-py checks what it publishes. ``tail``: protocol bytes written right after
        the requests, in the same write (a pull request made with ``pull_line``).
        ``on_bare(indices)``, when given, takes the bare replies instead of ``on_reply``
        (``BARE_REPLY`` each): those that one pass of the parser read, in one call, in the
        same turn (never later than ``on_reply`` would have been called)."""
        if self.closed:
            raise ConnectionLost("not sent: the connection is closed", sent=False)
        slots: list[Slot] = []
        parts: list[bytes] = []
        prefix = self._prefix_bytes
        waiting, tokens = self._waiting, self._tokens
        deadline, fifo = self._deadlines.queue(timeout)  # once per batch, not per request
        for index, (subject, payload) in enumerate(requests):
            token = b"%d" % next(tokens)
            slot = Slot(index, on_reply, on_bare)
            waiting[token] = slot
            fifo.append((deadline, token, slot, subject))
            slots.append(slot)
            parts.append(b"PUB %s %s%s %d\r\n%s\r\n" % (
                subject.encode(), prefix, token, len(payload), payload))
        parts.append(tail)
        try:
            await self._write(b"".join(parts))
        except BaseException:  # the caller never gets the slots: none may answer later
            for slot in slots:
                slot.cancel()
            raise
        return slots

    async def _write(self, command: bytes) -> None:
        """Protocol bytes to the socket: at once when nothing of nats-py's waits to be
        written (no hop through its flusher task), else after what waits, in order."""
        client = self.client
        if client.is_closed or not client.is_connected or client._transport is None:
            raise ConnectionLost("not sent: the connection is closed", sent=False)
        if client._pending_data_size == 0:
            try:
                client._transport.write(command)
            except (nats.errors.ConnectionClosedError, OSError) as error:
                raise ConnectionLost(f"not sent: {error!r}", sent=False) from error
            except RuntimeError as error:  # uvloop refuses a write before nats-py saw EOF
                if not closed_transport(error):
                    raise
                raise ConnectionLost(f"not sent: {error!r}", sent=False) from error
            # Backpressure as nats-py's flusher has it (a wait only past the high-water
            # mark). The bytes may be on their way: a failure here is the connection's end,
            # which fails the waiting requests as sent (uncertain), not as unsent.
            with contextlib.suppress(OSError):
                await client._transport.drain()  # type: ignore[no-untyped-call]
            return
        try:
            await client._send_command(command)
            await client._flush_pending()
        except (nats.errors.ConnectionClosedError, OSError) as error:
            raise ConnectionLost(f"not sent: {error!r}", sent=False) from error

    def pull_line(
        self, subject: str, payload: bytes, timeout: float, what: str
    ) -> tuple[bytes, asyncio.Future[Msg]]:
        """A request to be written by someone else's write (``request_batch``'s tail): its
        protocol line and the future its reply resolves, as ``expect_reply`` has it."""
        _, reply, future = self._expect(timeout, what)
        return b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply.encode(), len(payload),
                                             payload), future

    async def request(
        self, subject: str, payload: bytes = b"", *, timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        """Publish with a reply inbox and wait for the reply (or the timeout, or a close)."""
        token, reply, future = self._expect(timeout, subject)
        try:
            await self.publish(subject, payload, reply=reply, headers=headers)
            return await future
        finally:
            if not future.done():
                future.cancel()  # e.g. the caller was cancelled
            if self._waiting.get(token) is future:
                del self._waiting[token]

    async def publish(
        self, subject: str, payload: bytes = b"", *, reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Hand bytes to the client; raises ConnectionLost(sent=False) if it refuses them."""
        if headers is None and reply:  # a request of ours: written at once (see _write)
            _check_subject(subject)
            if len(payload) > self.client.max_payload:  # the server would close on it
                raise nats.errors.MaxPayloadError  # as nats-py raises it: never sent
            await self._write(b"PUB %s %s %d\r\n%s\r\n" % (
                subject.encode(), reply.encode(), len(payload), payload))
            return
        try:
            await self.client.publish(subject, payload, reply=reply, headers=headers)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError,
                OSError) as error:
            raise ConnectionLost(f"not sent: {error!r}", sent=False) from error

    async def subscribe(self, subject: str, cb: Callable[[Msg], None], *, queue: str) -> None:
        """A queue-group subscription whose messages go to ``cb`` (ends with the connection)."""

        async def deliver(msg: Msg) -> None:
            cb(msg)

        try:
            await self.client.subscribe(subject, queue=queue, cb=deliver)
        except (nats.errors.ConnectionClosedError, OSError) as error:
            raise ConnectionLost(f"not subscribed: {error!r}", sent=False) from error

    async def check(self, timeout: float) -> bool:
        """PING/PONG round trip; a connection that fails it is closed (so requests end)."""
        if self.closed:
            return False
        try:
            await self.client.flush(math.ceil(timeout))  # nats-py takes whole seconds
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
        self._deadlines.clear()
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(ConnectionLost(f"reply lost: {reason}", sent=True))
        self._waiting.clear()

    def _route(self, subject: bytes, reply: bytes, data: bytes, raw: bytes | None) -> None:
        """One message of the inbox, as the parser read it: a reply resolves its request's
        waiter (one that is gone, cancelled or timed out, is ignored); anything else is a
        pulled message."""
        headers = _headers(raw) if raw else None
        if subject.startswith(self._prefix_bytes):
            waiter = self._waiting.pop(subject[len(self._prefix_bytes):], None)
            if waiter is None or waiter.done():
                return
            if not raw and not data and type(waiter) is Slot:  # an ack's confirmation
                if waiter._many is None:
                    waiter.set_result(BARE_REPLY)
                else:  # done now (no timeout, no cancel), told at the pass's end: _routed
                    waiter._done = True
                    self._confirmed.append(waiter)
                return
            waiter.set_result(Msg(self.client, subject.decode(), reply.decode(), data,
                                  headers))
        else:
            self._on_pulled(Msg(self.client, subject.decode(), reply.decode(), data, headers))

    async def _dispatch(self, msg: Msg) -> None:
        """nats-py's callback for the inbox: only what arrived before the hook was
        installed takes this path (nothing: no request is made before)."""
        if msg.subject.startswith(self._prefix):
            waiter = self._waiting.pop(msg.subject[len(self._prefix):].encode(), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        else:
            self._on_pulled(msg)


def _many_of(slot: Slot) -> Callable[[list[int]], None]:
    return slot._many  # type: ignore[return-value]  # (only slots that have one are kept)


def _check_subject(subject: str) -> None:
    """What nats-py refuses to publish to: an empty subject, or one that would break the
    protocol line."""
    if not subject or len(subject.split()) != 1 or subject != subject.strip():
        raise nats.errors.BadSubjectError


#: The version line a header block starts with; a status (``NATS/1.0 503``) may follow it.
_VERSION = b"NATS/1.0"


def _headers(raw: bytes) -> dict[str, str] | None:
    """A header block as nats-py reads it: the inline status as ``Status`` (when numeric)
    and ``Description``, then ``Name: value`` lines (a name with whitespace or non-ASCII
    bytes is skipped)."""
    lines = raw.split(b"\r\n")
    first = lines[0]
    headers: dict[str, str] = {}
    if first != _VERSION:  # a status after the version (or not a header block at all)
        if not first.startswith(_VERSION):
            return None
        status, _, description = first[len(_VERSION):].strip().partition(b" ")
        if status.isdigit():
            headers["Status"] = status.decode()
        if description.strip():
            headers["Description"] = description.strip().decode("utf-8", "replace")
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        key = name.strip()
        if not key.isascii() or len(key.split()) != 1:
            continue
        headers[key.decode()] = value.strip().decode("utf-8", "replace")
    return headers or None


#: One waiting request: its deadline (loop time), reply token, future and what it was.
_Entry = tuple[float, bytes, "Waiter", str]


class _Deadlines:
    """Every waiting request's deadline, enforced by one timer instead of one per request.

    Requests with the same timeout expire in the order they were made, so each timeout
    value keeps a FIFO of ``(deadline, token, future, what)`` and only the heads matter:
    one loop timer is armed for the earliest live head. A finished request (replied,
    cancelled, failed) is dropped when it reaches the head of its FIFO, which new requests
    also do: an ack costs one append and, usually, one popleft, no timer of its own.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, waiting: dict[bytes, Waiter]
    ) -> None:
        self._loop = loop
        self._waiting = waiting  # token -> future, shared with the Connection
        self._fifos: dict[float, collections.deque[_Entry]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add(self, timeout: float, token: bytes, future: Waiter, what: str) -> None:
        deadline, fifo = self.queue(timeout)
        fifo.append((deadline, token, future, what))

    def queue(self, timeout: float) -> tuple[float, collections.deque[_Entry]]:
        """The deadline of a request made now with ``timeout``, and the FIFO its entry
        goes to (the caller appends it, in this turn): requests of one batch share both,
        and the timer armed for them."""
        deadline = self._loop.time() + timeout
        fifo = self._fifos.get(timeout)
        if fifo is None:
            fifo = self._fifos[timeout] = collections.deque()
        else:
            self._drop_finished(fifo)
        if deadline < self._timer_at:
            self._arm(deadline)
        return deadline, fifo

    def clear(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf
        self._fifos.clear()

    def _drop_finished(self, fifo: collections.deque[_Entry]) -> None:
        waiting = self._waiting
        while fifo and fifo[0][2].done():
            _, token, future, _ = fifo.popleft()
            if waiting.get(token) is future:
                del waiting[token]

    def _sweep(self) -> None:
        """The timer: fail every request past its deadline, re-arm for the next one."""
        self._timer, self._timer_at = None, math.inf
        now = self._loop.time()
        earliest = math.inf
        for timeout, fifo in list(self._fifos.items()):
            self._drop_finished(fifo)
            while fifo and fifo[0][0] <= now:
                _, token, future, what = fifo.popleft()
                if self._waiting.get(token) is future:
                    del self._waiting[token]
                if not future.done():
                    future.set_exception(RequestTimeout(f"no reply to {what} in {timeout}s"))
                self._drop_finished(fifo)
            if fifo:
                earliest = min(earliest, fifo[0][0])
            else:
                del self._fifos[timeout]
        if earliest < math.inf:
            self._arm(earliest)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(when, self._sweep), when
