"""The Prometheus endpoint: record figures, fetch /metrics over HTTP, read them back."""

from __future__ import annotations

import contextlib
import gzip
import logging
import resource
import select
import signal
import socket
import time
import urllib.request

import psutil
import pytest

from broker.base import Action
from supervisor import metrics, metrics_http
from support.envelopes import publish
from support.prometheus import sample, scrape
from support.servers import free_port
from support.supervision import QUEUE, Supervisor, counter, keys, wait_for, write_config


@pytest.fixture
def served():
    recorder = metrics.start("stats-usage", free_port())
    yield recorder
    recorder.close()


def value(samples: dict, name: str, **labels: str) -> float:
    return sample(samples, name, **{"queue": "stats-usage", **labels})


def test_the_endpoint_serves_the_counters_gauges_and_histograms(served):
    served.received(120)
    served.settled(Action.COMMIT, 100)
    served.settled("reject", 7)
    served.settled(Action.RELEASE, 3)
    served.uncertain(2)
    served.stale()
    served.malformed(4)
    served.child_restart()
    served.taken_back(4)
    served.taken_back(1)
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
    assert value(samples, "deliveries_taken_back_total") == 5
    assert value(samples, "buffer_outstanding") == 10
    assert value(samples, "buffer_prefetch") == 100
    assert value(samples, "busy_handlers") == 2
    assert value(samples, "settle_batch_size_count") == 2
    assert value(samples, "settle_batch_size_sum") == 110
    assert value(samples, "broker_call_seconds_count", operation="settle") == 2
    assert value(samples, "broker_call_seconds_count", operation="extend") == 1
    assert value(samples, "handler_seconds_count") == 1


def test_rejects_are_counted_by_outcome_and_error_class_within_a_bound(served):
    classes = [f"mod.Error{n}" for n in range(metrics.ERROR_CLASSES + 5)]
    for name in classes:
        served.rejected("retrying in 2 s", name)
    served.rejected("failed", classes[0])
    served.rejected("dead", "WorkerLost")  # the supervisor's own classes: always by name
    served.rejected("outcome unknown: no longer ours when rejected", "HandlerTimeout")
    served.rejected("failed", "x" * 500)  # a class past the bound: other, its name not kept
    samples = scrape(served.port)
    rejects = {(dict(labels)["outcome"], dict(labels)["error"]): count
               for (name, labels), count in samples.items()
               if name == "queue_supervisor_rejects_total"}
    named = {name: 1.0 for name in classes[:metrics.ERROR_CLASSES]}
    assert rejects == {**{("retrying", name): 1.0 for name in named},
                       ("retrying", "other"): 5.0, ("failed", classes[0]): 1.0,
                       ("dead", "WorkerLost"): 1.0, ("unknown", "HandlerTimeout"): 1.0,
                       ("failed", "other"): 1.0}


@pytest.mark.slow
def test_the_oldest_running_jobs_age_and_the_slow_ones_are_gauges(served):
    served.running(75.5, 2)
    samples = scrape(served.port)
    assert value(samples, "oldest_running_seconds") == 75.5
    assert value(samples, "slow_jobs") == 2
    served.running(0.0, 0)
    assert value(scrape_fresh(served), "slow_jobs") == 0


def scrape_fresh(served) -> dict:
    """A scrape past the endpoint's render cache (a second)."""
    time.sleep(metrics_http.METRICS_CACHE + 0.1)
    return scrape(served.port)


def test_binds_loopback_by_default(served):
    assert served._endpoint.address[0] == "127.0.0.1"


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


@pytest.mark.slow
def test_handler_seconds_and_rejects_count_failed_timed_out_and_lost_runs_too(
        tmp_path, redis_url, client):
    """Issue 38 part 4: every outcome is timed (handler_seconds_count was 3 against 15
    outcomes: only successes were), and each failed run is counted by class."""
    port = free_port()
    config = write_config(tmp_path, redis_url, job={"max_attempts": 1, "handler_timeout": 2},
                          supervisor={"metrics_port": port})
    publish(client, [{"fail": True}] * 3 + [{"n": 1}, {"n": 2}, {"crash": True},
                                             {"hang": True}])
    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        wait_for(lambda: client.llen(keys().failed) == 5 and counter(client, "success") == 2,
                 60, "three failures, two successes, a lost and a timed-out run")
        samples = scrape(port)
        assert value(samples, "handler_seconds_count", queue=QUEUE) == 7
        assert value(samples, "handler_seconds_sum", queue=QUEUE) >= 2  # the timed-out run
        for error, count in (("RuntimeError", 3), ("WorkerLost", 1), ("HandlerTimeout", 1)):
            assert value(samples, "rejects_total", queue=QUEUE, outcome="failed",
                         error=error) == count, error
        assert "handler_timeout = 0" not in supervisor.output()  # it is set: no notice
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


# -- a hostile neighbour (issue 28, M3) -------------------------------------------------------

HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # the blank line never comes


def half_sent(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that each sent half a request, opened without waiting on any
    one of them; returns once all are established or after 30 s (a server that stopped
    accepting, out of descriptors, leaves the rest unanswered)."""
    flood = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        flood.append(sock)
    waiting, deadline = list(flood), time.monotonic() + 30
    while waiting and time.monotonic() < deadline:
        _, writable, _ = select.select([], waiting, [], 1)
        for sock in writable:
            with contextlib.suppress(OSError):
                sock.send(HALF_A_REQUEST)
            waiting.remove(sock)
    return flood


def test_the_answer_is_prometheus_clients_own(served):
    """The same bytes as the library's exposition, in each format it negotiates."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    served.settled(Action.COMMIT, 3)
    served.settle_batch(3, 0.001)
    served.cpu_seconds = lambda: 1.5  # read at each scrape: held still for the comparison
    url = f"http://127.0.0.1:{served.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        assert response.read() == generate_latest(served.registry)
    request = urllib.request.Request(url, headers={
        "Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(response.read()) == openmetrics(served.registry)


@pytest.mark.slow
def test_a_slow_request_is_closed_after_the_timeout_and_others_are_answered_meanwhile(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as slow:
        slow.sendall(HALF_A_REQUEST)
        began = time.monotonic()
        assert value(scrape(served.port), "deliveries_received_total") == 0
        assert slow.recv(1024) == b""  # closed unanswered
        waited = time.monotonic() - began
    assert metrics_http.REQUEST_TIMEOUT - 1 <= waited < metrics_http.REQUEST_TIMEOUT + 10


@pytest.mark.slow
def test_a_flood_of_half_sent_requests_holds_few_descriptors_and_scrapes_go_on(served):
    before = psutil.Process().num_fds()
    flood = half_sent(served.port, 300)
    try:
        assert value(scrape(served.port), "deliveries_received_total") == 0
        # The endpoint's share: at most its cap of connections; the rest are the flood's own.
        held = wait_for(lambda: _endpoint_fds(before, flood), 30, "the flood to be accepted")
        assert held <= metrics_http.MAX_CONNECTIONS + 1
    finally:
        for sock in flood:
            sock.close()
    assert value(scrape(served.port), "deliveries_received_total") == 0


def _endpoint_fds(before: int, flood: list[socket.socket]) -> int | None:
    """The descriptors the endpoint holds now (the process's, less the flood's and the ones
    open before it), once the endpoint accepted (and so cut) most of the flood."""
    closed_by_peer = 0
    for sock in flood:
        try:
            if sock.recv(1, socket.MSG_PEEK) == b"":
                closed_by_peer += 1
        except BlockingIOError:
            pass
        except OSError:
            closed_by_peer += 1
    if closed_by_peer < len(flood) - metrics_http.MAX_CONNECTIONS:
        return None
    return psutil.Process().num_fds() - before - len(flood)


@pytest.mark.slow
def test_the_supervisor_keeps_consuming_through_a_flood_of_half_sent_requests(
        tmp_path, redis_url, client, supervisors):
    """More half-sent requests than the supervisor has descriptors: it still reconnects to
    the broker and consumes, and the endpoint still answers."""
    port = free_port()
    config = write_config(tmp_path, redis_url, supervisor={"metrics_port": port})
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: _try_scrape(port), 30, "the metrics endpoint")
    process = psutil.Process(supervisor.pid)
    resource.prlimit(supervisor.pid, resource.RLIMIT_NOFILE, (256, 256))
    before = process.num_fds()
    flood = half_sent(port, 400)
    try:
        wait_for(lambda: process.num_fds() - before <= metrics_http.MAX_CONNECTIONS + 2, 30,
                 "the endpoint to hold at most its cap of connections")
        # Every broker connection of the supervisor is cut: it must open new ones now.
        client.client_kill_filter(_type="normal", skipme=True)
        publish(client, [{"n": n} for n in range(50)])
        wait_for(lambda: counter(client, "success") == 50, 60, "50 jobs done during the flood")
        assert value(wait_for(lambda: _try_scrape(port), 30, "a scrape during the flood"),
                     "deliveries_received_total", queue=QUEUE) >= 50
    finally:
        for sock in flood:
            sock.close()
    assert _try_scrape(port) is not None
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()


def test_a_metrics_host_beyond_loopback_is_warned_about(caplog):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert metrics_http.exposure_warning(host) is None
    for host in ("0.0.0.0", "::", "10.0.0.5", "metrics.example"):
        assert "not a loopback address" in metrics_http.exposure_warning(host)
    # An address of no interface here (TEST-NET-1): warned before the bind fails, and
    # nothing is ever exposed by this test.
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="requested address"):
        metrics.start("stats-usage", free_port(), "192.0.2.1")
    assert "metrics_host = 192.0.2.1 is not a loopback address" in caplog.text
