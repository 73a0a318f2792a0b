"""/healthz, /readyz and the queue gauges of a running supervisor (issue 25 item 3):
real status codes through start-up, a broker outage and a stop; 404 for other paths."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

import pytest

from supervisor import metrics
from support.envelopes import fresh, lpush_batched, publish
from support.servers import free_port
from support.supervision import QUEUE, counter, keys, lines, wait_for, write_config


def get(port: int, path: str) -> tuple[int, str]:
    """Status code and body of one GET (0, reason: nothing answered)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, str(error)


def figures(port: int) -> dict[str, float]:
    """The queue's samples by name, with build_info's labels kept in its name."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(port, "/metrics")
    if status != 200:
        return {}
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("queue") != QUEUE:
                continue
            name = sample.name
            if name.endswith("build_info"):
                name += f"[{sample.labels['broker']}]"
            found[name] = sample.value
    return found


def figure(port: int, name: str) -> float | None:
    return figures(port).get(f"queue_supervisor_{name}")


@pytest.mark.slow
def test_no_handler_ready_is_not_ready_and_the_queue_gauges_are_served(
        tmp_path, redis_url, client, supervisors):
    """init() keeps failing (a database not up): alive, not ready, nothing taken, and the
    gauges show what waits."""
    k = keys()
    old = fresh(QUEUE, 1, timestamp=int(time.time()) - 300)
    lpush_batched(client, k.ready, old + fresh(QUEUE, 4))
    client.rpush(k.failed, "f1", "f2")
    client.rpush(k.poison, b"{not json")
    port = free_port()
    config = write_config(tmp_path, redis_url, handler="tests.handlers.init_flaky:handle",
                          supervisor={"metrics_port": port})
    supervisor = supervisors(config, redis_url, INIT_FAILURES="1000")

    wait_for(lambda: figure(port, "ready_messages") == 5, 30, "the first sample")
    found = figures(port)
    assert found["queue_supervisor_failed_messages"] == 2
    assert found["queue_supervisor_poison_messages"] == 1
    assert found["queue_supervisor_dead_messages"] == 0
    assert found["queue_supervisor_processing_messages"] == 0
    assert found["queue_supervisor_oldest_ready_age_seconds"] >= 300
    assert found["queue_supervisor_supervisors_alive"] == 1  # this one
    assert found["queue_supervisor_build_info[redis]"] == 1
    assert found["queue_supervisor_broker_up"] == 1
    assert found["queue_supervisor_ready"] == 0
    status, reason = get(port, "/readyz")
    assert status == 503 and reason.startswith("no handler process ready"), reason
    assert get(port, "/healthz")[0] == 200
    for path in ("/", "/metricsx", "/healthz/x", "/favicon.ico"):
        status, body = get(port, path)
        assert status == 404 and "not found" in body, (path, status)
    assert supervisor.process.poll() is None, supervisor.output()


@pytest.mark.slow
def test_ready_after_start_unready_while_the_broker_is_down_reconnects_counted(
        tmp_path, own_redis_server, supervisors):
    url = own_redis_server.url
    port = free_port()
    config = write_config(tmp_path, url, supervisor={"metrics_port": port})
    supervisor = supervisors(config, url)
    wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "ready")
    assert get(port, "/readyz")[1] == "ok\n"
    wait_for(lambda: figure(port, "broker_reconnects_total") == 0, 30, "a sample")

    own_redis_server.stop()
    down = wait_for(lambda: (answer := get(port, "/readyz"))[0] == 503 and answer, 30,
                    "not ready while Redis is down")
    assert down[1].startswith("broker unreachable: ") and down[1].count("\n") == 1, down
    assert get(port, "/healthz")[0] == 200  # alive: restarting it would not help
    wait_for(lambda: figure(port, "broker_up") == 0, 30, "broker_up 0")

    own_redis_server.start()
    wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "ready again")
    wait_for(lambda: (figure(port, "broker_reconnects_total") or 0) >= 1, 30,
             "the reconnect counted")
    assert figure(port, "broker_up") == 1
    assert supervisor.process.poll() is None, supervisor.output()


@pytest.mark.slow
def test_not_ready_while_stopping_alive_until_the_end(tmp_path, redis_url, client, supervisors):
    gate = tmp_path / "gate"
    port = free_port()
    config = write_config(tmp_path, redis_url, handler="tests.handlers.gated_started:handle",
                          supervisor={"metrics_port": port, "shutdown_deadline": 60})
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "ready")
    [pid] = publish(client, [{"gate": str(gate)}])
    wait_for(lambda: lines(tmp_path / "started") == [pid], 30, "the job running")
    supervisor.signal(signal.SIGTERM)
    wait_for(lambda: get(port, "/readyz") == (503, "stopping: taking no more work\n"), 30,
             "not ready once stopping")
    assert get(port, "/healthz")[0] == 200  # still finishing its job
    gate.touch()
    assert supervisor.wait(30) == 0, supervisor.output()
    assert counter(client, "success") == 1  # the job it held finished before the exit


def test_healthz_fails_once_the_main_loop_stalls():
    now = [1000.0]
    health = metrics.Health(clock=lambda: now[0])
    assert health.alive() == (True, "starting")
    assert health.ready() == (False, "starting")
    health.beat()
    now[0] += metrics.STALE_LOOP
    assert health.alive() == (True, "ok")
    now[0] += 5
    alive, reason = health.alive()
    assert not alive and "has not gone round for 15s" in reason
    health.not_ready = None
    assert health.ready() == (True, "ok")


def test_the_endpoint_answers_503_with_the_reason_when_stalled_or_not_ready():
    served = metrics.start("gauges", free_port())
    try:
        served.health.last_beat = time.monotonic() - 60  # a minute without a round
        status, body = get(served.port, "/healthz")
        assert status == 503 and "main loop has not gone round for 60s" in body
        served.readiness("broker unreachable: connection refused")
        assert get(served.port, "/readyz") == (503, "broker unreachable: connection refused\n")
        served.readiness(None)
        served.beat()
        assert get(served.port, "/readyz") == (200, "ok\n")
        assert get(served.port, "/healthz") == (200, "ok\n")
    finally:
        served.close()


@pytest.mark.slow
def test_a_nats_supervisor_serves_the_consumer_figures(tmp_path, nats_server, supervisors):
    from support.nats_jobs import nats_config
    from support.nats_jobs import publish as publish_nats

    publish_nats(nats_server, [{"n": n} for n in range(4)])
    port = free_port()
    config = nats_config(tmp_path, nats_server, handler="tests.handlers.init_flaky:handle",
                         supervisor={"metrics_port": port})
    supervisor = supervisors(config, INIT_FAILURES="1000")  # never ready: nothing taken
    wait_for(lambda: figure(port, "ready_messages") == 4, 30, "the first sample")
    found = figures(port)
    assert found["queue_supervisor_build_info[nats]"] == 1
    assert found["queue_supervisor_processing_messages"] == 0
    assert found["queue_supervisor_dead_messages"] == 0
    assert found["queue_supervisor_nats_leaderless_seconds"] == 0
    assert found["queue_supervisor_broker_reconnects_total"] == 0
    assert "queue_supervisor_failed_messages" not in found  # no failed list on NATS
    assert get(port, "/readyz")[0] == 503
    assert supervisor.process.poll() is None, supervisor.output()
