"""The queue gauges: sampled by the supervisor every ``SAMPLE_PERIOD`` seconds, off the
hot path, whatever the scrape rate (a scrape reads the last sample; a sample costs one
pipeline of O(1) reads on Redis, three JetStream API requests on NATS).

Only with the metrics endpoint on. The broker's own sampler (``broker.redis.gauges``,
``broker.nats.gauges``) reads the figures; here they are timed, kept, and turned into what
a single reading cannot tell: how long the NATS queue has been without a leader.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable

from broker.base import Broker
from broker.gauges import QueueGauges

#: Seconds between two samples (a scrape in between reads the last one).
SAMPLE_PERIOD = 5.0

Sample = Callable[[], Awaitable[QueueGauges]]


def sampler_of(broker: Broker) -> Sample | None:
    """The broker's sampler, or None for a broker that has none (the in-memory one)."""
    from broker.nats.broker import NatsBroker
    from broker.redis.broker import RedisBroker

    if isinstance(broker, RedisBroker):
        from broker.redis.gauges import sample as redis_sample

        return lambda: redis_sample(broker)
    if isinstance(broker, NatsBroker):
        from broker.nats.gauges import sample as nats_sample

        return lambda: nats_sample(broker)
    return None


class Leadership:
    """How long the JetStream API has had no leader for the queue, from samples."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None  # first sample without a leader, in a row

    def seen(self, gauges: QueueGauges) -> QueueGauges:
        """The sample with ``leaderless_seconds`` filled in (NATS; Redis has none)."""
        if gauges.leader is None:
            return gauges
        now = self._clock()
        if gauges.leader:
            self._since = None
        elif self._since is None:
            self._since = now
        leaderless = 0.0 if self._since is None else now - self._since
        return dataclasses.replace(gauges, leaderless_seconds=leaderless)
