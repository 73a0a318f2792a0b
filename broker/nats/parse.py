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

from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, MAX_CONTROL_LINE_SIZE

Route = Callable[[bytes, bytes, bytes, "bytes | None"], None]


def install(
    client: Client, sid: int, route: Route, after: Callable[[], None] | None = None
) -> None:
    """Read ``client``'s socket with ``parse_messages`` first (see the module docstring).
    ``after()`` is called once each read's messages were all handed on (not if it failed)."""
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
            taken = await parse_messages(buf, sid, route, client._process_msg, stats)
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


async def parse_messages(
    buf: bytearray, sid: int, route: Route,
    # nats-py's Client._process_msg(sid, subject, reply, data, headers): its annotation says
    # bytes headers, its own parser passes None for a MSG without headers, as we do.
    process: Callable[..., Awaitable[None]],
    stats: dict[str, int],
) -> int:
    """Hand on every complete MSG/HMSG at the front of ``buf``; returns how many bytes they
    took (the caller trims them). Stops at anything else, or at a message not all there."""
    pos, size = 0, len(buf)
    view = memoryview(buf)
    try:
        while True:
            if buf.startswith(b"MSG ", pos):
                headed = False
            elif buf.startswith(b"HMSG ", pos):
                headed = True
            else:
                return pos
            end = buf.find(b"\r\n", pos, pos + MAX_CONTROL_LINE_SIZE)
            if end < 0:
                if size - pos >= MAX_CONTROL_LINE_SIZE:
                    raise ProtocolError("nats: malformed MSG")
                return pos
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
                raise ProtocolError("nats: malformed MSG") from None
            start = end + 2
            stop = start + total
            if stop + 2 > size:
                return pos  # the payload is not all here yet
            headers = bytes(view[start:start + head]) if head else None
            payload = bytes(view[start + head:stop])
            pos = stop + 2
            if their_sid == sid:
                stats["in_msgs"] += 1
                stats["in_bytes"] += len(payload)
                route(subject, reply, payload, headers)
            else:  # nats-py's own path (it counts the stats)
                await process(their_sid, subject, reply, payload, headers)
    finally:
        view.release()
