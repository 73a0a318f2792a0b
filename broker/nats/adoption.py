"""The queue's settings as adopted from its stream and consumer, kept current.

Every new connection adopts them again (``adopt``: a reconnection may find them rewritten
by queue-5 PHP workers); what differs from what this broker would have created is logged
once per change (``use``). The consumer is shared, so its attempt budget is read again
before a verdict that depends on it (``refresh``: one read at a time however many wait).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from broker.base import BrokerError
from broker.nats import version
from broker.nats.conn import Connection
from broker.nats.link import RETRYABLE
from broker.nats.setup import (
    SPARE_DELIVERY,
    UNLIMITED,
    Adopted,
    QueueNames,
    Wanted,
    adopt_queue,
    check_renamed,
    deliver_limit,
    read_consumer_policy,
    reread_consumer,
)

log = logging.getLogger("broker.nats")

#: Seconds each JetStream API call of a reconnection's setup may take (then tried again).
RECONNECT_SETUP_TIMEOUT = 1.0


class Adoption:
    """One queue's adopted settings (``policy``, None before the first connection)."""

    def __init__(
        self, queue: str, names: QueueNames, wanted: Wanted, timeout: float,
        connection: Callable[[float], Awaitable[Connection]],
    ) -> None:
        self.queue = queue
        self._names = names
        self._wanted = wanted
        self._timeout = timeout
        self._connection = connection
        self.policy: Adopted | None = None
        self.read_at = 0.0  # time.monotonic() of the last read of the consumer
        self._rereading: asyncio.Future[None] | None = None  # see refresh

    def close(self) -> None:
        if self._rereading is not None:
            self._rereading.cancel()

    async def adopt(self, conn: Connection) -> None:
        """A new connection: check the server, adopt the queue's stream and consumer."""
        # A reconnection, often to a cluster electing leaders (where the API stays silent
        # until it has one): shorter tries, so the first answer after the election is taken.
        timeout = self._timeout if self.policy is None else min(self._timeout,
                                                                RECONNECT_SETUP_TIMEOUT)
        try:
            # Before anything is created: an old server drops what the setup relies on.
            version.check(conn.server, conn.server_info)
            if self.policy is None:
                await check_renamed(conn, self.queue, self._wanted, timeout)
            policy = await adopt_queue(conn, self._names, self._wanted, timeout)
        except BrokerError as error:
            if self.policy is None or isinstance(error, RETRYABLE):
                raise  # at start, a refusal stops us; a reconnect never refuses
            log.error("NATS queue %s: its settings changed into ones a start would refuse "
                      "(%s); carrying on with %s", self.queue, error, self.policy.describe())
            policy = self.policy
        self.use(policy)
        self.read_at = time.monotonic()

    def use(self, policy: Adopted) -> None:
        previous, self.policy = self.policy, policy
        if previous == policy:
            return
        log.info("NATS queue %s: %s", self.queue, policy.describe())
        if policy.budget != self._wanted.max_attempts:
            log.warning("NATS consumer %r on %s allows %d attempts; [job] max_attempts = %d "
                        "only applies to a consumer this supervisor creates (the consumer's "
                        "budget is shared with every worker of the queue, so it wins)",
                        self._names.consumer, self._names.stream, policy.budget,
                        self._wanted.max_attempts)
        if policy.max_deliver == UNLIMITED:
            log.warning("NATS consumer %r on %s keeps no spare delivery and has no delivery "
                        "limit (MaxDeliver %d): a job whose every run dies unsettled (it "
                        "kills its worker, say) is delivered again without end, as under "
                        "queue 5; a MaxDeliver with the %s mark bounds it",
                        self._names.consumer, self._names.stream, policy.max_deliver,
                        SPARE_DELIVERY)
        elif policy.spare is None:
            log.warning("NATS consumer %r on %s keeps no spare delivery (MaxDeliver %d "
                        "without %s): a job whose last delivery dies unsettled is only "
                        "dead-lettered if a worker receives the server's advisory",
                        self._names.consumer, self._names.stream, policy.max_deliver,
                        SPARE_DELIVERY)
        if policy.replicas != self._wanted.replicas:
            log.warning("NATS stream %s has %d replicas; [nats] replicas = %d only applies to "
                        "a stream this supervisor creates (an existing one is adopted as it is)",
                        self._names.stream, policy.replicas, self._wanted.replicas)
        if policy.lease < self._wanted.ack_wait:
            log.warning("NATS consumer %r on %s waits %gs for an ack; deliveries are renewed "
                        "every %gs", self._names.consumer, self._names.stream, policy.lease,
                        policy.lease / 3)

    async def refresh(self) -> None:
        """Read the consumer's budget again: one request at a time however many verdicts
        wait for it, so a burst of jobs at their last attempt costs one read per round trip.
        Queue 5 does the same before it parks a delivery at the spare."""
        if self._rereading is None or self._rereading.done():
            self._rereading = asyncio.ensure_future(self._reread())
        await asyncio.shield(self._rereading)

    async def _reread(self) -> None:
        self.read_at = time.monotonic()  # failed or not: maintenance asks again later
        try:
            conn = await self._connection(self._timeout)
            consumer = await reread_consumer(conn, self._names, self._timeout)
        except BrokerError as error:
            log.warning("could not re-read NATS consumer %r (%s); using its last settings",
                        self._names.consumer, error)
            return
        budget, spare = read_consumer_policy(consumer, self._wanted.max_attempts)
        current = self.current()
        if (budget, spare) != (current.budget, current.spare):
            self.use(dataclasses.replace(current, budget=budget, spare=spare,
                                         max_deliver=deliver_limit(consumer.get("max_deliver"))))

    def current(self) -> Adopted:
        """The settings adopted; BrokerError before the first connection."""
        if self.policy is None:
            raise BrokerError("not connected yet")
        return self.policy
