"""The private parts of nats-py and redis-py the broker relies on are still there.

``broker.nats.parse`` and ``broker.nats.conn`` patch nats-py's parser, message hook and
write path; ``broker.redis.connection`` subclasses redis-py's connections (commands packed
by its hiredis serializer) and changes a Cluster client's settings after it is made. None
of that is nats-py's or redis-py's public API, so ``pyproject.toml`` caps both at the next
minor version after the one these hooks were checked against. Before raising a cap, run
this file against the new version: each failure names the internal that moved and the
module of ours that uses it.
"""

from __future__ import annotations

import asyncio
import inspect
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
NATS_PY = metadata.version("nats-py")
REDIS_PY = metadata.version("redis")


def moved(library: str, version: str, internal: str, user: str) -> str:
    return (f"{library} {version}: {internal} moved or changed, and {user} relies on it; "
            f"adapt the hook to this version before raising {library}'s cap in pyproject.toml")


def nats_moved(internal: str, user: str) -> str:
    return moved("nats-py", NATS_PY, internal, user)


def redis_moved(internal: str, user: str) -> str:
    return moved("redis-py", REDIS_PY, internal, user)


def parameters(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


# -- the caps ---------------------------------------------------------------------------


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(line) for line in project["dependencies"]]
    return {requirement.name: requirement for requirement in found}


@pytest.mark.parametrize(("name", "version"), [
    ("nats-py", NATS_PY), ("redis", REDIS_PY)])
def test_a_library_patched_in_private_is_capped_and_the_installed_one_fits(name, version):
    requirement = requirements()[name]
    assert any(spec.operator == "<" for spec in requirement.specifier), (
        f"{name} has no upper bound in pyproject.toml, yet its internals are patched")
    assert Version(version) in requirement.specifier, (
        f"{name} {version} is outside pyproject.toml's {requirement.specifier}")


# -- nats-py: broker/nats/parse.py and broker/nats/conn.py --------------------------------


async def test_nats_py_parser_is_where_parse_install_takes_it():
    from nats.aio.client import Client
    from nats.protocol import parser as nats_parser

    user = "broker/nats/parse.py"
    for constant in ("AWAITING_CONTROL_LINE", "MAX_CONTROL_LINE_SIZE"):
        assert isinstance(getattr(nats_parser, constant, None), int), nats_moved(
            f"nats.protocol.parser.{constant}", user)
    client = Client()
    parser = getattr(client, "_ps", None)
    assert isinstance(parser, nats_parser.Parser), nats_moved("Client._ps (its Parser)", user)
    assert isinstance(getattr(parser, "buf", None), bytearray), nats_moved("Parser.buf", user)
    assert parser.state == nats_parser.AWAITING_CONTROL_LINE, nats_moved("Parser.state", user)
    assert inspect.iscoroutinefunction(nats_parser.Parser.parse), nats_moved(
        "Parser.parse (a coroutine)", user)
    assert parameters(nats_parser.Parser.parse) == ["data"], nats_moved(
        "Parser.parse(data)", user)
    stats = getattr(client, "stats", None)
    assert isinstance(stats, dict) and {"in_msgs", "in_bytes"} <= set(stats), nats_moved(
        "Client.stats['in_msgs'/'in_bytes']", user)


def test_nats_py_client_hooks_keep_their_signatures():
    from nats.aio.client import Client

    expected = {  # method: (its parameters, the module of ours that calls or replaces it)
        "_process_msg": (["sid", "subject", "reply", "data", "headers"],
                         "broker/nats/conn.py and parse.py"),
        "_process_ping": ([], "broker/nats/parse.py"),
        "_process_pong": ([], "broker/nats/parse.py"),
        "_send_command": (["cmd", "priority"], "broker/nats/conn.py (Connection._write)"),
        "_flush_pending": (["force_flush"], "broker/nats/conn.py (Connection._write)"),
    }
    for name, (arguments, user) in expected.items():
        method = getattr(Client, name, None)
        assert method is not None and inspect.iscoroutinefunction(method), nats_moved(
            f"Client.{name} (a coroutine)", user)
        assert parameters(method) == arguments, nats_moved(
            f"Client.{name}({', '.join(arguments)})", user)


