"""The fast read path (``broker.nats.parse``) reads the server's protocol as nats-py's own
parser does, however the bytes are cut into reads: the inbox's messages go to the route,
every other message and protocol line to the client as before."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from broker.nats import parse

INBOX = 7



def msg(subject: str, sid: int, payload: bytes, reply: str = "", headers: bytes = b"") -> bytes:
    """One message as the server writes it (MSG, or HMSG with a header block)."""
    args = f"{subject} {sid} {reply} ".replace("  ", " ").encode()
    if headers:
        return b"HMSG %s%d %d\r\n%s%s\r\n" % (args, len(headers), len(headers) + len(payload),
                                               headers, payload)
    return b"MSG %s%d\r\n%s\r\n" % (args, len(payload), payload)


#: A server's stream: the inbox's replies and pulled messages (with and without headers,
#: reply subjects, empty payloads, CRLF inside payloads), another subscription's message,
#: and the protocol lines nats-py's parser keeps handling (PING, PONG, +OK, INFO, -ERR).
STREAM = b"".join([
    msg("_INBOX.x.1", INBOX, b""),
    msg("work.jobs", INBOX, b'{"a"}', "$JS.ACK.s.c.1.5.5.1.0",
        b"NATS/1.0\r\nContent-Type: a/json\r\n\r\n"),
    b"PING\r\n",
    msg("advisory.x", 3, b"hello\r\nthere"),
    msg("_INBOX.x.2", INBOX, b"", headers=b"NATS/1.0 404\r\n\r\n"),
    b"+OK\r\n",
    msg("work.jobs", INBOX, b"abc", "$JS.ACK.s.c.1.6.6.1.0"),
    b"MSG  work.jobs\t7   reply.y 2\r\nhi\r\n",  # odd whitespace, as nats-py allows
    b"PONG\r\n",
    msg("_INBOX.x.3", INBOX, b"last"),
    b'INFO {"server_id":"x"}\r\n',
    b"-ERR 'Stale Connection'\r\n",
    msg("_INBOX.x.4", INBOX, b"after"),
])


class Recorder:
    """Stands in for nats-py's client beside its parser: records what reaches it."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []
        self.stats = {"in_msgs": 0, "in_bytes": 0}
        self._ps = Parser(self)

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        self.seen.append(("msg", sid, bytes(subject), bytes(reply), data, headers))

    async def _process_ping(self) -> None:
        self.seen.append(("ping",))

    async def _process_pong(self) -> None:
        self.seen.append(("pong",))

    async def _process_info(self, info) -> None:
        self.seen.append(("info", info))

    async def _process_err(self, err) -> None:
        self.seen.append(("err", err))


async def feed(recorder: Recorder, chunks: list[bytes]) -> None:
    for chunk in chunks:
        await recorder._ps.parse(chunk)


def cuts(data: bytes, rng: random.Random, most: int) -> list[bytes]:
    chunks, at = [], 0
    while at < len(data):
        step = rng.randint(1, most)
        chunks.append(data[at:at + step])
        at += step
    return chunks


async def expected() -> list[tuple[Any, ...]]:
    """What nats-py's own parser hands on for STREAM (its _process_msg routes the inbox's
    messages too: the route is then the same call)."""
    plain = Recorder()
    await feed(plain, [STREAM])
    return plain.seen


