"""Writes confirmed by replicas: Redis ``WAIT`` on the connection that made the write.

Redis replicates asynchronously: a master answers a write before any replica has it, and a
failover to a replica that had not received it yet takes the write back. ``[broker]
wait_replicas`` (``Replication.replicas``) makes chosen writes count as done only once that
many replicas acknowledged them (``WAIT numreplicas timeout``).

WAIT waits for the offset of the *last write of its own connection*, so it must follow the
write on the same connection: the write and the WAIT go as one pipeline to the node that
serves the key (a cluster pipeline sends each node's commands on one connection, in order).
A write refused with a redirection (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) did not run, and
the WAIT after it would measure some older write: the pair is sent again after the slot
map is reloaded. On a cluster, a connection error (the master died) is handled as the
cluster client handles it for any command: the slot map is reloaded and the pair sent again,
up to ``CONNECTION_RETRIES`` times; the scripts' ownership checks make a repeat harmless, and
a repeated push at worst stores a message twice. On a single Redis it propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    TimeoutError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.base import BrokerError

#: Replies that mean the command was refused before it ran (so the pair may be sent again).
_NOT_RUN = (MovedError, AskError, TryAgainError, ClusterDownError)
#: How long a pair is sent again while its slot moves or fails over.
NOT_RUN_PATIENCE = 10.0
#: Replies that mean the connection failed: the write may or may not have been applied.
_CONNECTION_ERRORS = (RedisConnectionError, TimeoutError, OSError)
#: Repeats of a pair after a connection error (cluster only), as the cluster client's own.
CONNECTION_RETRIES = 3


@dataclass(frozen=True, slots=True)
class Replication:
    """How many replicas must acknowledge a write, and how long to wait for them."""

    replicas: int = 0
    timeout: float = 1.0  # seconds

    @property
    def enabled(self) -> bool:
        return self.replicas > 0

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout * 1000))


NONE = Replication()


class NotReplicated(BrokerError):
    """The master applied the write, but fewer replicas than asked confirmed it in time: a
    failover now could take it back."""

    def __init__(self, what: str, confirmed: int, wanted: int) -> None:
        super().__init__(f"{what}: {confirmed} of {wanted} replicas confirmed the write")
        self.confirmed = confirmed
        self.wanted = wanted


async def write_and_wait(
    client: Any, key: str, commands: Sequence[Sequence[Any]], replication: Replication
) -> tuple[list[Any], int]:
    """Run ``commands`` (all on ``key``'s node) and then WAIT, on one connection.

    Returns the commands' replies (an error reply as its exception) and the number of
    replicas that acknowledged them. Connection errors propagate (the writes may or may not
    have been applied, as with any write).
    """
    cluster = isinstance(client, RedisCluster)
    deadline, pause, retries = time.monotonic() + NOT_RUN_PATIENCE, 0.01, CONNECTION_RETRIES
    while True:
        try:
            replies = await _pipeline(client, key, commands, replication)
        except _CONNECTION_ERRORS as error:
            replies = [error]
        broken = next((r for r in replies if isinstance(r, _CONNECTION_ERRORS)), None)
        refused = next((r for r in replies if isinstance(r, _NOT_RUN)), None)
        if broken is not None:
            if not cluster or retries == 0:
                raise broken
            retries -= 1
        elif refused is not None:
            if time.monotonic() + pause > deadline:
                raise BrokerError(f"write not run: {refused}") from refused
        else:
            *results, confirmed = replies
            if isinstance(confirmed, Exception):
                raise BrokerError(f"WAIT failed: {confirmed}") from confirmed
            return results, int(confirmed)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.5)
        if cluster:
            await _reload(client)


async def _pipeline(
    client: Any, key: str, commands: Sequence[Sequence[Any]], replication: Replication
) -> list[Any]:
    wait = ("WAIT", replication.replicas, replication.timeout_ms)
    if isinstance(client, RedisCluster):
        pipe = client.pipeline()
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute_command(*wait, target_nodes=client.get_node_from_key(key))
        replies: list[Any] = await pipe.execute(raise_on_error=False, allow_redirections=False)
        return replies
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    pipe.execute_command(*wait)
    replies = await pipe.execute(raise_on_error=False)
    return replies


async def _reload(client: RedisCluster) -> None:
    """Ask the cluster where the slots are now (after a redirection or a dead master)."""
    with contextlib.suppress(*_CONNECTION_ERRORS, RedisClusterException):
        await client.nodes_manager.initialize()
