"""Figures of one supervisor: counters, gauges and latency histograms.

The arbiter calls a few small methods (``received``, ``settled``, ``broker_call`` ...).
With ``[supervisor] metrics_port = 0`` they only keep the throughput for the systemd
status line; with a port, they also feed a Prometheus registry served as text on
``http://<metrics_host>:<metrics_port>/metrics``.

Only the supervisor serves the endpoint, from a thread started after the fork server
exists (children are forked from a process without threads). The arbiter's calls come
from the event loop thread; prometheus-client locks each update, and the arbiter passes
counts per batch, so the cost per message stays small.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from broker.base import Action

PREFIX = "queue_supervisor"
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


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

    def buffer(self, outstanding: int, prefetch: int, busy: int) -> None:
        """Deliveries outstanding of ``prefetch``; handler processes running a message."""

    def settle_batch(self, size: int, seconds: float) -> None:
        """One settlement call of ``size`` deliveries took ``seconds``."""

    def broker_call(self, operation: str, seconds: float) -> None:
        """One broker call (receive, settle, extend, maintain ...) took ``seconds``."""

    def handler_done(self, seconds: float) -> None:
        """A handler ran for ``seconds`` (as the supervisor saw it: started to outcome)."""

    @contextlib.contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        """``with metrics.timed("extend"): await broker.extend(...)``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.broker_call(operation, time.perf_counter() - began)

    def close(self) -> None:
        """Stop serving (nothing to stop when disabled)."""


class PrometheusMetrics(Metrics):
    """The same calls, recorded in a registry of our own and served over HTTP."""

    def __init__(self, queue: str, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        super().__init__()
        self.registry = CollectorRegistry()
        self._build(queue)
        self._server, self._thread = start_http_server(port, host, registry=self.registry)
        self.port = self._server.server_port

    @property
    def enabled(self) -> bool:
        return True

    def _build(self, queue: str) -> None:
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
        self._outstanding = gauge("buffer_outstanding", "deliveries not yet settled")
        self._prefetch = gauge("buffer_prefetch", "bound on outstanding deliveries")
        self._busy = gauge("busy_handlers", "handler processes running a message")
        self._batch = Histogram(
            f"{PREFIX}_settle_batch_size", "deliveries per settlement call", ["queue"],
            buckets=BATCH_BUCKETS, registry=self.registry,
        ).labels(queue)
        calls = Histogram(
            f"{PREFIX}_broker_call_seconds", "broker call latency by operation",
            ["queue", "operation"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._call = lambda operation: calls.labels(queue, operation)
        self._handler = Histogram(
            f"{PREFIX}_handler_seconds", "handler duration, started to outcome", ["queue"],
            buckets=HANDLER_BUCKETS, registry=self.registry,
        ).labels(queue)

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

    def buffer(self, outstanding: int, prefetch: int, busy: int) -> None:
        self._outstanding.set(outstanding)
        self._prefetch.set(prefetch)
        self._busy.set(busy)

    def settle_batch(self, size: int, seconds: float) -> None:
        self._batch.observe(size)
        self.broker_call("settle", seconds)

    def broker_call(self, operation: str, seconds: float) -> None:
        self._call(operation).observe(seconds)

    def handler_done(self, seconds: float) -> None:
        self._handler.observe(seconds)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start(queue: str, port: int, host: str = "127.0.0.1") -> Metrics:
    """Serve metrics on ``host:port``; ``port`` 0 means off (no-op metrics).

    Call it in the supervisor after the fork server started: it starts a thread.
    """
    if not port:
        return Metrics()
    return PrometheusMetrics(queue, port, host)
