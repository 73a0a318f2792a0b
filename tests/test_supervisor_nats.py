"""``python -m supervisor`` with a ``nats://`` URL, end to end against a private nats-server."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import psutil
import pytest

from broker.base import Action, Settlement
from broker.failure import NATS_HEADER, Failure
from broker.nats import NatsBroker
from broker.nats.setup import QueueNames
from support.faultproxy import FaultProxy
from support.nats_jobs import nats_config, publish
from support.servers import NatsServer
from support.supervision import QUEUE, lines, wait_for, write_config

NAMES = QueueNames.of(QUEUE)



def consumer_state(server: NatsServer) -> dict[str, int]:
    async def read() -> dict[str, int]:
        client = await nats.connect(server.url)
        try:
            js = client.jetstream()
            info = await js.consumer_info(NAMES.stream, "worker")
            stream = await js.stream_info(NAMES.stream)
            dead = await js.stream_info(NAMES.dead_stream)
            return {
                "pending": info.num_pending, "ack_pending": info.num_ack_pending,
                "redelivered": info.num_redelivered, "stream": stream.state.messages,
                "dead": dead.state.messages,
            }
        finally:
            await client.close()

    return asyncio.run(read())


@pytest.fixture
def start(supervisors):
    """start(config, **env): a supervisor, stopped afterwards."""
    return supervisors


def handled(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "handled")


def started(tmp_path: Path) -> list[list[str]]:
    return [line.split() for line in lines(tmp_path / "started")]


@pytest.mark.slow
def test_buffered_messages_are_renewed_and_each_delivered_once(tmp_path, nats_server, start):
    # 60 messages of 0.1 s each through one handler: the last waits ~6 s in the buffer,
    # twice the 3 s ack_wait. Renewal (every lease/3 = 1 s) must keep every one of them.
    pids = publish(nats_server, [{"n": n, "sleep": 0.1} for n in range(60)])
    config = nats_config(tmp_path, nats_server, job={"prefetch": 100},
                         supervisor={"lease": 3})
    supervisor = start(config)
    wait_for(lambda: len(handled(tmp_path)) == len(pids), 60, "all messages")
    assert sorted(handled(tmp_path)) == sorted(pids)
    assert [attempts for _, attempts, _ in started(tmp_path)] == ["0"] * len(pids)
    wait_for(lambda: consumer_state(nats_server)["stream"] == 0, 10, "all acked")
    assert consumer_state(nats_server)["redelivered"] == 0
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0


def test_failures_and_malformed_end_dead_and_successes_commit(tmp_path, nats_server, start):
    [failing] = publish(nats_server, [{"fail": True}], max_attempts=2)
    ok = publish(nats_server, [{"n": n} for n in range(20)], max_attempts=2)

    async def malformed() -> None:
        client = await nats.connect(nats_server.url)
        await client.jetstream().publish(NAMES.subject, b"{not json")
        await client.close()

    asyncio.run(malformed())
    config = nats_config(tmp_path, nats_server, job={"max_attempts": 2, "prefetch": 10})
    start(config)
    wait_for(lambda: sorted(handled(tmp_path)) == sorted(ok), 30, "the good messages")
    wait_for(lambda: consumer_state(nats_server)["dead"] == 2, 30, "failing + malformed dead")
    attempts = collections.Counter(pid for pid, _, _ in started(tmp_path))
    assert attempts[failing] == 2
    wait_for(lambda: consumer_state(nats_server)["stream"] == 0, 10, "nothing left")


@pytest.mark.slow
def test_server_restart_mid_run_finishes_every_message(tmp_path, nats_server, start):
    pids = publish(nats_server, [{"n": n, "sleep": 0.002} for n in range(600)])
    config = nats_config(tmp_path, nats_server, job={"prefetch": 50})
    supervisor = start(config)
    wait_for(lambda: len(handled(tmp_path)) > 100, 30, "some progress")
    nats_server.restart()
    wait_for(lambda: set(handled(tmp_path)) == set(pids), 90, "every message after restart")
    wait_for(lambda: consumer_state(nats_server)["stream"] == 0, 30, "all acked")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(20) == 0


@pytest.mark.slow
def test_graceful_stop_returns_unstarted_deliveries_at_once(tmp_path, nats_server, start):
    pids = publish(nats_server, [{"n": 0, "sleep": 1.0}] + [{"n": n} for n in range(1, 30)],
                   ack_wait=30.0)
    config = nats_config(tmp_path, nats_server, job={"prefetch": 30}, nats={"ack_wait": 30.0},
                         supervisor={"lease": 30})
    supervisor = start(config)
    wait_for(lambda: started(tmp_path), 15, "the first handler to start")
    wait_for(lambda: consumer_state(nats_server)["ack_pending"] == 30, 10, "all 30 prefetched")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(20) == 0
    assert handled(tmp_path) == [pids[0]]

    async def second_consumer() -> set[str]:
        broker = NatsBroker(nats_server.url, QUEUE, ack_wait=30.0)
        await broker.connect()
        got: set[str] = set()
        deadline = time.monotonic() + 5  # far below the 30 s ack_wait
        try:
            while len(got) < 29 and time.monotonic() < deadline:
                received = await broker.receive(100, 1.0)
                got.update(d.pid for d in received.deliveries)
                await broker.settle([Settlement(Action.COMMIT, d) for d in received.deliveries])
        finally:
            await broker.close()
        return got

    assert asyncio.run(second_consumer()) == set(pids[1:])


def test_handler_sees_attempts_rise_on_redelivery(tmp_path, nats_server, start):
    """JetStream never rewrites the envelope: the attempts a handler sees come from the
    delivery count, as on Redis (0, 1, 2 for max_attempts 3)."""
    [pid] = publish(nats_server, [{"fail": True}])
    start(nats_config(tmp_path, nats_server, job={"max_attempts": 3}))
    wait_for(lambda: len(started(tmp_path)) == 3, 30, "three deliveries")
    assert [(p, attempts) for p, attempts, _ in started(tmp_path)] == [
        (pid, "0"), (pid, "1"), (pid, "2")
    ]
    wait_for(lambda: consumer_state(nats_server)["dead"] == 1, 10, "the dead letter")


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def dead_letters(server: NatsServer) -> list[tuple[bytes, dict[str, str]]]:
    async def read() -> list[tuple[bytes, dict[str, str]]]:
        client = await nats.connect(server.url)
        try:
            js = client.jetstream()
            count = (await js.stream_info(NAMES.dead_stream)).state.messages
            found = [await js.get_msg(NAMES.dead_stream, seq) for seq in range(1, count + 1)]
            return [(m.data, m.headers or {}) for m in found]
        finally:
            await client.close()

    return asyncio.run(read())


def test_handler_that_kills_its_process_ends_dead_after_max_attempts(
    tmp_path, nats_server, start
):
    [pid] = publish(nats_server, [{"crash": True}], max_attempts=2)
    supervisor = start(nats_config(tmp_path, nats_server, job={"max_attempts": 2}))
    wait_for(lambda: consumer_state(nats_server)["dead"] == 1, 30, "the dead letter")
    assert [(p, attempts) for p, attempts, _ in started(tmp_path)] == [(pid, "0"), (pid, "1")]
    [(_, headers)] = dead_letters(nats_server)
    assert "WorkerLost: handler process" in headers["Queue-Reason"]
    record = Failure.decode(headers[NATS_HEADER])  # the record, for `show` and a dashboard
    assert (record.error, record.attempt, record.outcome) == ("WorkerLost", 2, "dead")
    assert record.message.endswith("killed by signal 9 (SIGKILL)")
    assert record.consumer.endswith(f"-{supervisor.pid}")  # which supervisor ran it
    wait_for(lambda: consumer_state(nats_server)["stream"] == 0, 10, "nothing left")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0


@pytest.mark.slow
def test_supervisor_killed_on_the_last_attempt_leaves_it_dead_not_stuck(
    tmp_path, nats_server, start
):
    """JetStream counts the lost delivery: the next supervisor gets the spare delivery
    (queue 5's MaxDeliver = attempts + 1) and dead-letters it without running it."""
    [pid] = publish(nats_server, [{"n": 1}], max_attempts=2)
    # The first supervisor hangs on everything: attempt 0 ends by handler_timeout (a
    # reject), attempt 1 (the last) is still running when the whole supervisor is killed.
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first = start(nats_config(first_dir, nats_server, job={"max_attempts": 2,
                                                           "handler_timeout": 1.0}),
                  E2E_HANG_ALWAYS="1")
    wait_for(lambda: [a for _, a, _ in started(tmp_path)] == ["0", "1"], 30, "the last attempt")
    family = first.family()
    first.signal(signal.SIGKILL)
    first.wait(10)
    wait_for(lambda: not any(map(alive, family)), 10, "no process of the killed one left")
    state = consumer_state(nats_server)
    assert (state["stream"], state["dead"]) == (1, 0)  # in JetStream's hands, not settled

    second = start(nats_config(tmp_path, nats_server, job={"max_attempts": 2}))
    wait_for(lambda: consumer_state(nats_server)["dead"] == 1, 30, "the dead letter")
    wait_for(lambda: consumer_state(nats_server)["stream"] == 0, 10, "nothing stuck")
    [(raw, headers)] = dead_letters(nats_server)
    assert pid.encode() in raw
    assert headers["Queue-Reason"].startswith("out of attempts: delivery 3 of a consumer "
                                              "that allows 2 runs")
    assert len(started(tmp_path)) == 2  # never handed to a handler again
    second.signal(signal.SIGTERM)
    assert second.wait(15) == 0
    assert "out of attempts: delivery 3" in second.output()


@contextlib.contextmanager
def proxy_in_thread(port: int) -> Iterator[FaultProxy]:
    """A fault proxy on its own event loop, for a supervisor running in another process."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = asyncio.run_coroutine_threadsafe(FaultProxy(port).start(), loop).result(10)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.slow
def test_a_lost_ack_reply_holds_back_no_later_commit(tmp_path, nats_server, start):
    """SPEC §6: a success is confirmed as soon as its own reply arrives, not after an
    unrelated reply times out (the ack request timeout is 5 s)."""
    first = publish(nats_server, [{"n": n} for n in range(10)], ack_wait=30.0)
    with proxy_in_thread(nats_server.port) as proxy:
        # The reply to the first message's ack is lost on its way back.
        proxy.drop_replies_to_prefix(f"$JS.ACK.{NAMES.stream}.worker.1.1.")
        config = write_config(tmp_path, proxy.url, job={"prefetch": 30},
                              nats={"ack_wait": 30.0}, supervisor={"lease": 30})
        start(config)
        wait_for(lambda: sorted(handled(tmp_path)) == sorted(first), 20, "the first wave")
        wait_for(lambda: proxy.dropped == 1, 10, "the lost reply")
        second = publish(nats_server, [{"n": n} for n in range(10, 20)], ack_wait=30.0)
        began = time.monotonic()
        wait_for(lambda: len(handled(tmp_path)) == 20, 10, "the second wave")
        wait_for(lambda: consumer_state(nats_server)["ack_pending"] == 0, 10, "every ack")
        # Well inside the 5 s the lost reply takes to time out.
        assert time.monotonic() - began < 3.0
        assert set(handled(tmp_path)) == set(first) | set(second)


@pytest.mark.slow
def test_twenty_rolling_restarts_spend_no_attempt(tmp_path, nats_server, start):
    """Every stop releases what its supervisor held prefetched; with one attempt per job,
    a release that spent a delivery would dead-letter jobs that never ran."""
    pids = publish(nats_server, [{"n": n, "sleep": 0.01} for n in range(400)],
                   ack_wait=30.0, max_attempts=1)
    config = nats_config(tmp_path, nats_server, job={"prefetch": 50, "max_attempts": 1},
                         nats={"ack_wait": 30.0}, supervisor={"lease": 30})
    for restart in range(20):
        before = len(handled(tmp_path))
        supervisor = start(config)
        wait_for(lambda: consumer_state(nats_server)["ack_pending"] >= 10
                 or len(handled(tmp_path)) == len(pids), 20, "prefetched work")
        wait_for(lambda n=before: len(handled(tmp_path)) > n, 20, f"progress in run {restart}")
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(20) == 0
        assert consumer_state(nats_server)["ack_pending"] == 0  # all handed back at once
    start(config)
    wait_for(lambda: set(handled(tmp_path)) == set(pids), 60, "every message")
    state = consumer_state(nats_server)
    assert (state["dead"], state["stream"]) == (0, 0)
    assert {attempts for _, attempts, _ in started(tmp_path)} == {"0"}
    assert len(handled(tmp_path)) == len(pids)  # none ran twice
