"""The connection factory: the current NATS connection, replaced when it breaks.

A broken connection is never repaired in place: a new client is built (with backoff,
in the background, as soon as the old one closes), prepared (streams and consumer checked,
inbox subscribed, i.e. the pull subscription re-bound) and only then handed out.
Operations that were in flight on the old connection are not replayed: their callers got
``ConnectionLost`` and decide. Deliveries stay valid across connections, since acks go to
the message's own reply subject, which any connection can publish to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

from broker.base import BrokerError
from broker.errors import describe
from broker.nats.conn import Connection, ConnectionLost, RequestTimeout
from broker.urls import redact

log = logging.getLogger("broker.nats")

class NotReady(BrokerError):
    """The server answered but cannot serve yet (e.g. JetStream still recovering)."""


#: Our errors worth retrying while building a connection (other BrokerErrors are final).
RETRYABLE = (ConnectionLost, RequestTimeout, NotReady)


class Unavailable(BrokerError):
    """No working connection could be made in time; ``last``: the last attempt's error."""

    def __init__(self, message: str, *, last: BaseException | None = None) -> None:
        super().__init__(message)
        self.last = last


class Link:
    """Hands out a live ``Connection``; builds a new one (backoff) when it breaks."""

    def __init__(
        self,
        url: str,
        *,
        on_pulled: Callable[[Msg], None],
        prepare: Callable[[Connection], Awaitable[None]],
        options: dict[str, Any] | None = None,
        backoff: tuple[float, float] = (0.05, 2.0),
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self._url = url
        self._on_pulled = on_pulled
        self._on_read = on_read  # see Connection.open
        self._prepare = prepare
        self._options = options or {}
        self._backoff = backoff
        self._conn: Connection | None = None
        self._building: asyncio.Task[Connection] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[bool]] = set()
        self._closing = False
        self.generation = 0  # how many connections were built so far
        self.last_error: BaseException | None = None  # of the last failed attempt
        # Told when a connection breaks and when the next is in place (the supervisor's
        # outage line); without them, the link logs both itself.
        self._on_lost: Callable[[str], None] | None = None
        self._on_back: Callable[[], None] | None = None

    def watch(self, lost: Callable[[str], None], back: Callable[[], None]) -> None:
        """Call ``lost(reason)`` when the connection breaks and ``back()`` when a new one
        is ready, instead of logging them."""
        self._on_lost, self._on_back = lost, back

    @property
    def connection(self) -> Connection | None:
        """The current connection if it is live, else None (never waits)."""
        conn = self._conn
        return conn if conn is not None and not conn.closed else None

    async def current(self, timeout: float) -> Connection:
        """A live connection, waiting up to ``timeout`` s for a new one if needed.

        Raises Unavailable when none is ready in time, or the setup error (a BrokerError
        such as a stream whose settings differ) that made building one fail for good.
        """
        conn = self.connection
        if conn is not None:
            return conn
        if self._closing:
            raise Unavailable("the broker is closed")
        building = self._start_building()
        try:
            return await asyncio.wait_for(asyncio.shield(building), timeout)
        except TimeoutError:
            last = self.last_error
            # The reason (a refused certificate, a closed socket) is what an operator needs.
            reason = f" (last attempt: {describe(last)})" if last else ""
            raise Unavailable(
                f"no NATS connection to {redact(self._url)} within {timeout}s{reason}",
                last=last,
            ) from None

    def suspect(self, conn: Connection, timeout: float) -> None:
        """A request on ``conn`` timed out: check it in the background, close it if dead."""
        if conn.closed or any(not task.done() for task in self._checks):
            return
        task = asyncio.get_running_loop().create_task(conn.check(timeout))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def close(self) -> None:
        self._closing = True
        for task in (self._building, self._watcher, *self._checks):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._conn is not None:
            await self._conn.close()

    def _start_building(self) -> asyncio.Task[Connection]:
        if self._building is None or self._building.done():
            self._building = asyncio.get_running_loop().create_task(self._build())
            self._building.add_done_callback(_consume_error)
        return self._building

    async def _build(self) -> Connection:
        delay, cap = self._backoff
        attempt = 0
        while True:
            attempt += 1
            try:
                conn = await self._open_prepared()
            except Exception as error:  # nats-py raises its own error types for refusals
                if isinstance(error, BrokerError) and not isinstance(error, RETRYABLE):
                    raise  # a setup error, e.g. settings that differ: retrying cannot help
                self.last_error = error
                told = self._on_lost is not None and self.generation > 0
                level = logging.WARNING if attempt == 1 and not told else logging.DEBUG
                log.log(level, "NATS connect attempt %d failed: %r", attempt, error)
            else:
                self.last_error = None
                self._adopt(conn, attempt)
                return conn
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, cap)

    async def _open_prepared(self) -> Connection:
        conn = await Connection.open(self._url, self._on_pulled, self._on_read,
                                     **self._options)
        try:
            await self._prepare(conn)
        except BaseException:
            await conn.close()
            raise
        return conn

    def _adopt(self, conn: Connection, attempts: int) -> None:
        self._conn = conn
        self.generation += 1
        if self.generation > 1:
            level = logging.DEBUG if self._on_back is not None else logging.WARNING
            log.log(level, "NATS reconnected (connection %d, after %d attempts)",
                    self.generation, attempts)
            if self._on_back is not None:
                self._on_back()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(conn))

    async def _watch(self, conn: Connection) -> None:
        """Start the next connection as soon as this one closes (re-binds the pull inbox)."""
        await conn.wait_closed()
        if not self._closing:
            if self._on_lost is not None:
                log.debug("NATS connection %d closed; building a new one", self.generation)
                self._on_lost(f"the connection to {conn.server} closed")
            else:
                log.warning("NATS connection %d closed; building a new one", self.generation)
            self._start_building()


def _consume_error(task: asyncio.Task[Connection]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here; callers that wait get it through the shield