async def test_nats_py_parser_hands_a_message_to_process_msg_as_the_hook_expects():
    """conn.py's replacement of ``_process_msg`` takes nats-py's five positional arguments,
    headers None for a MSG without them."""
    from nats.protocol.parser import Parser

    calls: list[tuple[Any, ...]] = []

    class Client:
        async def _process_msg(self, *args: Any) -> None:
            calls.append(args)

    await Parser(Client()).parse(
        b"MSG a.b 7 r.s 2\r\nhi\r\nHMSG c 8 12 14\r\nNATS/1.0\r\n\r\nhi\r\n")
    assert calls == [(7, b"a.b", b"r.s", b"hi", None),
                     (8, b"c", b"", b"hi", b"NATS/1.0\r\n\r\n")], nats_moved(
        "Parser.parse's call of _process_msg(sid, subject, reply, data, headers)",
        "broker/nats/conn.py and parse.py")


async def test_nats_py_client_state_read_by_the_connection_is_there():
    from nats.aio.client import Client

    client = Client()
    user = "broker/nats/conn.py"
    assert getattr(client, "_pending_data_size", None) == 0, nats_moved(
        "Client._pending_data_size", user)
    assert isinstance(getattr(client, "_server_info", None), dict), nats_moved(
        "Client._server_info", user)
    assert hasattr(client, "_transport"), nats_moved("Client._transport", user)


async def test_nats_py_tcp_transport_keeps_its_stream_reader_and_writer():
    from nats.aio.transport import TcpTransport

    transport = TcpTransport()
    for name in ("_io_reader", "_io_writer"):
        assert hasattr(transport, name), nats_moved(
            f"TcpTransport.{name}", "broker/nats/parse.py and tls.py")
    for name in ("write", "drain"):
        assert callable(getattr(transport, name, None)), nats_moved(
            f"TcpTransport.{name}", "broker/nats/conn.py (Connection._write)")


def test_nats_py_subscription_keeps_its_sid():
    from nats.aio.subscription import Subscription

    assert getattr(Subscription(None, id=7), "_id", None) == 7, nats_moved(
        "Subscription._id (the sid)", "broker/nats/conn.py (Connection.open)")


async def test_asyncio_stream_reader_internals_read_by_the_inbox_hook():
    """parse._read_at_once asks whether nats-py's read loop waits for bytes (Python's own
    StreamReader internals: a Python upgrade, not a pin, could move them)."""
    reader = asyncio.StreamReader()
    for name in ("_waiter", "_buffer", "feed_data"):
        assert hasattr(reader, name), (
            f"Python's asyncio.StreamReader.{name} moved: broker/nats/parse.py relies on it")


# -- redis-py: broker/redis/connection.py -----------------------------------------------


def test_redis_py_hiredis_serializer_packs_as_the_connections_need():
    user = "broker/redis/connection.py (_BrokerConnection.pack_command)"
    try:
        from redis.connection import HiredisRespSerializer
    except ImportError:
        pytest.fail(redis_moved("redis.connection.HiredisRespSerializer", user))
    packed = HiredisRespSerializer().pack("SET", "k", b"v")
    assert b"".join(packed) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n", redis_moved(
        "HiredisRespSerializer.pack(*args)", user)


def test_redis_py_connection_methods_the_broker_overrides_keep_their_signatures():
    from redis.asyncio.connection import Connection

    user = "broker/redis/connection.py (_BrokerConnection)"
    send = Connection.send_packed_command
    assert inspect.iscoroutinefunction(send), redis_moved(
        "Connection.send_packed_command (a coroutine)", user)
    assert parameters(send) == ["command", "check_health"], redis_moved(
        "Connection.send_packed_command(command, check_health)", user)
    assert parameters(Connection.pack_command) == ["args"], redis_moved(
        "Connection.pack_command(*args)", user)


def test_redis_py_cluster_settings_are_where_use_in_cluster_changes_them():
    """use_in_cluster falls back to redis-py's own classes (with a warning) if these move;
    this says so before a release does."""
    from redis.asyncio.cluster import RedisCluster

    user = "broker/redis/connection.py (use_in_cluster)"
    client = RedisCluster(host="127.0.0.1", port=7000)  # not connected
    assert isinstance(getattr(client, "connection_kwargs", None), dict), redis_moved(
        "RedisCluster.connection_kwargs", user)
    manager = getattr(client, "nodes_manager", None)
    assert isinstance(getattr(manager, "connection_kwargs", None), dict), redis_moved(
        "RedisCluster.nodes_manager.connection_kwargs", user)
    nodes = [*getattr(client, "startup_nodes", ()),
             *getattr(manager, "startup_nodes", {}).values()]
    assert nodes and all(hasattr(node, "connection_class") for node in nodes), redis_moved(
        "the startup nodes' connection_class", user)
