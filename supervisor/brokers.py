"""Choose the broker adapter for a job from its URL scheme."""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.base import (
    Broker,
    EnvelopeLimited,
    Identified,
    Leased,
    PushesArrivals,
    RecordsRunning,
    ReservesAhead,
    WatchesConnection,
)
from broker.urls import broker_kind
from supervisor.config import Config

if TYPE_CHECKING:
    from broker.memory import MemoryBroker
    from broker.nats import NatsBroker
    from broker.redis import RedisBroker


def make_broker(config: Config, *, supervisor: bool = False) -> Broker:
    """``supervisor``: the broker of a running supervisor (on NATS it answers ``check``
    and ``drain``; an operator command's broker stays silent)."""
    kind = broker_kind(config.broker.url)
    job, sup = config.job, config.supervisor
    if kind == "redis":
        from broker.redis import RedisBroker

        return RedisBroker(
            config.broker.url, job.queue, namespace=config.broker.namespace,
            cluster=config.broker.cluster, lease=sup.lease, max_attempts=job.max_attempts,
            job_ttl=job.job_ttl, recovery_age=sup.recovery_age,
            retry_backoff=job.retry_backoff, retry_backoff_max=job.retry_backoff_max,
            maintenance_interval=sup.maintenance_interval,
            max_envelope_bytes=sup.envelope_limit(), tls=config.broker.tls,
            replication=config.broker.replication,
        )
    if kind == "nats":
        from broker.nats import NatsBroker

        return NatsBroker(
            config.broker.url, job.queue, ack_wait=config.nats.ack_wait,
            max_attempts=job.max_attempts, retry_backoff=job.retry_backoff,
            retry_backoff_max=job.retry_backoff_max, namespace=config.broker.namespace,
            max_envelope_bytes=sup.envelope_limit(), job_ttl=job.job_ttl,
            replicas=config.nats.replicas, tls=config.broker.tls, announce=supervisor,
        )
    raise AssertionError(kind)


if TYPE_CHECKING:
    # The features each adapter offers (broker.base): the supervisor finds them with
    # isinstance, which looks only at names; here mypy checks the types.
    Features = tuple[Leased, Identified, ReservesAhead, RecordsRunning, EnvelopeLimited,
                     Leased, WatchesConnection, PushesArrivals, ReservesAhead]

    def _offered(redis: RedisBroker, nats: NatsBroker, memory: MemoryBroker) -> Features:
        return redis, redis, redis, redis, redis, nats, nats, nats, memory
