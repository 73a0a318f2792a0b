"""A broker outage is told once each way (issue 25.5), and `uncertain` counts deliveries.

Redis down 12 s with 18 deliveries held used to write 121 warnings, one per delivery and
try, naming no server, and nothing when it came back. Now: one error line naming the server,
what is held and what happens next; a reminder at growing intervals while it lasts; one
"reconnected" line. Same shape on Redis and NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import nats
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from broker.base import BrokerError
from broker.memory import MemoryBroker
from broker.nats import NatsBroker, version
from broker.nats.setup import QueueNames
from supervisor import exits
from supervisor.buffer import Buffer
from supervisor.metrics import Metrics
from supervisor.outage import REMINDERS, Outage, unreachable
from supervisor.settlement import Settler
from support.envelopes import publish
from support.servers import NatsServer, RedisServer, free_port
from support.supervision import (
    QUEUE,
    counter,
    keys,
    lines,
    outstanding,
    wait_for,
    write_config,
)
from tests.faults import UVLOOP_REFUSAL
from tests.inprocess import completed_buffer

HELD = 18  # the figure
ADDRESS = "redis://:secret@10.0.0.7:6379/0"


# -- the tracker, on a clock of our own ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tracker(held: int = HELD) -> tuple[Outage, Clock]:
    clock = Clock()
    return Outage(ADDRESS, lambda: held, retry_every=5, lease=30, clock=clock), clock


def messages(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "supervisor.outage"]


def test_an_outage_is_one_error_line_naming_the_server_what_is_held_and_what_happens(caplog):
    outage, clock = tracker()
    caplog.set_level(logging.INFO)
    for _ in range(121):  # every loop's every try, as the issue counted them
        outage.lost(ConnectionRefusedError(111, "Connection refused"), outage.now())
        clock.now += 0.1
    [(level, line)] = messages(caplog)
    assert level == logging.ERROR
    assert "10.0.0.7:6379" in line and "secret" not in line
    assert f"{HELD} deliveries held" in line and "retrying every 5s" in line
    assert "settled once it is back" in line and "30s after their last renewal" in line
    assert "Connection refused" in line
    assert outage.down and outage.outages == 1


def test_a_long_outage_reminds_at_growing_intervals(caplog):
    outage, clock = tracker()
    caplog.set_level(logging.INFO)
    start = clock.now
    reminded: list[float] = []
    while clock.now - start < 900:  # 15 minutes, a try every second
        before = len(messages(caplog))
        outage.lost("refused", outage.now())
        if len(messages(caplog)) > before and clock.now > start:
            reminded.append(clock.now - start)
        clock.now += 1
    gaps = [b - a for a, b in zip([0.0, *reminded], reminded, strict=False)]
    assert gaps[:4] == list(REMINDERS)
    assert all(gap == REMINDERS[-1] for gap in gaps[4:])
    assert all(level == logging.WARNING for level, _ in messages(caplog)[1:])
    assert "still unreachable after 30s" in messages(caplog)[1][1]


def test_coming_back_is_one_info_line_with_the_time_down_and_what_it_settles(caplog):
    outage, clock = tracker()
    caplog.set_level(logging.INFO)
    outage.lost("refused", outage.now())
    clock.now += 12
    for _ in range(5):
        outage.back(outage.now())
    assert messages(caplog)[-1] == (
        logging.INFO,
        "reconnected to redis://:***@10.0.0.7:6379/0 after 12s; settling 18 held deliveries",
    )
    assert len(messages(caplog)) == 2 and not outage.down


def test_a_call_begun_before_the_last_change_says_nothing_about_now(caplog):
    outage, clock = tracker()
    caplog.set_level(logging.INFO)
    before_outage = outage.now()
    clock.now += 1
    outage.lost("refused", outage.now())
    clock.now += 1
    outage.back(before_outage)  # a reply that was on its way when the server went away
    assert outage.down
    during = outage.now()
    clock.now += 1
    outage.back(outage.now())
    clock.now += 1
    outage.lost("timed out", during)  # a call that began before it came back
    assert not outage.down
    assert [level for level, _ in messages(caplog)] == [logging.ERROR, logging.INFO]


def test_a_refusal_is_not_an_outage():
    from broker.base import BrokerRefused, WrongTypeError

    assert unreachable(BrokerError("extend failed: ConnectionError()"))
    assert unreachable(ConnectionResetError())
    assert not unreachable(BrokerRefused("wrong password"))
    assert not unreachable(WrongTypeError("queue holds a string"))


def test_a_transport_uvloop_closed_is_an_outage_and_other_runtime_errors_are_not():
    """A write to a transport uvloop has closed, from any client the broker uses (a CI run
    saw one escape redis-py's Cluster client): told as the outage, not as a failed call."""
    assert unreachable(RuntimeError(UVLOOP_REFUSAL))
    assert not unreachable(RuntimeError("Event loop is closed"))


# -- the settler: no line per delivery, uncertain once per delivery -------------------------------


def test_uncertain_counts_each_delivery_once_however_often_it_is_tried(caplog):
    async def scenario() -> tuple[Metrics, Buffer, MemoryBroker]:
        broker = MemoryBroker()
        broker.faults.uncertain_unapplied = HELD * 5  # five tries each, every reply lost
        buffer = await completed_buffer(broker, HELD)
        metrics = Metrics()
        outage, _ = tracker()
        settler = Settler(broker, buffer, lambda entry, ok: None, metrics, outage=outage)
        tries = 0
        while buffer.outstanding:
            tries += 1
            await settler.settle(buffer.take_completed(HELD))
        assert tries == 6
        return metrics, buffer, broker

    caplog.set_level(logging.INFO)
    metrics, _, broker = asyncio.run(scenario())
    assert metrics.counts["uncertain"] == HELD  # deliveries, not 90 tries
    assert metrics.counts["commit"] == HELD and sum(broker.committed.values()) == HELD
    told = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(told) == 1 and "broker unreachable at" in told[0].getMessage()
    assert not any("not confirmed" in r.getMessage() for r in caplog.records)


def test_unconfirmed_settlements_of_a_broker_that_answers_are_one_line_per_call(caplog):
    async def scenario() -> None:
        broker = MemoryBroker()
        broker.faults.unapplied = 7  # 7 of 18 answered ERROR, the rest applied
        buffer = await completed_buffer(broker, HELD)
        settler = Settler(broker, buffer, lambda entry, ok: None)
        assert not await settler.settle(buffer.take_completed(HELD))

    caplog.set_level(logging.INFO)
    asyncio.run(scenario())
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.startswith("7 of 18 settlements not confirmed (commit of ")
    assert "; and 2 more); will settle again" in line


# -- end to end: a real server taken away with deliveries held ------------------------------------


def scrape(port: int) -> dict[str, float]:
    """The supervisor's samples by name ({} while its endpoint is not up yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}


def settle_calls(port: int) -> float:
    return scrape(port).get("queue_supervisor_settle_batch_size_count", 0.0)


def received(port: int) -> float:
    return scrape(port).get("queue_supervisor_deliveries_received_total", 0.0)


def uncertain(port: int) -> float:
    return scrape(port).get("queue_supervisor_deliveries_uncertain_total", 0.0)


def told(output: str, words: str) -> list[str]:
    return [line for line in output.splitlines() if words in line]


def held_then_finished_while_away(tmp_path: Path, take_away: Callable[[], None],
                                  metrics_port: int, is_held: Callable[[], bool]) -> None:
    """Wait until every delivery is held by the supervisor, take the server away, let every
    handler finish, and wait until their settlement was tried (and tried again)."""
    # Its own count too: a claim whose reply the kill cuts off is not held yet (it comes back
    # through recovery, not through this test's settlements).
    wait_for(lambda: is_held() and received(metrics_port) == HELD, 60,
             f"{HELD} deliveries held")
    take_away()
    (tmp_path / "gate").touch()
    wait_for(lambda: len(lines(tmp_path / "handled")) == HELD, 60, "every handler finished")
    calls = settle_calls(metrics_port)
    wait_for(lambda: settle_calls(metrics_port) >= calls + 2, 60, "settlement tried again")


def level(line: str) -> str:
    if line.startswith("{"):
        return json.loads(line).get("level", "")
    return next((word.lower() for word in line.split() if word in ("ERROR", "WARNING")), "")


def assert_told_once_each_way(output: str, address: str) -> None:
    [down] = told(output, "broker unreachable at")
    assert address in down and f"{HELD} deliveries held" in down, down
    [back] = told(output, "reconnected to")
    assert address in back and f"settling {HELD} held deliveries" in back, back
    assert not told(output, "not confirmed") and not told(output, "receive failed")
    assert not told(output, "renewal of") and not told(output, "NATS reconnected")
    loud = [line for line in output.splitlines() if level(line) in ("error", "warning")]
    assert len(loud) <= 3, loud  # the outage, perhaps a reminder and a recovery-time line
    assert "Traceback" not in output


@pytest.fixture
def durable_redis():
    """A private redis-server that keeps its data (appendfsync always) across a kill."""
    server = RedisServer(persist=True).start()
    yield server
    server.close()


@pytest.mark.slow
def test_redis_killed_with_deliveries_held_is_told_once_and_loses_nothing(
    tmp_path, durable_redis, supervisors
):
    client = redis.Redis.from_url(durable_redis.url)
    publish(client, [{"gate": str(tmp_path / "gate")} for _ in range(HELD)])
    port = free_port()
    config = write_config(tmp_path, durable_redis.url, "tests.handlers.gated_record:handle",
                          job={"prefetch": HELD, "coroutines": 2},
                          supervisor={"lease": 60, "metrics_port": port})
    supervisor = supervisors(config, durable_redis.url)
    held_then_finished_while_away(tmp_path, durable_redis.stop, port,
                                  lambda: client.llen(keys().processing) == HELD)
    client.close()
    durable_redis.start()
    client = redis.Redis.from_url(durable_redis.url)
    wait_for(lambda: counter(client, "success") == HELD and outstanding(client) == 0, 60,
             "every held delivery committed once it is back")
    assert uncertain(port) == HELD  # each delivery once, though tried again and again
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    client.close()
    output = supervisor.output()
    assert_told_once_each_way(output, f"redis://127.0.0.1:{durable_redis.port}/0")
    assert f"{HELD} done, 0 failed" in output and f"{HELD} uncertain" in output


def nats_state(server: NatsServer) -> dict[str, int]:
    async def read() -> dict[str, int]:
        client = await nats.connect(server.url)
        try:
            js = client.jetstream()
            names = QueueNames.of(QUEUE)
            info = await js.consumer_info(names.stream, "worker")
            stream = await js.stream_info(names.stream)
            return {"ack_pending": info.num_ack_pending, "redelivered": info.num_redelivered,
                    "stream": stream.state.messages}
        finally:
            await client.close()

    return asyncio.run(read())


def nats_publish(server: NatsServer, payloads: list[dict]) -> list[str]:
    async def send() -> list[str]:
        broker = NatsBroker(server.url, QUEUE, ack_wait=60)
        await broker.connect()
        try:
            return await broker.publish_many(QUEUE, payloads)
        finally:
            await broker.close()

    return asyncio.run(send())


@pytest.mark.slow
def test_nats_stopped_with_deliveries_held_is_told_once_and_loses_nothing(
    tmp_path, nats_server, supervisors
):
    pids = nats_publish(nats_server, [{"gate": str(tmp_path / "gate")} for _ in range(HELD)])
    port = free_port()
    config = write_config(tmp_path, nats_server.url, "tests.handlers.gated_record:handle",
                          job={"prefetch": HELD, "coroutines": 2}, nats={"ack_wait": 60},
                          supervisor={"lease": 60, "metrics_port": port})
    supervisor = supervisors(config)
    # Stopped, not killed: a kill may lose the consumer's state (written every 2 min), and
    # every message would be new again after it.
    held_then_finished_while_away(tmp_path, lambda: nats_server.stop(signal.SIGTERM), port,
                                  lambda: nats_state(nats_server)["ack_pending"] == HELD)
    nats_server.start()
    wait_for(lambda: nats_state(nats_server)["stream"] == 0, 60,
             "every held delivery acknowledged once it is back")
    assert nats_state(nats_server)["redelivered"] == 0  # none ran twice
    assert sorted(lines(tmp_path / "handled")) == sorted(pids)
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    output = supervisor.output()
    assert_told_once_each_way(output, f"nats://127.0.0.1:{nats_server.port}")
    assert not told(output, "building a new one")


# -- the NATS server's version, checked at every connection (issue 25.8) --------------------------


class OldNatsServer:
    """Speaks only the greeting of a NATS server of ``version``: INFO, then PONG to each PING.
    Enough for the version check, which happens before any JetStream request."""

    def __init__(self, version: str) -> None:
        info = {"server_id": "old", "server_name": "old", "version": version, "proto": 1,
                "go": "go1.19", "host": "127.0.0.1", "headers": True, "max_payload": 1048576,
                "jetstream": True}
        self.greeting = b"INFO " + json.dumps(info).encode() + b"\r\n"
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self.socket.accept()
                threading.Thread(target=self.talk, args=(connection,), daemon=True).start()

    def talk(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.sendall(self.greeting)
            for line in connection.makefile("rb"):
                if line.startswith(b"PING"):
                    connection.sendall(b"PONG\r\n")

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def old_nats():
    server = OldNatsServer("2.9.10")  # Debian 12's
    yield server
    server.close()


def test_a_server_older_than_2_10_is_refused_before_anything_is_created(old_nats):
    async def connect() -> None:
        broker = NatsBroker(old_nats.url, QUEUE)
        try:
            await broker.connect()
        finally:
            await broker.close()

    with pytest.raises(version.ServerTooOld) as refused:
        asyncio.run(connect())
    text = str(refused.value)
    assert f"127.0.0.1:{old_nats.port} runs version 2.9.10" in text
    assert "needs 2.10.0 or newer" in text and "metadata" in text


def test_the_supervisor_refuses_an_old_server_in_one_line_with_an_exit_systemd_keeps(
    tmp_path, old_nats, supervisors
):
    config = write_config(tmp_path, old_nats.url)
    supervisor = supervisors(config)
    assert supervisor.wait(30) == exits.REFUSED
    output = supervisor.output()
    told_lines = [line for line in output.splitlines() if level(line) == "error"]
    assert len(told_lines) == 1, output
    assert "runs version 2.9.10; this supervisor needs 2.10.0 or newer" in told_lines[0]
    assert "Traceback" not in output


def test_the_nats_server_the_tests_run_is_new_enough(nats_server):
    async def connect() -> str:
        broker = NatsBroker(nats_server.url, QUEUE)
        await broker.connect()
        try:
            conn = broker._link.connection
            assert conn is not None
            return conn.server_info["version"]
        finally:
            await broker.close()

    served = asyncio.run(connect())
    parsed = version.parse(served)
    assert parsed is not None and parsed >= version.MINIMUM, served


@pytest.mark.parametrize(("text", "parsed"), [
    ("2.9.10", (2, 9, 10)), ("2.10.0", (2, 10, 0)), ("v2.11.3", (2, 11, 3)),
    ("2.10.0-beta.5", (2, 10, 0)), ("dev", None),
])
def test_versions_read_as_the_server_spells_them(text, parsed):
    assert version.parse(text) == parsed
    if parsed is not None:
        assert (parsed >= version.MINIMUM) == (parsed >= (2, 10, 0))


@pytest.fixture
def durable_cluster():
    """A private three-master Redis Cluster whose nodes keep their data across a kill."""
    from support.cluster import PrivateCluster

    cluster = PrivateCluster(persist=True).start()
    yield cluster
    cluster.close()


@pytest.mark.slow
def test_a_redis_cluster_master_killed_with_deliveries_held_is_told_once_and_loses_nothing(
    tmp_path, durable_cluster, supervisors
):
    """The master serving the queue's slot killed, then started again: its connections are
    refused, then the other masters answer CLUSTERDOWN. One line each way all the same."""
    namespace = "{utopia-queue}"
    client = redis.RedisCluster.from_url(durable_cluster.url)
    publish(client, [{"gate": str(tmp_path / "gate")} for _ in range(HELD)], namespace)
    processing = keys(namespace).processing
    owner = durable_cluster.owner_of(processing)
    seed = next(node for node in durable_cluster.nodes if node is not owner)
    port = free_port()
    config = write_config(tmp_path, seed.url, "tests.handlers.gated_record:handle",
                          broker={"cluster": True, "namespace": namespace},
                          job={"prefetch": HELD, "coroutines": 2},
                          supervisor={"lease": 60, "metrics_port": port})
    supervisor = supervisors(config, seed.url, namespace=namespace)
    held_then_finished_while_away(tmp_path, owner.kill, port,
                                  lambda: client.llen(processing) == HELD)
    owner.start()
    durable_cluster.wait_ok(60)
    wait_for(lambda: counter(client, "success", namespace) == HELD
             and client.llen(processing) == 0, 120, "every held delivery committed")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    client.close()
    output = supervisor.output()
    [down] = told(output, "broker unreachable at")
    assert f"127.0.0.1:{seed.port}" in down and f"{HELD} deliveries held" in down, down
    [back] = told(output, "reconnected to")
    assert f"settling {HELD} held deliveries" in back, back
    for flood in ("not confirmed", "receive failed", "renewal of", "settlement of"):
        assert not told(output, flood), flood
    assert "Traceback" not in output
