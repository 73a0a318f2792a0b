"""What the supervisor tells about itself, beside the arbiter's data path.

READY, STATUS and the watchdog pings to systemd (supervisor.systemd), the reason /readyz
answers 503, the process title, a progress line now and then, and the queue gauges of the
metrics endpoint (supervisor.gauges). All of it reads the arbiter's state; the one thing
it writes there is the gauge sampler's entry in ``broker_trouble`` (/readyz reads it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import setproctitle

from broker.base import Broker, BrokerError
from supervisor import gauges, systemd
from supervisor.buffer import Buffer
from supervisor.config import Config
from supervisor.handlers import HandlerPlace
from supervisor.metrics import Metrics
from supervisor.outage import Outage, unreachable

log = logging.getLogger("supervisor")


class State(Protocol):
    """What the reporter reads of the arbiter (and, for its sampler, ``broker_trouble``)."""

    connected: bool  # to the broker
    stopping: bool
    closed: bool  # the background loops end
    #: The last error of each broker-facing loop still failing (receive, sample: ours).
    broker_trouble: dict[str, str]
    first_renewal: asyncio.Event  # on Redis it registers this supervisor


class Reporter:
    """The supervisor's readiness, title, progress line and queue gauges."""

    def __init__(
        self,
        config: Config,
        broker: Broker,
        buffer: Buffer,
        places: list[HandlerPlace],
        metrics: Metrics,
        notifier: systemd.Notifier,
        outage: Outage,
        arbiter: State,
        *,
        concurrent: bool,
    ) -> None:
        self.config = config
        self.broker = broker
        self.buffer = buffer
        self.places = places
        self.metrics = metrics
        self.notifier = notifier
        self.outage = outage
        self.arbiter = arbiter
        self.concurrent = concurrent  # async def: the title counts running tasks
        self.ready = asyncio.Event()  # READY was told (the keepalive loop starts then)

    def notify_ready_once(self) -> None:
        """READY=1 once the broker is connected and every handler process is up."""
        if self.ready.is_set() or not self.arbiter.connected or self.arbiter.stopping:
            return
        if all(place.ready for place in self.places):
            self.update_title()  # "running" before systemd (and a person) hears it
            self.ready.set()
            self.metrics.readiness(self.not_ready())
            if self.notifier.ready():
                log.info("ready: told systemd")

    def not_ready(self) -> str | None:
        """Why /readyz answers 503 now (one line), or None when it answers 200."""
        if self.arbiter.stopping:
            return "stopping: taking no more work"
        if not self.arbiter.connected:
            return "connecting to the broker"
        if self.arbiter.broker_trouble:
            return f"broker unreachable: {next(iter(self.arbiter.broker_trouble.values()))}"
        if not any(place.accepting for place in self.places):
            alive = sum(place.alive for place in self.places)
            return (f"no handler process ready to take work ({alive} of {len(self.places)} "
                    "started, none ready)")
        return None

    def update_title(self) -> None:
        busy, running = self.buffer.busy()
        self.metrics.buffer(self.buffer.outstanding, self.buffer.prefetch, busy)
        state = "stopping" if self.arbiter.stopping else "running"
        tasks = f", {running} running" if self.concurrent else ""
        setproctitle.setproctitle(
            f"queue-supervisor: {self.config.job.queue} {state} "
            f"[buffer {self.buffer.outstanding}/{self.buffer.prefetch}, "
            f"{busy}/{len(self.places)} busy{tasks}]"
        )

    async def keepalive_loop(self) -> None:
        """STATUS and WATCHDOG pings from this loop, from READY on (systemd's watchdog
        starts with the service's start-up completed)."""
        await self.ready.wait()
        await systemd.keepalive(self.notifier, self.status_text)

    def status_text(self) -> str:
        return systemd.status_text(
            self.buffer.outstanding, self.buffer.prefetch, self.metrics.throughput.per_second()
        )

    async def progress_loop(self) -> None:
        """An info line now and then: what a person tailing the log wants to know."""
        period = self.config.supervisor.progress_interval
        while period and not self.arbiter.closed:
            await asyncio.sleep(period)
            began = self.outage.now()
            try:
                age = await self.broker.oldest_ready_age()
            except (BrokerError, OSError) as error:
                oldest = f"unknown ({error})"
                if unreachable(error):
                    self.outage.lost(error, began)
                    oldest = "unknown (the broker is unreachable)"
            else:
                self.outage.back(began)
                oldest = "none waiting" if age is None else f"{age:.1f}s"
            log.info("progress: %.1f jobs/s, %s; outstanding %d/%d; oldest ready %s",
                     self.metrics.throughput.per_second(), self.metrics.summary(),
                     self.buffer.outstanding, self.buffer.prefetch, oldest)

    async def sample_loop(self) -> None:
        """The queue gauges of the metrics endpoint, every SAMPLE_PERIOD (metrics on only)."""
        sample = gauges.sampler_of(self.broker) if self.metrics.enabled else None
        leadership = gauges.Leadership()
        # On Redis the first renewal registers us: "supervisors alive" counts us.
        await self.arbiter.first_renewal.wait()
        while sample is not None and not self.arbiter.closed:
            try:
                with self.metrics.timed("sample"):
                    figures = leadership.seen(await sample())
            except (BrokerError, OSError) as error:
                self.arbiter.broker_trouble["sample"] = str(error)
                self.metrics.gauges(None, str(error))
            else:
                self.arbiter.broker_trouble.pop("sample", None)
                self.metrics.gauges(figures)
            await asyncio.sleep(gauges.SAMPLE_PERIOD)
