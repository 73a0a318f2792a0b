"""The Redis broker's blocking receive: one BLMOVE ready -> reservation at a time, on a
connection of its own, which a stop ends at once with CLIENT UNBLOCK.

Blocking reads get their own connection: they must never hold up settle or extend. On a plain
Redis a lean one (``broker.redis.wire``) that drops a payload over the size limit unread (a
BLMOVE returns what it moved) and sends CLIENT ID with each BLMOVE, so that a stop can end it;
a Cluster keeps redis-py's client, which follows the slot map. The reservation the move goes
into (registered, given back, poisoned) is the broker's business (``broker.redis.broker``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.exceptions

from broker.redis.connection import CONNECTION_ERRORS
from broker.redis.wire import Oversized, Wire
from broker.tls import TlsSettings

log = logging.getLogger("broker.redis.broker")  # its log lines keep the broker's name

#: How much longer than its own timeout a blocking move may take before we give up on it.
BLOCK_MARGIN = 5.0
#: Reply timeout of the blocking connection: none in effect (each BLMOVE has its own).
BLOCKING_WIRE_TIMEOUT = 86400.0
#: Pause between CLIENT UNBLOCK attempts at a stop while our BLMOVE is sent but not yet
#: blocked in the server (CLIENT UNBLOCK then answers 0).
UNBLOCK_PAUSE = 0.05


class Abandoned(Exception):
    """A stop cancelled the blocking move without CLIENT UNBLOCK: the server may still
    complete it, so the caller gives its reservation back (see ``RedisBroker._give_back``)."""


class BlockingMove:
    """The blocking BLMOVE of one queue's receives, and its end at a stop.

    ``client`` is the broker's command connection (CLIENT UNBLOCK goes over it);
    ``cluster_client`` a redis-py Cluster client of its own for the moves (None: a plain
    Redis, moved over a lean connection to ``url``).
    """

    def __init__(
        self,
        url: str,
        tls: TlsSettings,
        ready: str,
        client: Any,
        cluster_client: Any,
        *,
        connect_timeout: float,
        bulk_limit: int | None,
    ) -> None:
        self.ready = ready
        self.client = client
        self.cluster = cluster_client is not None
        self._blocking: Any = cluster_client
        self._blocking_wire = None if self.cluster else Wire(
            url, tls, BLOCKING_WIRE_TIMEOUT, connect_timeout, bulk_limit=bulk_limit,
        )
        self.stopped = False  # stop() was called: receives never block again
        self._blocked: asyncio.Future[Any] | None = None  # the BLMOVE a receive waits on
        #: CLIENT ID of the blocking connection (None: unknown, or not allowed by the ACL)
        #: and, on a Cluster, the node it is connected to
        self._blocked_id: int | None = None
        self._blocked_node: Any = None
        self._can_unblock = True  # False once CLIENT ID was refused
        self._unblocking: asyncio.Future[None] | None = None

    async def close(self) -> None:
        if self._unblocking is not None:
            self._unblocking.cancel()
        if self._blocking_wire is not None:
            self._blocking_wire.close()
        if self._blocking is not None:
            await self._blocking.aclose()

    async def move(self, key: str, timeout: float) -> bytes | Oversized | None:
        """BLMOVE ready -> ``key`` for up to ``timeout`` seconds: the payload moved (its
        length only if over the size limit), or None: timed out, ended by a stop's CLIENT
        UNBLOCK, let go by a failover, or not sent (a stop began first). Raises
        ``Abandoned`` if a stop had to cancel it instead."""
        self._blocked_id = None
        if self._blocking is not None:
            await self._identify_blocking()
        if self.stopped:  # a stop began meanwhile: no move was sent, so none can land
            return None
        self._blocked = asyncio.ensure_future(self._move_in_time(key, timeout))
        try:
            moved: bytes | Oversized | None = await self._blocked
            return moved
        except asyncio.CancelledError:
            self._drop_blocking()
            if not self.stopped or _cancelling():
                raise
            raise Abandoned(key) from None
        except redis.exceptions.ResponseError as error:
            if not str(error).startswith("UNBLOCKED"):
                raise
            # The master became a replica (CLUSTER FAILOVER) while we waited and let go of
            # us: nothing moved. Like a timeout; the next call finds the new master.
            return None
        except BaseException:
            self._drop_blocking()  # the BLMOVE may still be waiting in Redis
            raise
        finally:
            self._blocked = None

    async def _move_in_time(self, key: str, timeout: float) -> Any:
        """``_move`` with a deadline, its coroutine made inside the task: a task cancelled
        before its first step then leaves no coroutine that was never awaited."""
        async with asyncio.timeout(timeout + BLOCK_MARGIN):
            return await self._move(key, timeout)

    async def _move(self, key: str, timeout: float) -> Any:
        """BLMOVE ready -> reservation ``key``; on the lean connection with CLIENT ID sent
        just before it (so the id names this BLMOVE's connection)."""
        if self._blocking_wire is None:
            return await self._blocking.blmove(self.ready, key, timeout, "RIGHT", "LEFT")
        commands: list[tuple[Any, ...]] = [("BLMOVE", self.ready, key, "RIGHT", "LEFT",
                                            timeout)]
        if self._can_unblock:
            commands.insert(0, ("CLIENT", "ID"))
        *identified, moved = await self._blocking_wire.send(*commands)
        if identified:
            self._identified(await identified[0])
        reply = await moved
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply

    def _identified(self, reply: Any) -> None:
        if isinstance(reply, redis.exceptions.ResponseError):  # NOPERM: an ACL from before
            self._can_unblock = False
            log.warning("CLIENT ID refused (%s): a stop will leave its idle receive's "
                        "reservation registered (expired) for maintenance to remove; grant "
                        "client|id and client|unblock (docs/acl.md)", reply)
        else:
            self._blocked_id = int(reply)

    def _drop_blocking(self) -> None:
        """Close the lean blocking connection: a BLMOVE given up on may still be waiting
        in Redis, and the next command must not queue behind it."""
        if self._blocking_wire is not None:
            self._blocking_wire.close()

    async def _identify_blocking(self) -> None:
        """On a Cluster: learn the blocking connection's CLIENT ID (on that connection, just
        before the BLMOVE it names), so that a stop can end the BLMOVE with CLIENT UNBLOCK."""
        if not self._can_unblock:
            return
        try:
            # The blocking client's one connection to the node serving the queue's slot
            # (it runs one command at a time, so it never opens a second one there).
            await self._blocking.initialize()  # the slot map, once
            node = self._blocking.get_node_from_key(self.ready)
            self._blocked_node = (node.host, node.port)
            reply = await self._blocking.execute_command("CLIENT ID", target_nodes=node)
        except redis.exceptions.ResponseError as error:
            reply = error
        self._identified(reply)

    def stop(self) -> None:
        """A stop began: a move blocked on an idle queue ends now, and no later one is
        sent."""
        self.stopped = True
        if self._blocked is not None and self._unblocking is None:
            self._unblocking = asyncio.ensure_future(self._unblock(self._blocked))

    async def _unblock(self, blocked: asyncio.Future[Any]) -> None:
        """End our BLMOVE as if it timed out: CLIENT UNBLOCK from the command connection.
        Once Redis answered 1 no move into the reservation can follow, so the receive
        unregisters it and the registry is left empty (a cancelled BLMOVE could still be
        served by the server after we gave up on it). Without CLIENT UNBLOCK (refused, or
        an unknown id), the BLMOVE is abandoned instead: see ``Abandoned``."""
        try:
            while not blocked.done():
                if self._blocked_id is None and not self._can_unblock:
                    break
                if self._blocked_id is not None and await self._unblock_once(self._blocked_id):
                    return
                await asyncio.sleep(UNBLOCK_PAUSE)  # sent, but not blocked in Redis yet
        except (*CONNECTION_ERRORS, redis.exceptions.ResponseError) as error:
            log.warning("CLIENT UNBLOCK failed (%s): abandoning the blocking receive; its "
                        "reservation stays registered (expired) for maintenance", error)
        finally:
            self._unblocking = None
        if not blocked.done():
            blocked.cancel()

    async def _unblock_once(self, client_id: int) -> bool:
        if not self.cluster:
            return bool(await self.client.client_unblock(client_id, error=False))
        node = self.client.get_node(*self._blocked_node)
        if node is None:  # the node left the cluster: its BLMOVE ended with it
            return True
        return bool(await self.client.execute_command(
            "CLIENT UNBLOCK", client_id, "TIMEOUT", target_nodes=node))


def _cancelling() -> bool:
    """The current task itself is being cancelled (not just a future it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
