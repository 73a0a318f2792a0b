"""Pulling from a durable JetStream consumer: a no-wait pull for the room; on an empty
queue, one blocking request for the first message, then no-wait top-ups.

nats-py exposes neither ``no_wait`` nor per-request routing, so pull requests are sent by
hand to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` with a reply subject on the
connection's inbox. A request's status (404 no messages, 408 expired, 409 ...) comes back
on that reply subject, but its messages carry their original subject: every pulled message
lands in one backlog, whichever request it answers. So nothing is ever dropped: a message
that arrives after its receive gave up (a late reply) is simply returned by the next one,
and renewed with the rest until then (``backlog``).

A request that got no answer in time may still be answered: what it asked for is "owed"
and counted against the room of the next top-ups (so late arrivals do not push the
outstanding count past prefetch), until a later request's status shows the server has
answered everything before it, the connection is replaced, or twice the request timeout
has passed.

A settle call's acks carry a pull of their own (``ahead``): a no-wait request for the room
they make, in the same write, whose messages land in the backlog for the next receive.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
from nats.aio.msg import Msg

from broker.nats.conn import Connection, ConnectionLost, RequestTimeout

log = logging.getLogger("broker.nats")

#: Extra seconds to wait past a pull request's own expiry for the server's 408.
EXPIRY_GRACE = 1.0
#: Seconds a receive waits after a pull answered 503 "no responders": nobody serves the
#: consumer (a JetStream cluster electing its leader), so asking again at once only spins.
NO_LEADER_PAUSE = 0.25


class NoResponders(Exception):
    """A pull request was answered 503: the consumer has no leader right now."""


class Puller:
    """Runs pull requests for one consumer and keeps what arrives in a backlog."""

    def __init__(
        self, next_subject: str, request_timeout: float,
        on_silence: Callable[[Connection], None],
    ) -> None:
        self._next = next_subject
        self._request_timeout = request_timeout
        self._on_silence = on_silence  # the server did not answer a pull: check the socket
        self._backlog: deque[Msg] = deque()
        self._wake: asyncio.Future[None] | None = None  # what _until waits on now
        self._lock = asyncio.Lock()
        self._no_wait = False  # stop_waiting() was called
        self._owed = 0  # asked for by requests that timed out; may still arrive
        self._owed_until = 0.0
        self._leaderless_since: float | None = None  # first 503 of an outage, for the log
        self._arrived = 0  # pulled messages seen so far (counts what a pull ahead got)
        self._room = 0  # the most a receive asked for: what a pull ahead may fill
        # Pulls ahead in flight (see ahead()): each one's status, batch and _arrived when
        # sent, oldest first (the server serves pull requests in order).
        self._ahead: deque[tuple[asyncio.Future[Msg], int, int]] = deque()

    def on_pulled(self, msg: Msg) -> None:
        """Connection callback for every pulled message (on any connection)."""
        self._backlog.append(msg)
        self._arrived += 1
        self._signal()

    def stop_waiting(self) -> None:
        """A stop began: a pull waiting for its first message returns now, and no later
        pull waits (what arrives meanwhile stays in the backlog)."""
        self._no_wait = True
        self._signal()

    def _signal(self, _: object = None) -> None:
        """Something _until waits for may have happened: it looks again."""
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def backlog(self) -> list[Msg]:
        """What arrived but was not returned yet (renewed with the held deliveries)."""
        return list(self._backlog)

    def take_backlog(self) -> list[Msg]:
        """Everything that arrived but was not returned (used at close to release it)."""
        taken = list(self._backlog)
        self._backlog.clear()
        return taken

    @property
    def waiting(self) -> int:
        """How many arrived and were not returned yet."""
        return len(self._backlog)

    @property
    def arrived(self) -> int:
        """Pulled messages seen so far (a count that only grows)."""
        return self._arrived

    def ready(self, max_messages: int) -> list[Msg] | None:
        """The first ``max_messages`` of the backlog, left there, when it holds that many
        and no receive is under way: what ``pull`` would return at once, with no request
        of its own (no room left for a top-up). None otherwise."""
        if self._lock.locked() or len(self._backlog) < max_messages or max_messages <= 0:
            return None
        return list(itertools.islice(self._backlog, max_messages))

    def take_ready(self, max_messages: int) -> list[Msg]:
        """Take what ``ready`` showed (same turn), with the bookkeeping ``pull`` does: the
        room a pull ahead may fill, and the pulls ahead that were served dropped. One not
        served yet stays for the next ``pull`` to wait for (its messages come to the
        backlog, or its status says there were fewer)."""
        self._room = max(self._room, max_messages)
        while self._ahead:
            status, batch, mark = self._ahead[0]
            if self._arrived - mark < batch:
                break
            self._ahead.popleft()
            _forget(status)
        return self._take(max_messages)

    def ahead(self, conn: Connection, freed: int) -> bytes:
        """A no-wait pull for the room ``freed`` acks make, to go in the acks' own write
        (``request_batch``'s tail): the next receive then finds the messages here instead of
        asking after the acks are confirmed (one round trip per job at prefetch 1, not two).
        Its messages land in the backlog like any other (renewed, and released at close,
        with it). b"" (nothing to send) after a stop began, or when the backlog and the
        pulls ahead in flight already hold a receive's worth.

        A receive under way does not stand in its way: what that receive asked for was
        free before these acks were made (the caller counts a delivery as outstanding
        until its settlement is confirmed). Arrivals are not told apart by request, so a
        receive may return before all its own came: the rest wait in the backlog.

        The server applies the acks before it serves the pull (same write, in order), so it
        counts no more deliveries outstanding than before; an ack that was not applied (no
        reply, or a 503) leaves up to ``freed`` more out until its delivery's ack wait."""
        if self._no_wait:
            return b""
        batch = min(freed, self._room - len(self._backlog)
                    - sum(asked for _, asked, _ in self._ahead))
        if batch <= 0:
            return b""
        try:
            line, status = conn.pull_line(self._next, orjson.dumps(
                {"batch": batch, "no_wait": True}), self._request_timeout, "pull request")
        except ConnectionLost:
            return b""
        status.add_done_callback(_retrieve)  # a stop may leave it unawaited
        self._ahead.append((status, batch, self._arrived))
        return line

    async def _settle_ahead(self) -> None:
        """Wait for the pulls ahead in flight: each until as many arrived as it asked for,
        or its status came (404: the queue had fewer). One made on a connection that has
        closed since brings nothing more; a 503 is for the pull that follows to meet."""
        while self._ahead:
            status, batch, mark = self._ahead.popleft()

            def served(mark: int = mark, batch: int = batch) -> bool:  # no status follows
                return self._arrived - mark >= batch

            if served():
                _forget(status)
                continue
            with contextlib.suppress(ConnectionLost, NoResponders):
                await self._until(served, status, batch)

    async def pull(self, conn: Connection, max_messages: int, block_timeout: float) -> list[Msg]:
        """Up to ``max_messages``: what is there at once, else wait up to ``block_timeout``
        for the first one; then top up without waiting. Never waits to fill a batch."""
        async with self._lock:  # one receive at a time: the backlog is shared
            self._room = max(self._room, max_messages)
            got: list[Msg] = []
            try:
                await self._settle_ahead()
                got = self._take(max_messages)
                if not got and block_timeout > 0 and not self._no_wait:
                    # A busy queue answers a no-wait pull at once: one round trip, not
                    # a wait for one message and then a top-up (an idle one says 404).
                    room = max_messages - self._still_owed()
                    if room > 0:
                        await self._top_up(conn, room)
                        got = self._take(max_messages)
                        if got:
                            self._note_served()
                            return got
                    await self._wait_first(conn, block_timeout)
                    got = self._take(max_messages)
                if self._no_wait and not got:
                    return got
                room = max_messages - len(got) - self._still_owed()
                if room > 0:
                    await self._top_up(conn, room)
            except ConnectionLost as error:
                self._owed = 0  # nothing more comes from a closed connection
                log.info("pull ended early: %s", error)
            except RequestTimeout as error:
                log.warning("pull request got no answer: %s", error)
                self._on_silence(conn)
            except NoResponders:
                self._note_leaderless()
                if not got and not self._backlog:
                    await asyncio.sleep(min(block_timeout, NO_LEADER_PAUSE))
            else:
                self._note_served()
            return got + self._take(max_messages - len(got))

    def _note_leaderless(self) -> None:
        if self._leaderless_since is None:
            self._leaderless_since = time.monotonic()
            log.warning("NATS consumer has no leader (503 no responders: a JetStream cluster "
                        "is electing one, or the consumer is gone); pulling again every "
                        "%gs", NO_LEADER_PAUSE)

    def _note_served(self) -> None:
        if self._leaderless_since is not None:
            log.warning("NATS consumer answers pulls again after %.2fs without a leader",
                        time.monotonic() - self._leaderless_since)
            self._leaderless_since = None

    def _still_owed(self) -> int:
        if self._owed and time.monotonic() >= self._owed_until:
            self._owed = 0
        return self._owed

    async def _wait_first(self, conn: Connection, block_timeout: float) -> None:
        """A pull for one message that the server holds open for ``block_timeout``."""
        body = {"batch": 1, "expires": max(1, int(block_timeout * 1e9))}
        status = await self._request(conn, body, block_timeout + EXPIRY_GRACE)
        await self._until(lambda: bool(self._backlog) or self._no_wait, status, 1)

    async def _top_up(self, conn: Connection, room: int) -> None:
        """A no-wait pull for ``room`` messages: ends at a status or when all arrived."""
        start = len(self._backlog)
        status = await self._request(conn, {"batch": room, "no_wait": True},
                                     self._request_timeout)
        await self._until(lambda: len(self._backlog) - start >= room, status, room)

    async def _request(
        self, conn: Connection, body: dict[str, Any], timeout: float
    ) -> asyncio.Future[Msg]:
        reply, status = conn.expect_reply(timeout, "pull request")
        try:
            await conn.publish(self._next, orjson.dumps(body), reply=reply)
        except BaseException:
            status.cancel()
            raise
        return status

    async def _until(
        self, enough: Callable[[], bool], status: asyncio.Future[Msg], batch: int
    ) -> None:
        """Wait until ``enough()`` or the request's status (or its timeout) arrives."""
        try:
            if not enough() and not status.done():
                status.add_done_callback(self._signal)
            while not enough() and not status.done():
                # One future woken by an arrival, the status or a stop: no task per wait.
                self._wake = asyncio.get_running_loop().create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            if status.done() and not status.cancelled():
                _log_status(status.result())  # raises ConnectionLost / RequestTimeout
                self._owed = 0  # answered: so was every request before it
        except RequestTimeout:
            self._owed += batch
            self._owed_until = time.monotonic() + 2 * self._request_timeout
            raise
        finally:
            status.cancel()

    def _take(self, limit: int) -> list[Msg]:
        taken: list[Msg] = []
        while self._backlog and len(taken) < limit:
            taken.append(self._backlog.popleft())
        return taken


def _retrieve(status: asyncio.Future[Msg]) -> None:
    if not status.cancelled():
        status.exception()


def _forget(status: asyncio.Future[Msg]) -> None:
    """Cancel the status of a pull ahead that was served. Its ``_retrieve`` goes first:
    a cancel would schedule it, a callback on the loop per settle call (at prefetch 1,
    per job) for a future nobody reads."""
    status.remove_done_callback(_retrieve)
    status.cancel()


def _log_status(msg: Msg) -> None:
    """404 (nothing there) and 408 (expired) are the normal ends of a pull request; 503
    raises NoResponders."""
    headers = msg.headers or {}
    code = headers.get("Status", "")
    if code == "503":
        raise NoResponders()
    if code not in ("404", "408"):
        log.info("pull request ended with status %s %s", code, headers.get("Description", ""))
