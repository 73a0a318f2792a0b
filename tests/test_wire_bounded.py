"""The blocking connection's reply parser (``broker.redis.wire._BoundedReplies``): every reply
kind its commands get, split at every byte, and a bulk string over the limit answered by its
length alone, the connection then dropped."""

from __future__ import annotations

import pytest
import redis.exceptions

from broker.redis.wire import Oversized, _BoundedReplies

REPLIES = [
    (b":42\r\n", 42),
    (b"$3\r\nabc\r\n", b"abc"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"+OK\r\n", b"OK"),
    (b"$6\r\na\r\nb\r\n\r\n", b"a\r\nb\r\n"),
]


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


def connected(limit: int) -> tuple[_BoundedReplies, Transport]:
    replies, transport = _BoundedReplies(60.0, limit), Transport()
    replies.connection_made(transport)  # type: ignore[arg-type]
    return replies, transport


@pytest.mark.parametrize("chunk", [1, 2, 3, 1000])
async def test_every_reply_kind_in_chunks(chunk):
    replies, transport = connected(16)
    futures = [replies.send(b"x") for _ in REPLIES]
    error = replies.send(b"x")
    data = b"".join(raw for raw, _ in REPLIES) + b"-ERR wrong\r\n"
    for start in range(0, len(data), chunk):
        replies.data_received(data[start:start + chunk])
    assert [f.result() for f in futures] == [value for _, value in REPLIES]
    assert isinstance(error.result(), redis.exceptions.ResponseError)
    assert str(error.result()) == "ERR wrong"
    assert not transport.aborted


@pytest.mark.parametrize("chunk", [1, 5, 1000])
async def test_an_oversized_bulk_is_answered_by_its_length_and_drops_the_connection(chunk):
    replies, transport = connected(16)
    identified, moved = replies.send(b"x"), replies.send(b"x")
    data = b":7\r\n$17\r\n" + b"y" * 17 + b"\r\n"
    for start in range(0, len(data), chunk):
        replies.data_received(data[start:start + chunk])
    assert identified.result() == 7
    assert moved.result() == Oversized(17)
    assert transport.aborted and replies.closed
