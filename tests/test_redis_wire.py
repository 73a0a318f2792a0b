"""The lean connection of the hot path (broker.redis.wire) and the scripts run over it."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis
import redis.exceptions
import uvloop

from broker.base import WrongTypeError
from broker.redis.scripts import Scripts
from broker.redis.wire import Wire
from broker.tls import TlsSettings
from support.waiting import until


def _wire(url: str) -> Wire:
    return Wire(url, TlsSettings(), timeout=5.0, connect_timeout=5.0)


async def test_pipelined_calls_get_their_own_replies(redis_url):
    wire = _wire(redis_url)
    try:
        replies = await asyncio.gather(*(wire.call("ECHO", f"r{n}") for n in range(200)))
        assert replies == [f"r{n}".encode() for n in range(200)]
        with pytest.raises(redis.exceptions.ResponseError):
            await wire.call("LPUSH", "only-a-key")
        assert await wire.call("PING") == b"PONG"  # an error reply leaves the connection usable
    finally:
        wire.close()


async def test_database_and_password_of_the_url(own_redis_server):
    own_redis_server.cli("CONFIG", "SET", "requirepass", "s3cret")
    wire = _wire(f"redis://:s3cret@127.0.0.1:{own_redis_server.port}/3")
    try:
        await wire.call("SET", "k", "v")
        assert await wire.call("CLIENT", "INFO") is not None
        assert own_redis_server.cli("-a", "s3cret", "-n", "3", "GET", "k").strip() == "v"
    finally:
        wire.close()
    refused = _wire(f"redis://:wrong@127.0.0.1:{own_redis_server.port}/0")
    with pytest.raises(redis.exceptions.ConnectionError, match="AUTH refused"):
        await refused.call("PING")


def _blocked_clients(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return int(client.info("clients")["blocked_clients"])


async def test_a_lost_connection_fails_what_is_in_flight_and_is_replaced(own_redis_server):
    wire = _wire(own_redis_server.url)
    try:
        assert await wire.call("PING") == b"PONG"
        blocked = asyncio.ensure_future(wire.call("BLPOP", "nothing", 10))
        await until(lambda: _blocked_clients(own_redis_server.url), 10,  # in flight
                    "the server to block the BLPOP", every=0.01)
        own_redis_server.restart()
        with pytest.raises(redis.exceptions.ConnectionError):
            await blocked  # never sent again: its effect, if any, is unknown
        assert await wire.call("PING") == b"PONG"
    finally:
        wire.close()


async def test_a_late_reply_times_out_and_drops_the_connection(redis_url):
    wire = Wire(redis_url, TlsSettings(), timeout=0.2, connect_timeout=5.0)
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            await wire.call("BLPOP", "nothing", 2)
        assert await wire.call("PING") == b"PONG"  # a new connection: no stale reply on it
    finally:
        wire.close()


async def test_scripts_reload_after_a_flush_and_translate_errors(redis_url, redis_client):
    wire = _wire(redis_url)
    scripts = Scripts(redis_client, wire)
    try:
        assert await scripts.call("expired", ["{q}.reservations"], [10]) == []
        await redis_client.script_flush()
        assert await scripts.call("expired", ["{q}.reservations"], [10]) == []
        await redis_client.set("{q}.reservations", "not a zset")
        with pytest.raises(WrongTypeError):
            await scripts.call("expired", ["{q}.reservations"], [10])
    finally:
        wire.close()


def test_runs_on_uvloop(redis_url):
    """The supervisor's loop: its transports are not asyncio's classes."""

    async def calls() -> list[bytes]:
        wire = _wire(redis_url)
        try:
            return await asyncio.gather(wire.call("PING"), wire.call("ECHO", "x"))
        finally:
            wire.close()

    assert uvloop.run(calls()) == [b"PONG", b"x"]


def _connected_clients(server) -> int:
    return int(server.cli("-a", "s3cret", "--no-auth-warning", "INFO", "clients")
               .split("connected_clients:")[1].split()[0])


@pytest.mark.slow
async def test_a_connect_whose_auth_never_comes_back_leaves_no_connection_open(own_redis_server):
    """A frozen server (SIGSTOP) still accepts connections (the kernel does), then never
    answers AUTH: each attempt that gives up closes its connection, or a supervisor retrying
    through a long freeze would leave one open per attempt once the server runs again."""
    own_redis_server.cli("CONFIG", "SET", "requirepass", "s3cret")
    wire = Wire(f"redis://:s3cret@127.0.0.1:{own_redis_server.port}/2", TlsSettings(),
                timeout=5.0, connect_timeout=1.0)
    server = own_redis_server.process
    server.send_signal(signal.SIGSTOP)
    try:
        for _ in range(3):
            with pytest.raises(redis.exceptions.ConnectionError, match="Error connecting"):
                await wire.call("PING")
    finally:
        server.send_signal(signal.SIGCONT)
    # The server reads each AUTH, then the close after it; 1: the count's own redis-cli.
    await until(lambda: _connected_clients(own_redis_server) == 1, 20,
                "only the count's own client connected", every=0.2)
    assert await wire.call("PING") == b"PONG"
    wire.close()
