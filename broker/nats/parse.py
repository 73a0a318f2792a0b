"""A faster read path for nats-py's parser: MSG and HMSG lines split by hand, not matched
by regular expression, and the messages of the reply inbox routed without a coroutine.

nats-py's ``Parser.parse`` tries a regular expression per message and deletes each one
from the front of its buffer (a copy of what follows, per message), then awaits
``_process_msg`` for it. At thousands of messages a second (every job is two: its
delivery and its ack's confirmation) that was the largest part of reading. Here every
complete MSG/HMSG at the front of the buffer is taken in one pass and the buffer trimmed
once; the inbox's go straight to ``route``, any other subscription's to nats-py's
``_process_msg`` as before; PING, PONG and +OK as nats-py's parser handles them. Whatever
else comes (INFO, -ERR, what is not understood), and a buffer nats-py's parser is in the
middle of, is left to nats-py's parser, unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, MAX_CONTROL_LINE_SIZE

Route = Callable[[bytes, bytes, bytes, "bytes | None"], None]


def install(
    client: Client, sid: int, route: Route, after: Callable[[], None] | None = None,
    routed: Callable[[], None] | None = None,
) -> None:
    """Read ``client``'s socket with ``parse_messages`` first (see the module docstring).
    ``after()`` is called once each read's messages were all handed on (not if it failed);
    ``routed()`` at the end of every run of ``route`` calls (see ``scan``)."""
    parser = client._ps
    original: Callable[[bytes], Awaitable[None]] = parser.parse
    stats = client.stats

    async def parse(data: bytes = b"") -> None:
        await parse_all(data)
        if after is not None:
            after()

    async def parse_all(data: bytes) -> None:
        buf = parser.buf  # reset() replaces it: read it every time
        buf.extend(data)
        while parser.state == AWAITING_CONTROL_LINE:
            taken = await parse_messages(buf, sid, route, client._process_msg, stats, routed)
            if taken:
                del buf[:taken]
            if not buf or buf.startswith((b"MSG ", b"HMSG ")):
                return  # all read, or a message not complete yet: wait for the rest
            # The server's keep-alives, as nats-py handles them; then messages again.
            if buf.startswith(b"PING\r\n"):
                del buf[:6]
                await client._process_ping()
            elif buf.startswith(b"PONG\r\n"):
                del buf[:6]
                await client._process_pong()
            elif buf.startswith(b"+OK\r\n"):
                del buf[:5]
            else:
                break
        await original(b"")

    parser.parse = parse  # type: ignore[method-assign]
    _read_at_once(client, sid, route, after, routed)


def _read_at_once(
    client: Client, sid: int, route: Route, after: Callable[[], None] | None,
    routed: Callable[[], None] | None,
) -> None:
    """The inbox's messages read in the turn their bytes arrive: nats-py's read loop is a
    task that the stream reader wakes for each read, a turn of the event loop later (at
    prefetch 1, one per job). When that loop waits for bytes with nothing of its own left
    to parse, a read's complete inbox messages at its front are routed here, straight from
    the stream reader's ``feed_data``; what follows them (anything else, or a message not
    all there) is fed to the reader as before, in order, for the read loop to parse."""
    reader = getattr(getattr(client, "_transport", None), "_io_reader", None)
    if not isinstance(reader, asyncio.StreamReader):
        return  # another transport (websocket): the read loop's path only
    parser = client._ps
    feed = reader.feed_data
    stats = client.stats

    def feed_data(data: bytes) -> None:
        if (reader._waiter is None or reader._buffer or parser.buf  # type: ignore[attr-defined]
                or parser.state != AWAITING_CONTROL_LINE):
            feed(data)  # the read loop is busy, or has bytes of its own: after them
            return
        taken, _ = scan(data, 0, sid, route, stats, routed)
        if taken and after is not None:
            after()
        if taken < len(data):
            feed(data[taken:] if taken else data)

    reader.feed_data = feed_data  # type: ignore[method-assign,assignment]


async def parse_messages(
    buf: bytearray, sid: int, route: Route,
    # nats-py's Client._process_msg(sid, subject, reply, data, headers): its annotation says
    # bytes headers, its own parser passes None for a MSG without headers, as we do.
    process: Callable[..., Awaitable[None]],
    stats: dict[str, int],
    routed: Callable[[], None] | None = None,
) -> int:
    """Hand on every complete MSG/HMSG at the front of ``buf``; returns how many bytes they
    took (the caller trims them). Stops at anything else, or at a message not all there."""
    pos = 0
    while True:
        pos, other = scan(buf, pos, sid, route, stats, routed)
        if other is None:
            return pos
        if other is MALFORMED:
            raise ProtocolError("nats: malformed MSG")
        their_sid, subject, reply, payload, headers, pos = other
        await process(their_sid, subject, reply, payload, headers)  # nats-py counts these


#: What ``scan`` returns for a MSG/HMSG line it cannot read (the connection's end).
MALFORMED = (0, b"", b"", b"", None, 0)
Other = tuple[int, bytes, bytes, bytes, "bytes | None", int]


def scan(
    buf: bytes | bytearray, pos: int, sid: int, route: Route, stats: dict[str, int],
    routed: Callable[[], None] | None = None,
) -> tuple[int, Other | None]:
    """Route every complete MSG/HMSG of subscription ``sid`` from ``pos`` on; stop at
    anything else. Returns where it stopped and, when that is a complete message of
    another subscription, its fields and where it ends (``MALFORMED`` for a line that
    cannot be read): the caller hands it on, or leaves it (and what follows) unread.
    ``routed()`` is called before it returns (or raises) when it routed any: in the same
    turn, before anything after those messages is handed on (``Connection._routed``)."""
    size = len(buf)
    # Slices of bytes are bytes already: only a bytearray (the read loop's buffer) needs
    # a view to copy out of (its slices would be bytearrays, which cannot be dict keys).
    view = buf if type(buf) is bytes else memoryview(buf)
    count = routed_bytes = 0  # counted into nats-py's stats once, at the end
    try:
        while True:
            if buf.startswith(b"MSG ", pos):
                headed = False
            elif buf.startswith(b"HMSG ", pos):
                headed = True
            else:
                return pos, None
            end = buf.find(b"\r\n", pos, pos + MAX_CONTROL_LINE_SIZE)
            if end < 0:
                if size - pos >= MAX_CONTROL_LINE_SIZE:
                    return pos, MALFORMED
                return pos, None
            args = bytes(view[pos:end]).split()
            try:
                if headed:  # HMSG <subject> <sid> [reply] <header bytes> <total bytes>
                    head, total = int(args[-2]), int(args[-1])
                    reply = args[3] if len(args) == 6 else b""
                else:  # MSG <subject> <sid> [reply] <bytes>
                    head, total = 0, int(args[-1])
                    reply = args[3] if len(args) == 5 else b""
                their_sid = int(args[2])
                subject = args[1]
            except (IndexError, ValueError):
                return pos, MALFORMED
            start = end + 2
            stop = start + total
            if stop + 2 > size:
                return pos, None  # the payload is not all here yet
            headers = bytes(view[start:start + head]) if head else None
            payload = bytes(view[start + head:stop])
            if their_sid != sid:
                return pos, (their_sid, subject, reply, payload, headers, stop + 2)
            pos = stop + 2
            count += 1
            routed_bytes += len(payload)
            route(subject, reply, payload, headers)
    finally:
        if count:
            stats["in_msgs"] += count
            stats["in_bytes"] += routed_bytes
        if type(view) is memoryview:
            view.release()
        if count and routed is not None:
            routed()
