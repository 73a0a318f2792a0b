"""The Prometheus endpoint: record figures, fetch /metrics over HTTP, read them back."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.base import Action
from supervisor import metrics
from support.servers import free_port
from support.supervision import QUEUE, Supervisor, wait_for, write_config


@pytest.fixture
def served():
    recorder = metrics.start("stats-usage", free_port())
    yield recorder
    recorder.close()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    labels = {"queue": "stats-usage", **labels}
    return samples[(f"queue_supervisor_{name}", tuple(sorted(labels.items())))]


def test_the_endpoint_serves_the_counters_gauges_and_histograms(served):
    served.received(120)
    served.settled(Action.COMMIT, 100)
    served.settled("reject", 7)
    served.settled(Action.RELEASE, 3)
    served.uncertain(2)
    served.stale()
    served.malformed(4)
    served.child_restart()
    served.buffer(outstanding=10, prefetch=100, busy=2)
    served.settle_batch(50, 0.002)
    served.settle_batch(60, 0.004)
    with served.timed("extend"):
        pass
    served.handler_done(0.2)

    samples = scrape(served.port)
    assert value(samples, "deliveries_received_total") == 120
    assert value(samples, "deliveries_committed_total") == 100
    assert value(samples, "deliveries_rejected_total") == 7
    assert value(samples, "deliveries_released_total") == 3
    assert value(samples, "deliveries_uncertain_total") == 2
    assert value(samples, "deliveries_stale_total") == 1
    assert value(samples, "malformed_total") == 4
    assert value(samples, "child_restarts_total") == 1
    assert value(samples, "buffer_outstanding") == 10
    assert value(samples, "buffer_prefetch") == 100
    assert value(samples, "busy_handlers") == 2
    assert value(samples, "settle_batch_size_count") == 2
    assert value(samples, "settle_batch_size_sum") == 110
    assert value(samples, "broker_call_seconds_count", operation="settle") == 2
    assert value(samples, "broker_call_seconds_count", operation="extend") == 1
    assert value(samples, "handler_seconds_count") == 1


def test_binds_loopback_by_default(served):
    assert served._server.server_address[0] == "127.0.0.1"


def test_port_zero_means_off_but_throughput_is_still_counted():
    recorder = metrics.start("stats-usage", 0)
    assert not recorder.enabled
    recorder.received(5)
    recorder.settled(Action.COMMIT, 5)
    recorder.settled(Action.RELEASE, 5)  # a release is not a job done
    with recorder.timed("receive"):
        pass
    assert recorder.throughput.total == 5
    recorder.close()


def test_throughput_is_a_rate_over_the_recent_window():
    now = [100.0]
    meter = metrics.Throughput(window=10, clock=lambda: now[0])
    meter.add(50)
    now[0] = 105.0
    assert meter.per_second() == 10.0
    for _ in range(4):  # nothing more for 20 s: the old samples leave the window
        now[0] += 5
        meter.per_second()
    assert meter.per_second() == 0.0


def test_the_supervisor_serves_metrics_on_its_port(tmp_path, redis_url):
    port = free_port()
    config = write_config(tmp_path, redis_url, supervisor={"metrics_port": port})
    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        samples = wait_for(lambda: _try_scrape(port), 15, "the metrics endpoint")
        assert value(samples, "deliveries_received_total", queue=QUEUE) >= 0
    finally:
        supervisor.stop()


def test_a_metrics_port_in_use_exits_2_with_one_line(tmp_path, redis_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, redis_url, supervisor={"metrics_port": port})
        supervisor = Supervisor(config, tmp_path, redis_url)
        try:
            assert supervisor.wait(30) == 2
            output = supervisor.output().strip().splitlines()
            assert len(output) == 1 and "metrics_port" in output[0], output
        finally:
            supervisor.stop()


def _try_scrape(port: int) -> dict | None:
    try:
        return scrape(port)
    except OSError:
        return None
