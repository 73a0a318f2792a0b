"""redis-py's asyncio connections as the broker uses them, plain or in a Cluster.

Two changes to redis-py's own classes, each for a cost or a failure seen in this project:

- commands are packed by hiredis (as redis-py's sync client does): the asyncio connections
  pack in Python, at a cost that grows with the argument count, and for a batch of 1,000
  messages that was most of this broker's client CPU;
- a write that uvloop refuses because the connection's transport is already closed
  (``RuntimeError: unable to perform operation on <TCPTransport closed=True ...>; the
  handler is closed``) is raised as the ``ConnectionError`` it is. asyncio's own loop drops
  such a write and the read fails; uvloop raises, and neither redis-py nor its Cluster client
  knows that error: it came out of a settlement as a failure of its own rather than as the
  outage it was, and the Cluster client did not reload its slot map after it.

And what a lost connection raises, as the broker tells it: ``CONNECTION_ERRORS`` (a command
may or may not have been applied), ``CLUSTER_ERRORS`` and ``broker_errors``, which turns
them into a ``BrokerError`` naming the operation.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis
import redis.exceptions
from redis.asyncio.connection import (
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.connection import HiredisRespSerializer

from broker.base import BrokerError
from broker.errors import closed_transport, describe

log = logging.getLogger(__name__)

#: No CLIENT SETINFO on connect (redis-py's default): it is only informational, Redis before
#: 7.2 does not know it, and a least-privilege ACL user (broker.redis.acl) is not granted it, so
#: on 7.2 and later every connection would leave a denial in ACL LOG.
try:
    from redis.driver_info import DriverInfo  # noqa: F401 - redis-py with driver_info

    NO_CLIENT_INFO: dict[str, Any] = {"driver_info": None}
except ImportError:  # older: the same through the arguments driver_info replaced
    NO_CLIENT_INFO = {"lib_name": None, "lib_version": None}

#: Errors after which a command may or may not have been applied.
CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

#: Cluster errors that outlast the client's redirections and retries (TRYAGAIN while a slot
#: migrates, CLUSTERDOWN, a slot map not loaded yet).
CLUSTER_ERRORS = (
    redis.exceptions.ClusterError, redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
)


class _BrokerConnection:
    """What the broker's connections change in redis-py's (a mixin: first among the bases)."""

    __slots__ = ()
    _packer = HiredisRespSerializer()  # type: ignore[no-untyped-call]

    def pack_command(self, *args: Any) -> list[bytes]:
        packed: list[bytes] = self._packer.pack(*args)
        return packed

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as error:
            if not closed_transport(error):
                raise
            # redis-py has already dropped the connection (it does for any error of a write);
            # nothing was written, and the next command connects again.
            raise redis.exceptions.ConnectionError(
                f"Connection closed before the write: {error}") from error


class BrokerConnection(_BrokerConnection, Connection):
    pass


class BrokerSSLConnection(_BrokerConnection, SSLConnection):
    pass


class BrokerUnixConnection(_BrokerConnection, UnixDomainSocketConnection):
    pass


#: The broker's twin of each class redis-py picks.
_TWINS: dict[type[Any], type[Any]] = {
    Connection: BrokerConnection,
    SSLConnection: BrokerSSLConnection,
    UnixDomainSocketConnection: BrokerUnixConnection,
}


def connection_class(url: str) -> type[Connection] | type[UnixDomainSocketConnection]:
    """The broker's twin of the connection class redis-py picks for this URL."""
    return _twin(parse_url(url).get("connection_class", Connection))


def use_in_cluster(client: Any) -> None:
    """Make a new ``RedisCluster`` open the broker's connections to every node, those it
    starts from and those it finds later.

    The Cluster client takes no connection class of its own choosing (it picks redis-py's
    plain or TLS class), so its settings are changed after it is made and before it connects:
    the client's and its node manager's (the nodes it finds are made from the manager's). A
    redis-py that keeps them elsewhere keeps its own classes, which work
    (``supervisor.outage.unreachable`` still tells a closed transport as the outage it is):
    a warning says so, and the tests show it for the version installed.
    """
    settings = getattr(client, "connection_kwargs", None)
    manager = getattr(client, "nodes_manager", None)
    managed = getattr(manager, "connection_kwargs", None)
    if not isinstance(settings, dict) or not isinstance(managed, dict):
        log.warning("redis-py %s keeps a Cluster client's connection settings elsewhere: "
                    "its own connection classes are used (commands packed in Python)",
                    redis.__version__)
        return
    for chosen in (settings, managed):  # (one dict in redis-py 8: written twice, harmless)
        chosen["connection_class"] = _twin(chosen.get("connection_class", Connection))
    for node in (*getattr(client, "startup_nodes", ()),
                 *getattr(manager, "startup_nodes", {}).values()):
        node.connection_class = _twin(node.connection_class)


def _twin(chosen: type[Any]) -> type[Any]:
    """A class redis-py added after this was written is kept as it is (it works, without
    these changes)."""
    return _TWINS.get(chosen, chosen)


@contextlib.asynccontextmanager
async def broker_errors(operation: str) -> AsyncIterator[None]:
    """Connection errors, and cluster errors a slot migration or failover can leave after the
    client's own retries, become a BrokerError naming the operation (WrongTypeError passes)."""
    try:
        yield
    except (*CONNECTION_ERRORS, *CLUSTER_ERRORS) as error:
        # describe: redis-py's repr is "network:ConnectionError", without server or reason
        raise BrokerError(f"{operation} failed: {describe(error)}") from error

