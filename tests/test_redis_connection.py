"""The broker's redis-py connections (broker.redis.connection), plain and in a Cluster, and
the lean connection, when uvloop refuses a write to a transport that is already closed.

uvloop raises ``RuntimeError: unable to perform operation on <TCPTransport closed=True ...>;
the handler is closed`` where asyncio's own loop drops the write. A CI run saw it come out of
a settlement on a Cluster whose master had been killed, logged as a failure of the
settlement rather than told as the outage. The transport below stands in for uvloop's in
that one state (its handle closed, ``is_closing()`` not yet true, which Python code cannot
bring about on a real one); the servers are real.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.exceptions
import uvloop

from broker.errors import closed_transport
from broker.redis import seeds
from broker.redis.connection import (
    BrokerConnection,
    BrokerSSLConnection,
    BrokerUnixConnection,
    connection_class,
    use_in_cluster,
)
from broker.redis.wire import Wire
from broker.tls import TlsSettings
from tests.faults import UVLOOP_REFUSAL


class ClosedHandle:
    """A transport whose handle uvloop has closed: every write raises, as uvloop's does."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        raise RuntimeError(UVLOOP_REFUSAL)

    def writelines(self, data: Any) -> None:
        raise RuntimeError(UVLOOP_REFUSAL)

    def __getattr__(self, name: str) -> Any:  # close, abort, get_extra_info: the real one's
        return getattr(self.real, name)


def test_only_uvloops_closed_handle_counts_as_a_closed_transport():
    assert closed_transport(RuntimeError(UVLOOP_REFUSAL))
    assert not closed_transport(RuntimeError("Event loop is closed"))
    assert not closed_transport(OSError(UVLOOP_REFUSAL))


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6379/0", BrokerConnection),
    ("rediss://127.0.0.1:6379/0", BrokerSSLConnection),
    ("unix:///run/redis.sock", BrokerUnixConnection),
])
def test_each_url_gets_the_brokers_twin_of_redis_pys_class(url, expected):
    assert connection_class(url) is expected


@contextlib.asynccontextmanager
async def closed_under_redis_py(url: str) -> AsyncIterator[BrokerConnection]:
    """A connected BrokerConnection whose transport uvloop has just closed."""
    connection = BrokerConnection(**redis.connection.parse_url(url))
    try:
        await connection.connect()
        writer = connection._writer
        writer._transport = ClosedHandle(writer.transport)
        yield connection
    finally:
        await connection.disconnect()


@contextlib.asynccontextmanager
async def closed_under_the_wire(
        url: str, waiting: tuple[Any, ...] | None = None) -> AsyncIterator[Wire]:
    """A connected Wire whose transport uvloop has just closed; ``waiting``: a command sent
    before, still waiting for its reply (its future in ``wire.sent_before``)."""
    wire = Wire(url, TlsSettings(), timeout=5.0, connect_timeout=5.0)
    try:
        assert await wire.call("PING") == b"PONG"
        wire.sent_before = await wire.send(waiting) if waiting else []
        replies = wire._replies
        replies._transport = ClosedHandle(replies._transport)
        yield wire
    finally:
        wire.close()


def test_a_refused_write_is_a_connection_error_and_the_next_command_reconnects(redis_url):
    async def run() -> None:
        async with closed_under_redis_py(redis_url) as connection:
            with pytest.raises(redis.exceptions.ConnectionError, match="handler is closed"):
                await connection.send_command("PING")
            assert not connection.is_connected  # dropped: nothing stays half-open
            await connection.send_command("PING")  # connects again
            assert await connection.read_response() in (b"PONG", "PONG")

    uvloop.run(run())


def test_any_other_runtime_error_of_a_write_is_not_hidden(redis_url):
    async def run() -> None:
        async with closed_under_redis_py(redis_url) as connection:
            connection._writer._transport.writelines = _raise_other
            with pytest.raises(RuntimeError, match="something else"):
                await connection.send_command("PING")

    uvloop.run(run())


def _raise_other(data: Any) -> None:
    raise RuntimeError("something else")


def test_the_lean_connection_fails_the_command_and_connects_again(redis_url):
    async def run() -> None:
        async with closed_under_the_wire(redis_url) as wire:
            with pytest.raises(redis.exceptions.ConnectionError, match="handler is closed"):
                await wire.call("ECHO", "lost")
            [future] = await wire.send(("ECHO", "after"))  # a new connection, in order
            assert await future == b"after"
            assert wire.connects == 2

    uvloop.run(run())


def test_the_lean_connections_batch_fails_whole_and_what_waited_fails_with_it(redis_url):
    async def run() -> None:
        async with closed_under_the_wire(redis_url, waiting=("BLPOP", "nothing", 5)) as wire:
            replies = wire._replies
            [waiting] = wire.sent_before
            with pytest.raises(redis.exceptions.ConnectionError, match="handler is closed"):
                await wire.send(("ECHO", "a"), ("ECHO", "b"))
            assert replies.closed
            with pytest.raises(redis.exceptions.ConnectionError):
                await waiting
            assert await wire.call("ECHO", "c") == b"c"

    uvloop.run(run())


def test_any_other_error_of_the_lean_connections_write_is_raised_and_drops_it(redis_url):
    """Not hidden, and no reply can then land on the wrong command: the connection goes."""
    async def run() -> None:
        async with closed_under_the_wire(redis_url) as wire:
            replies = wire._replies
            replies._transport.write = _raise_other
            with pytest.raises(RuntimeError, match="something else"):
                await wire.call("ECHO", "a")
            assert replies.closed and not replies._waiting
            assert await wire.call("ECHO", "b") == b"b"

    uvloop.run(run())


@pytest.mark.parametrize("seeds_in_url", [1, 3])
def test_a_cluster_client_uses_the_brokers_connections_to_every_node(redis_cluster, seeds_in_url):
    """Those it starts from and those the slot map names; one refused write is retried by
    the Cluster client itself (nothing was written), and the command is answered."""
    url = ",".join(node.url for node in redis_cluster.nodes[:seeds_in_url])

    async def run() -> None:
        client = seeds.cluster_client(url)
        try:
            assert {node.connection_class for node in client.startup_nodes} == {BrokerConnection}
            await client.set("{k}a", "1")
            nodes = client.get_nodes()
            assert len(nodes) == len(redis_cluster.nodes)
            assert {node.connection_class for node in nodes} == {BrokerConnection}
            owner = client.get_node_from_key("{k}a")
            [connection] = owner._free
            assert isinstance(connection, BrokerConnection)
            writer = connection._writer
            writer._transport = ClosedHandle(writer.transport)
            assert await client.get("{k}a") == b"1"
        finally:
            await client.aclose()

    uvloop.run(run())


def test_a_cluster_client_laid_out_otherwise_keeps_its_classes_and_says_so(caplog):
    class Elsewhere:  # a redis-py that keeps its settings under other names
        settings = {"connection_class": redis.asyncio.connection.Connection}

    with caplog.at_level(logging.WARNING, logger="broker.redis.connection"):
        use_in_cluster(Elsewhere())
    assert Elsewhere.settings["connection_class"] is redis.asyncio.connection.Connection
    assert "its own connection classes are used" in caplog.text
