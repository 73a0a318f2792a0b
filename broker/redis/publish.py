"""Publishing to a Redis queue the way `utopia-php/queue` producers do.

Each message is a fresh PHP-compatible envelope (``broker.envelope.build``) LPUSHed onto
``{ns}.queue.{q}``. Consumers take from the right, so among the messages of one LPUSH the
first value is taken first, and earlier pushes are taken before later ones.

``publish`` and ``publish_many`` return once Redis has the messages. ``Publisher`` hands
messages to a background task that sends whatever has accumulated, one LPUSH per queue and
1,000 values, as soon as the previous send is done (no timer).

Errors are never swallowed: ``publish``/``publish_many`` raise the client's error (after a
failure, ``publish_many`` may have stored its earlier chunks); ``Publisher`` keeps the
messages of a failed send and reports the error from ``flush()`` (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from broker import envelope
from broker.base import MAX_BATCH, BrokerError
from broker.redis.keys import QueueKeys
from broker.redis.replication import NONE as NO_WAIT
from broker.redis.replication import NotReplicated, Replication, write_and_wait


async def publish(
    client: Any, namespace: str, queue: str, payload: dict[str, Any],
    replication: Replication = NO_WAIT,
) -> str:
    """Publish one message; returns its pid once Redis has it (and, with ``replication``,
    that many replicas: else ``NotReplicated``)."""
    [pid] = await publish_many(client, namespace, queue, [payload], replication)
    return pid


async def publish_many(
    client: Any, namespace: str, queue: str, payloads: Sequence[dict[str, Any]],
    replication: Replication = NO_WAIT,
) -> list[str]:
    """Publish several messages in order (the first is consumed first); returns their pids.

    One round trip: the LPUSHes of 1,000 values each go in one pipeline. With
    ``replication``, a WAIT follows them on the same connection, and fewer replicas than
    asked raise ``NotReplicated``: the messages are on the master, but a failover could
    still take them back, so the caller must not count them as published (publishing
    again can store one twice, never lose one).
    """
    built = [envelope.build(queue, payload) for payload in payloads]
    if built:
        ready = QueueKeys(namespace, queue).ready
        await _push(client, {ready: [raw for _, raw in built]}, replication)
    return [pid for pid, _ in built]


class PublishError(BrokerError):
    """A background send failed; ``unsent`` messages are still buffered for a retry."""

    def __init__(self, message: str, unsent: int) -> None:
        super().__init__(message)
        self.unsent = unsent


class Publisher:
    """Publishes in the background, with backpressure at ``max_buffer`` pending messages.

    A message is pending from ``enqueue()`` until Redis confirmed its LPUSH. When a send
    fails, its messages stay buffered (ahead of newer ones of the same queue) and sending
    pauses. The next ``flush()`` raises that error; the one after it retries the buffered
    messages. (An ``enqueue()`` that finds the buffer full does the same, so it never waits
    on a paused sender.) A send whose reply was lost may have been applied: its retry can
    store a message twice, with the same pid (at-least-once). ``close()`` reports whatever
    could not be sent by raising; nothing is dropped silently.
    """

    def __init__(self, client: Any, namespace: str, *, max_buffer: int = 10_000) -> None:
        if max_buffer < 1:
            raise ValueError("max_buffer must be at least 1")
        self._client = client
        self._namespace = namespace
        self._max_buffer = max_buffer
        self._pending: dict[str, list[bytes]] = {}  # ready key -> envelopes, oldest first
        self._accepted = 0  # messages handed over so far
        self._sent = 0  # messages confirmed; since sends are in order, all before this one
        self._error: BaseException | None = None  # a send error not yet reported
        self._paused = False  # after a send error, until the next flush asks for a retry
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Messages handed over but not yet confirmed by Redis."""
        return self._accepted - self._sent

    async def enqueue(self, queue: str, payload: dict[str, Any]) -> str:
        """Hand one message over; returns its pid. Waits only while the buffer is full."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        pid, raw = envelope.build(queue, payload)
        changed = self._start()
        async with changed:
            while self.pending >= self._max_buffer:
                self._raise_error_or_resume()  # a paused sender would never make room
                await changed.wait()
            self._pending.setdefault(QueueKeys(self._namespace, queue).ready, []).append(raw)
            self._accepted += 1
            changed.notify_all()
        return pid

    async def flush(self) -> None:
        """Wait until every message handed over so far is in Redis.

        Raises ``PublishError`` (caused by the client's error) for the first send failure
        not reported yet; its messages stay buffered, and the next call sends them again.
        """
        if self._changed is None:
            return
        target = self._accepted
        async with self._changed:
            self._raise_error_or_resume()
            while self._sent < target:
                await self._changed.wait()
                self._raise_error_or_resume()

    async def close(self) -> None:
        """Flush, then stop the background task (also when the flush raises)."""
        try:
            await self.flush()
        finally:
            self._closed = True
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task

    def _start(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._changed

    def _raise_error_or_resume(self) -> None:
        """Report a send error not reported yet; once it has been, resume sending."""
        assert self._changed is not None
        if self._error is not None:
            error, self._error = self._error, None
            raise PublishError(f"publishing failed: {error}", self.pending) from error
        if self._paused:
            self._paused = False
            self._changed.notify_all()

    async def _run(self) -> None:
        changed = self._changed
        assert changed is not None
        while True:
            async with changed:
                await changed.wait_for(lambda: bool(self._pending) and not self._paused)
                batch, self._pending = self._pending, {}
                end = self._accepted
            failed, error = await self._send(batch)
            async with changed:
                if error is None:
                    self._sent = end  # the whole batch, and with it every earlier message
                else:
                    self._requeue(failed)
                    self._error, self._paused = error, True
                changed.notify_all()

    async def _send(
        self, batch: dict[str, list[bytes]]
    ) -> tuple[dict[str, list[bytes]], BaseException | None]:
        """Send a batch; returns what must be sent again and the first error."""
        commands = _chunks(batch)
        pipe = self._client.pipeline(transaction=False)
        for key, values in commands:
            pipe.lpush(key, *values)
        try:
            results = await pipe.execute(raise_on_error=False)
        except Exception as error:  # the connection failed: any part may be missing
            return batch, error
        failed: dict[str, list[bytes]] = {}
        first: BaseException | None = None
        for (key, values), result in zip(commands, results, strict=True):
            if isinstance(result, Exception):
                failed.setdefault(key, []).extend(values)
                first = first or result
        return failed, first

    def _requeue(self, batch: dict[str, list[bytes]]) -> None:
        """Put a failed batch back ahead of what arrived since, keeping each queue's order."""
        for key, values in self._pending.items():
            batch.setdefault(key, []).extend(values)
        self._pending = batch


async def _push(
    client: Any, values_by_key: dict[str, list[bytes]], replication: Replication = NO_WAIT
) -> None:
    """LPUSH each key's values in order, 1,000 per command, all in one round trip."""
    if replication.enabled:
        for key, values in values_by_key.items():
            commands = [("LPUSH", key, *chunk) for _, chunk in _chunks({key: values})]
            results, confirmed = await write_and_wait(client, key, commands, replication)
            error = next((r for r in results if isinstance(r, Exception)), None)
            if error is not None:
                raise error
            if confirmed < replication.replicas:
                raise NotReplicated(f"publish of {len(values)} to {key}", confirmed,
                                    replication.replicas)
        return
    pipe = client.pipeline(transaction=False)
    for key, values in _chunks(values_by_key):
        pipe.lpush(key, *values)
    await pipe.execute()


def _chunks(values_by_key: dict[str, list[bytes]]) -> list[tuple[str, list[bytes]]]:
    return [
        (key, values[start:start + MAX_BATCH])
        for key, values in values_by_key.items()
        for start in range(0, len(values), MAX_BATCH)
    ]
