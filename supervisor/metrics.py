"""Figures of one supervisor: counters, gauges and latency histograms; health checks.

The arbiter calls a few small methods (``received``, ``settled``, ``broker_call`` ...).
With ``[supervisor] metrics_port = 0`` they only keep the throughput for the systemd
status line; with a port, they also feed a Prometheus registry served as text on
``http://<metrics_host>:<metrics_port>/metrics``, beside ``/healthz`` (the main loop goes
round) and ``/readyz`` (connected, a handler process ready, not stopping); any other path
is 404. The queue's sizes (ready, failed, dead ...) come from a sample the arbiter takes
every few seconds (``supervisor.gauges``), never from a scrape: a scrape reads figures
already kept and costs the broker nothing.

Only the supervisor serves the endpoint (``supervisor.metrics_http``), from a thread
started after the fork server exists (children are forked from a process without threads).
The arbiter's calls come from the event loop thread; prometheus-client locks each update,
and the arbiter passes counts per batch, so the cost per message stays small.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import platform
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Any

from broker.base import Action
from broker.gauges import QueueGauges
from supervisor import failures
from supervisor.figures import CpuClock, Figures, QueueWait, Timestamped
from supervisor.metrics_http import Endpoint, exposure_warning, routes

log = logging.getLogger("supervisor.metrics")

PREFIX = "queue_supervisor"
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
#: /healthz fails once the supervisor's main loop has not gone round for this long (s).
STALE_LOOP = 10.0

#: Error classes the rejects counter names by label, the first ones seen; later ones count
#: as "other" (a label set that grows with whatever handlers raise would grow the series,
#: and a counter's label cannot be taken back once scraped). The supervisor's own classes
#: (a timeout, a lost handler process) are always named, beside these.
ERROR_CLASSES = 10
#: Characters of an error class a label keeps (a class name is short; a module path may not be).
ERROR_CLASS_CHARS = 100
#: What became of a rejected job, as its outcome line says it (``supervisor.failures``).
OUTCOMES = ("retrying", "failed", "dead")

#: Queue gauges: QueueGauges field -> (metric name after the prefix, help).
QUEUE_GAUGES = {
    "ready": ("ready_messages", "messages waiting to be received (NATS: the consumer's "
              "num_pending)"),
    "oldest_ready_age": ("oldest_ready_age_seconds", "how long the next message to be "
                         "received has waited (0: none waits)"),
    "processing": ("processing_messages", "messages received by a consumer, not settled "
                   "(NATS: num_ack_pending)"),
    "failed": ("failed_messages", "failed list: out of attempts (Redis)"),
    "dead": ("dead_messages", "dead list (Redis) or dead-letter stream (NATS)"),
    "poison": ("poison_messages", "undecodable messages kept in poison (Redis)"),
    "delayed": ("delayed_messages", "retries waiting for their backoff (Redis)"),
    "delayed_overdue": ("delayed_overdue_seconds", "how long the oldest delayed retry has "
                        "been due without being moved to the ready list (0: none is; "
                        "Redis: every supervisor's maintenance moves them)"),
    "redelivered": ("redelivered_messages", "delivered more than once, not acked (NATS)"),
    "supervisors_alive": ("supervisors_alive", "supervisors of the queue whose last renewal "
                          "is current (Redis token registry)"),
    "leaderless_seconds": ("nats_leaderless_seconds", "how long the JetStream API has had no "
                           "leader for the queue (0: it has one)"),
}
#: Running counts the broker keeps: QueueGauges field -> (counter name without _total, help).
QUEUE_COUNTERS = {
    "reconnects": ("broker_reconnects", "broker connections made again after one broke"),
    "unreplicated": ("unreplicated_writes", "writes fewer replicas confirmed than "
                     "[broker] wait_replicas asks"),
}


class Throughput:
    """Settled jobs per second over roughly the last ``window`` seconds."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.total = 0
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])

    def add(self, n: int) -> None:
        self.total += n

    def per_second(self) -> float:
        now = self._clock()
        self._samples.append((now, self.total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        since, count = self._samples[0]
        return (self.total - count) / (now - since) if now > since else 0.0


class Metrics:
    """Disabled metrics: no endpoint, only the throughput (systemd STATUS) and the running
    counts the progress and stop lines print."""

    def __init__(self) -> None:
        self.throughput = Throughput()
        self.counts: collections.Counter[str] = collections.Counter()
        #: How long the claimed messages waited in the queue (``supervisor.figures``).
        self.wait = QueueWait()
        #: prefetch, handler processes ([job] coroutines), tasks per process (``shape``).
        self.shaped = (0, 0, 0)
        self._cpu: CpuClock | None = None

    @property
    def enabled(self) -> bool:
        return False

    def received(self, n: int) -> None:
        """``n`` deliveries were claimed."""
        self.counts["received"] += n

    def settled(self, action: Action | str, n: int = 1) -> None:
        """``n`` settlements of ``action`` (commit, reject, release) were confirmed."""
        if action.__class__ is not Action:  # Action(member) costs an enum lookup per job
            action = Action(action)
        self.counts[action.value] += n
        if action is not Action.RELEASE:
            self.throughput.add(n)

    def waited(self, deliveries: Iterable[Timestamped]) -> None:
        """These deliveries were just claimed (their queue wait)."""
        self.wait.add(deliveries)

    def shape(self, prefetch: int, processes: int, tasks: int) -> None:
        """The supervisor's prefetch, handler processes ([job] coroutines) and the jobs
        each runs at once."""
        self.shaped = (prefetch, processes, tasks)

    def cpu_seconds(self) -> float:
        """CPU seconds of this supervisor and its children so far."""
        if self._cpu is None:
            self._cpu = CpuClock()
        return self._cpu.seconds()

    def figures(self, now: float | None = None) -> Figures:
        """The figures the running jobs' copy carries (``supervisor.figures``)."""
        c = self.counts
        wait = self.wait.percentiles()
        return Figures(
            time.monotonic() if now is None else now, *self.shaped,
            done=c["commit"], failed=c["reject"], retried=c["retried"],
            reserved=c["received"], reserve_calls=c["reserve_calls"],
            settled=c["settle_messages"], settle_calls=c["settle_calls"],
            cpu=round(self.cpu_seconds(), 3),
            wait_p50=wait[0] if wait else None, wait_p99=wait[1] if wait else None)

    def uncertain(self, n: int = 1) -> None:
        """``n`` settlements were sent but their reply was lost."""
        self.counts["uncertain"] += n

    def stale(self, n: int = 1) -> None:
        """``n`` settlements found the delivery recovered by another consumer."""
        self.counts["stale"] += n

    def malformed(self, n: int = 1) -> None:
        """``n`` messages could not be decoded and went to poison."""
        self.counts["malformed"] += n

    def summary(self) -> str:
        """The running counts as the progress and stop lines print them."""
        c = self.counts
        return (f"{c['commit']} done, {c['reject']} failed, {c['release']} released, "
                f"{c['malformed']} malformed, {c['uncertain']} uncertain, {c['stale']} stale")

    def child_restart(self) -> None:
        """A handler process died unexpectedly and was replaced."""

    def taken_back(self, n: int) -> None:
        """``n`` deliveries a handler process had not started were handed to others
        (supervisor.dispatch: it stalled, or held more than the pace of jobs allows)."""

    def buffer(self, outstanding: int, prefetch: int, busy: int) -> None:
        """Deliveries outstanding of ``prefetch``; handler processes running a message."""

    def settle_batch(self, size: int, seconds: float) -> None:
        """One settlement call of ``size`` deliveries took ``seconds``."""
        self.counts["settle_calls"] += 1
        self.counts["settle_messages"] += size

    def broker_call(self, operation: str, seconds: float) -> None:
        """One broker call (receive, settle, extend, maintain ...) took ``seconds``."""
        if operation == "receive":
            self.counts["reserve_calls"] += 1

    def handler_done(self, seconds: float) -> None:
        """A handler ran for ``seconds`` (started to outcome, as its process timed it)."""

    def handlers_done(self, seconds: Iterable[float]) -> None:
        """``handler_done`` for each of several runs (one call per batch of outcomes)."""

    def rejected(self, outcome: str, error: str) -> None:
        """A failed run was settled: what became of its job (``retrying in 2 s``,
        ``failed``, ``dead``, ``outcome unknown: ...``) and its error class."""
        if outcome.startswith("retrying"):
            self.counts["retried"] += 1

    def running(self, oldest: float, slow: int) -> None:
        """The oldest running job has run ``oldest`` s; ``slow`` run past slow_job_after."""
        self.wait.roll(int(time.time()))  # each second: the last second's claims counted

    @contextlib.contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        """``with metrics.timed("extend"): await broker.extend(...)``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.broker_call(operation, time.perf_counter() - began)

    def beat(self) -> None:
        """The main loop went round (what /healthz checks)."""

    def readiness(self, reason: str | None) -> None:
        """Why the supervisor is not ready now, or None when it is (what /readyz says)."""

    def gauges(self, sample: QueueGauges | None, broker_error: str | None = None) -> None:
        """The last sample of the queue (None and ``broker_error``: it failed)."""

    def close(self) -> None:
        """Stop serving (nothing to stop when disabled)."""


class Health:
    """What /healthz and /readyz answer. The event loop writes it, the endpoint's thread
    reads it: each field is replaced by one assignment, so no lock is needed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.last_beat: float | None = None  # None: the main loop has not started yet
        self.not_ready: str | None = "starting"

    def beat(self) -> None:
        self.last_beat = self._clock()

    def alive(self) -> tuple[bool, str]:
        if self.last_beat is None:
            return True, "starting"  # connecting: bounded by the broker's connect timeout
        stalled = self._clock() - self.last_beat
        if stalled > STALE_LOOP:
            return False, (f"the supervisor's main loop has not gone round for {stalled:.0f}s "
                           f"(more than {STALE_LOOP:g}s): it is stuck")
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        reason = self.not_ready
        return reason is None, reason or "ok"


class PrometheusMetrics(Metrics):
    """The same calls, recorded in a registry of our own and served over HTTP."""

    def __init__(self, queue: str, port: int, host: str = "127.0.0.1",
                 broker: str = "redis") -> None:
        from prometheus_client import CollectorRegistry, make_wsgi_app

        super().__init__()
        self.registry = CollectorRegistry()
        self.health = Health()
        self._build(queue, broker)
        self._queue_figures = QueueFigures(queue, self.health)
        self.registry.register(self._queue_figures)
        self.registry.register(SupervisorFigures(queue, self))
        app = routes(make_wsgi_app(self.registry), self.health)
        self._endpoint = Endpoint(app, host, port)
        self.port = self._endpoint.port

    @property
    def enabled(self) -> bool:
        return True

    def _build(self, queue: str, broker: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, doc: str) -> Any:
            metric = Counter(f"{PREFIX}_{name}", doc, ["queue"], registry=self.registry)
            return metric.labels(queue)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"{PREFIX}_{name}", doc, ["queue"], registry=self.registry).labels(queue)

        self._received = counter("deliveries_received", "deliveries claimed from the broker")
        self._settled = {
            Action.COMMIT: counter("deliveries_committed", "commits the broker confirmed"),
            Action.REJECT: counter("deliveries_rejected", "rejects (retry, failed or dead)"),
            Action.RELEASE: counter("deliveries_released", "releases of never-started work"),
        }
        self._uncertain = counter("deliveries_uncertain", "settlements whose reply was lost")
        self._stale = counter("deliveries_stale", "settlements of deliveries recovered meanwhile")
        self._malformed = counter("malformed", "undecodable messages moved to poison")
        self._restarts = counter("child_restarts", "handler processes replaced after dying")
        self._taken_back = counter("deliveries_taken_back", "deliveries a stalled handler "
                                   "process had not started, handed to the others")
        self._outstanding = gauge("buffer_outstanding", "deliveries not yet settled")
        self._prefetch = gauge("buffer_prefetch", "bound on outstanding deliveries")
        self._busy = gauge("busy_handlers", "handler processes running a message")
        self._processes = gauge("handler_processes", "handler processes ([job] coroutines)")
        self._tasks = gauge("handler_tasks_per_process", "jobs each handler process runs at "
                            "once (1: a plain handler; [job] tasks_per_process: async)")
        self._batch = Histogram(
            f"{PREFIX}_settle_batch_size", "deliveries per settlement call", ["queue"],
            buckets=BATCH_BUCKETS, registry=self.registry,
        ).labels(queue)
        calls = Histogram(
            f"{PREFIX}_broker_call_seconds", "broker call latency by operation",
            ["queue", "operation"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._call: Callable[[str], Histogram] = lambda operation: calls.labels(queue, operation)
        self._handler = Histogram(
            f"{PREFIX}_handler_seconds", "handler duration, started to outcome", ["queue"],
            buckets=HANDLER_BUCKETS, registry=self.registry,
        ).labels(queue)
        self._rejects = Counter(
            f"{PREFIX}_rejects", "failed runs settled, by what became of the job (retrying, "
            "failed, dead, unknown) and the error class (the first "
            f"{ERROR_CLASSES} seen by name, then other)", ["queue", "outcome", "error"],
            registry=self.registry)
        self._error_classes = Bounded(ERROR_CLASSES, always=(failures.TIMEOUT, failures.LOST))
        self._oldest_running = gauge("oldest_running_seconds",
                                     "how long the oldest job running now has run (0: none)")
        self._slow_jobs = gauge("slow_jobs", "jobs running past [job] slow_job_after now")
        self._queue = queue
        Gauge(f"{PREFIX}_build_info", "this supervisor's version, Python and broker (value 1)",
              ["queue", "version", "python", "broker"], registry=self.registry,
              ).labels(queue, _version(), platform.python_version(), broker).set(1)

    def received(self, n: int) -> None:
        super().received(n)
        self._received.inc(n)

    def settled(self, action: Action | str, n: int = 1) -> None:
        super().settled(action, n)
        self._settled[Action(action)].inc(n)

    def uncertain(self, n: int = 1) -> None:
        super().uncertain(n)
        self._uncertain.inc(n)

    def stale(self, n: int = 1) -> None:
        super().stale(n)
        self._stale.inc(n)

    def malformed(self, n: int = 1) -> None:
        super().malformed(n)
        self._malformed.inc(n)

    def child_restart(self) -> None:
        self._restarts.inc()

    def taken_back(self, n: int) -> None:
        self._taken_back.inc(n)

    def buffer(self, outstanding: int, prefetch: int, busy: int) -> None:
        self._outstanding.set(outstanding)
        self._prefetch.set(prefetch)
        self._busy.set(busy)

    def settle_batch(self, size: int, seconds: float) -> None:
        super().settle_batch(size, seconds)
        self._batch.observe(size)
        self.broker_call("settle", seconds)

    def broker_call(self, operation: str, seconds: float) -> None:
        super().broker_call(operation, seconds)
        self._call(operation).observe(seconds)

    def handler_done(self, seconds: float) -> None:
        self._handler.observe(seconds)

    def handlers_done(self, seconds: Iterable[float]) -> None:
        observe = self._handler.observe
        for each in seconds:
            observe(each)

    def rejected(self, outcome: str, error: str) -> None:
        super().rejected(outcome, error)
        self._rejects.labels(self._queue, outcome_label(outcome),
                             self._error_classes.label(error)).inc()

    def shape(self, prefetch: int, processes: int, tasks: int) -> None:
        super().shape(prefetch, processes, tasks)
        self._processes.set(processes)
        self._tasks.set(tasks)

    def running(self, oldest: float, slow: int) -> None:
        super().running(oldest, slow)
        self._oldest_running.set(oldest)
        self._slow_jobs.set(slow)

    def beat(self) -> None:
        self.health.beat()

    def readiness(self, reason: str | None) -> None:
        self.health.not_ready = reason

    def gauges(self, sample: QueueGauges | None, broker_error: str | None = None) -> None:
        self._queue_figures.last = (sample, broker_error)

    def close(self) -> None:
        self._endpoint.close()


class Bounded:
    """Label values of an open set (error classes), at most ``limit`` of them besides the
    ``always`` ones: the first seen keep their name, any other is ``other``."""

    def __init__(self, limit: int, always: Iterable[str] = ()) -> None:
        self.limit = limit
        self._always = frozenset(always)
        self._named: set[str] = set()

    def label(self, value: str) -> str:
        value = value[:ERROR_CLASS_CHARS] or "unknown"
        if value in self._always or value in self._named:
            return value
        if len(self._named) < self.limit and value != "other":
            self._named.add(value)
            return value
        return "other"


def outcome_label(outcome: str) -> str:
    """``retrying``, ``failed``, ``dead`` or ``unknown`` (stale, or the reply was lost)."""
    word = outcome.partition(" ")[0]
    return word if word in OUTCOMES else "unknown"


class QueueFigures:
    """A Prometheus collector of the last queue sample, read at each scrape (a gauge not
    known, e.g. no failed list on NATS, is left out rather than shown as 0)."""

    def __init__(self, queue: str, health: Health) -> None:
        self.queue = queue
        self.health = health
        #: The last sample (None before the first) and, if the last try failed, why.
        self.last: tuple[QueueGauges | None, str | None] = (None, None)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sample, broker_error = self.last
        labels = [self.queue]

        def gauge(name: str, doc: str, value: float) -> Any:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["queue"])
            family.add_metric(labels, value)
            return family

        yield gauge("ready", "1 while /readyz answers 200: connected to the broker, a handler "
                    "process ready, not stopping", 1 if self.health.ready()[0] else 0)
        if sample is None and broker_error is None:
            return  # no sample yet
        yield gauge("broker_up", "1 when the last sample of the queue reached the broker",
                    0 if broker_error else 1)
        if sample is None:
            return
        for field, (name, doc) in QUEUE_GAUGES.items():
            value = getattr(sample, field)
            if value is not None:
                yield gauge(name, doc, value)
        for field, (name, doc) in QUEUE_COUNTERS.items():
            value = getattr(sample, field)
            if value is not None:
                family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["queue"])
                family.add_metric(labels, value)
                yield family


class SupervisorFigures:
    """A Prometheus collector of what is read at a scrape, not counted per job: the CPU
    seconds of the supervisor and its children (psutil) and the queue wait histogram."""

    def __init__(self, queue: str, metrics: Metrics) -> None:
        self.queue = queue
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        cpu = CounterMetricFamily(f"{PREFIX}_cpu_seconds", "CPU seconds (user + system) of "
                                  "the supervisor and its children", labels=["queue"])
        cpu.add_metric([self.queue], self.metrics.cpu_seconds())
        yield cpu
        cumulative, count, total = self.metrics.wait.buckets()
        wait = HistogramMetricFamily(
            f"{PREFIX}_queue_wait_seconds", "claim time minus the envelope's timestamp, in "
            "whole seconds (queue 5 writes it so): 0 is within the second", labels=["queue"])
        wait.add_metric([self.queue], [(_bound(bound), n) for bound, n in cumulative]
                        + [("+Inf", count)], total)
        yield wait


def _bound(value: float) -> str:
    return str(float(value))  # "1.0", as prometheus-client writes its own bounds


def _version() -> str:
    try:
        return metadata.version("queue-supervisor")
    except metadata.PackageNotFoundError:
        return "unknown"


def start(queue: str, port: int, host: str = "127.0.0.1", broker: str = "redis") -> Metrics:
    """Serve metrics on ``host:port``; ``port`` 0 means off (no-op metrics). ``broker``
    ("redis", "nats") is a label of the build info.

    Call it in the supervisor after the fork server started: it starts a thread.
    """
    if not port:
        return Metrics()
    warning = exposure_warning(host)
    if warning:
        log.warning("%s", warning)
    return PrometheusMetrics(queue, port, host, broker)