def fast(recorder: Recorder) -> list[tuple[Any, ...]]:
    routed = recorder.seen  # the inbox's messages, in order with everything else

    def route(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        routed.append(("msg", INBOX, subject, reply, data, headers))

    parse.install(recorder, INBOX, route)  # type: ignore[arg-type]
    return routed


async def test_the_stream_in_one_read_is_read_as_nats_py_reads_it():
    want = await expected()
    # The stream is what it says.
    assert len(want) == 12 and want[1][4] == b'{"a"}' and want[3][4] == b"hello\r\nthere"
    recorder = Recorder()
    fast(recorder)
    await feed(recorder, [STREAM])
    assert recorder.seen == want
    assert recorder._ps.buf == bytearray()
    # The inbox's messages are counted as nats-py counts what it reads (up to the INFO:
    # nats-py's parser reads on from there, and its client counts).
    assert recorder.stats == {"in_msgs": 6, "in_bytes": 0 + 5 + 0 + 3 + 2 + 4}


@pytest.mark.parametrize("most", [1, 2, 3, 7, 40])
async def test_any_cut_into_reads_gives_the_same(most: int):
    want = await expected()
    rng = random.Random(most)
    for _ in range(30):
        recorder = Recorder()
        fast(recorder)
        await feed(recorder, cuts(STREAM, rng, most))
        assert recorder.seen == want


async def test_a_message_not_all_there_waits_for_the_rest():
    recorder = Recorder()
    fast(recorder)
    await feed(recorder, [b"MSG _INBOX.x.1 7 10\r\n01234"])
    assert recorder.seen == []
    await feed(recorder, [b"56789\r\nPI"])
    assert recorder.seen == [("msg", INBOX, b"_INBOX.x.1", b"", b"0123456789", None)]
    await feed(recorder, [b"NG\r\n"])
    assert recorder.seen[-1] == ("ping",)


async def test_a_malformed_message_line_is_a_protocol_error():
    recorder = Recorder()
    fast(recorder)
    with pytest.raises(ProtocolError):
        await feed(recorder, [b"MSG subject 7 notanumber\r\n"])


class Hooked(Recorder):
    """As ``Connection._hook`` has it: an inbox message nats-py's own parser reads is told
    routed at once."""

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        await super()._process_msg(sid, subject, reply, data, headers)
        if sid == INBOX:
            self.seen.append(("routed",))


@pytest.mark.parametrize("most", [1, 3, 40, len(STREAM)])
async def test_routed_is_told_after_each_run_of_inbox_messages_before_anything_else(most):
    """``routed()`` ends every run of inbox messages, before whatever follows them is
    handed on (Connection._routed tells their batches then), and never comes without one."""
    want = await expected()
    rng = random.Random(most)
    for _ in range(10):
        recorder = Hooked()
        seen = recorder.seen
        parse.install(recorder, INBOX,  # type: ignore[arg-type]
                      lambda *message, seen=seen: seen.append(("msg", INBOX, *message)),
                      routed=lambda seen=seen: seen.append(("routed",)))
        await feed(recorder, cuts(STREAM, rng, most))
        assert [m for m in seen if m != ("routed",)] == want
        for at, item in enumerate(seen):
            inbox = item[0] == "msg" and item[1] == INBOX
            if item == ("routed",):
                assert at > 0 and seen[at - 1][1] == INBOX  # ends a run, never alone
            elif inbox:  # the run goes on, or is told routed next
                assert seen[at + 1] == ("routed",) or seen[at + 1][:2] == ("msg", INBOX)


class Streamed(Recorder):
    """A client whose socket is read as nats-py reads it: a stream reader, fed by the
    transport, and a read loop task that parses what each read returns."""

    def __init__(self) -> None:
        super().__init__()
        self._transport = SimpleNamespace(_io_reader=asyncio.StreamReader())

    async def read_loop(self) -> None:
        while chunk := await self._transport._io_reader.read(65536):
            await self._ps.parse(chunk)


def streamed() -> tuple[Streamed, list[tuple[Any, ...]], list[int]]:
    """A Streamed client on the fast path: what it saw, and len(seen) at each ``after``."""
    client = Streamed()
    seen = fast(client)
    reads: list[int] = []
    parse.install(client, INBOX, lambda *message: seen.append(("msg", INBOX, *message)),
                  after=lambda: reads.append(len(seen)))
    return client, seen, reads


async def test_inbox_messages_are_read_in_the_turn_their_bytes_arrive():
    """Bytes fed while the read loop waits with nothing of its own: the inbox's complete
    messages at their front are routed at once, by the feed itself (no turn of the read
    loop's task), and told done; the rest goes to the read loop, in order."""
    client, seen, reads = streamed()
    reader = client._transport._io_reader
    loop = asyncio.get_running_loop().create_task(client.read_loop())
    await asyncio.sleep(0)  # the read loop waits for bytes
    reader.feed_data(STREAM)
    assert [m[2] for m in seen] == [b"_INBOX.x.1", b"work.jobs"] and reads == [2]
    reader.feed_eof()
    await loop
    assert seen == await expected()


@pytest.mark.parametrize("most", [1, 7, 40, len(STREAM)])
async def test_reads_at_once_or_by_the_read_loop_keep_nats_pys_order(most: int):
    want = await expected()
    rng = random.Random(most)
    for _ in range(10):
        client, seen, _ = streamed()
        reader = client._transport._io_reader
        loop = asyncio.get_running_loop().create_task(client.read_loop())
        for chunk in cuts(STREAM, rng, most):
            await asyncio.sleep(0)  # the read loop parses what it has, then waits again
            reader.feed_data(chunk)
        reader.feed_eof()
        await loop
        assert seen == want


async def test_bytes_the_read_loop_has_not_parsed_yet_keep_their_place():
    """A message fed while the read loop still holds bytes (its task not run yet) waits
    behind them, even an inbox message that is complete."""
    client, routed, _ = streamed()
    reader = client._transport._io_reader
    loop = asyncio.get_running_loop().create_task(client.read_loop())
    await asyncio.sleep(0)
    reader.feed_data(msg("advisory.x", 3, b"first"))  # another subscription: the loop's
    reader.feed_data(msg("_INBOX.x.1", INBOX, b"second"))  # must not overtake it
    assert routed == []
    reader.feed_eof()
    await loop
    assert [seen[4] for seen in routed] == [b"first", b"second"]
