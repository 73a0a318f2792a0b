"""A supervisor and queue-5 NATS workers on one JetStream queue: shared consumption, each
side killed with deliveries in flight, dead letters, and a rollback to PHP workers.

The PHP side is ``tests.queue5_nats`` (queue 5's Nats.php modelled from the facts); the
supervisor is the real ``python -m supervisor`` process.
"""

from __future__ import annotations

import asyncio
import collections
import signal
from pathlib import Path

import nats
import orjson
import pytest

from broker.nats.setup import QueueNames
from support import envelopes
from support.envelopes import publish_nats
from support.nats_jobs import queue_exists
from support.servers import NatsServer
from support.supervision import QUEUE, lines, write_config
from support.waiting import until
from tests.queue5_nats import Queue5NatsWorker

pytestmark = pytest.mark.slow  # every test here takes a second or more

NAMES = QueueNames.of(QUEUE)


async def php_publish(server: NatsServer, payloads: list[dict]) -> list[str]:
    return await publish_nats(server.url, NAMES.subject, envelopes.of(QUEUE, payloads))


async def state(server: NatsServer) -> dict[str, int]:
    client = await nats.connect(server.url)
    js = client.jetstream()
    info = await js.consumer_info(NAMES.stream, "worker")
    result = {
        "stream": (await js.stream_info(NAMES.stream)).state.messages,
        "dead": (await js.stream_info(NAMES.dead_stream)).state.messages,
        "ack_pending": info.num_ack_pending,
    }
    await client.close()
    return result


class PhpFleet:
    """Queue-5 workers running in this test's event loop; what they ran, by pid."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, int]] = []
        self.tasks: list[asyncio.Task] = []
        self.workers: list[Queue5NatsWorker] = []

    def run(self, worker: Queue5NatsWorker, pace: float = 0.0) -> None:
        self.workers.append(worker)
        self.tasks.append(asyncio.ensure_future(self._consume(worker, pace)))

    async def _consume(self, worker: Queue5NatsWorker, pace: float) -> None:
        while True:
            for job in await worker.receive(10, 0.5):
                self.ran.append((job.pid, job.attempts))
                await asyncio.sleep(pace)
                await worker.commit(job)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for worker in self.workers:
            await worker.close()


@pytest.fixture
async def fleet():
    php = PhpFleet()
    yield php
    await php.stop()


def handled(directory: Path) -> list[str]:
    return lines(directory / "handled")


def started(directory: Path) -> list[tuple[str, int]]:
    return [(pid, int(attempts)) for pid, attempts, _ in
            (line.split() for line in lines(directory / "started"))]


async def test_shared_consumption_runs_each_message_once(
    tmp_path, nats_server, supervisors, fleet, caplog
):
    php = await Queue5NatsWorker(nats_server.url, QUEUE).connect()  # provisions, N3
    supervisor = supervisors(write_config(tmp_path, nats_server.url, job={"prefetch": 20}))
    await until(lambda: "consuming" in supervisor.output(), 30, "the supervisor")
    pids = await php_publish(nats_server, [{"n": n, "sleep": 0.002} for n in range(400)])
    fleet.run(php, pace=0.005)
    everything = set(pids)
    await until(lambda: {p for p, _ in fleet.ran} | set(handled(tmp_path)) >= everything,
                60, "every message")
    await asyncio.sleep(0.5)  # a duplicate would show up now
    ours, theirs = handled(tmp_path), [p for p, _ in fleet.ran]
    assert ours and theirs  # both sides took part
    counts = collections.Counter(ours + theirs)
    assert set(counts) == everything and set(counts.values()) == {1}  # no duplicates
    assert {a for _, a in started(tmp_path)} | {a for _, a in fleet.ran} == {0}
    assert await state(nats_server) == {"stream": 0, "dead": 0, "ack_pending": 0}
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    output = supervisor.output()
    assert "5 attempts (MaxDeliver 6, delivery 6 dead-lettered on arrival)" in output
    assert "[job] max_attempts = 3 only applies to a consumer this supervisor creates" in output


async def test_php_worker_killed_with_deliveries_in_flight_the_supervisor_runs_them(
    tmp_path, nats_server, supervisors
):
    # ack_wait 3: the supervisor renews every lease/3 = 1 s, 2 s before it runs out.
    php = await Queue5NatsWorker(nats_server.url, QUEUE, ack_wait=3).connect()
    pids = await php_publish(nats_server, [{"n": n} for n in range(40)])
    held = await php.receive(20, 2)
    assert len(held) == 20
    await php.close()  # killed: its 20 deliveries are never settled
    supervisor = supervisors(write_config(tmp_path, nats_server.url, job={"prefetch": 20}))
    await until(lambda: set(handled(tmp_path)) == set(pids), 30, "every message")
    runs = dict(started(tmp_path))
    assert {runs[job.pid] for job in held} == {1}  # the PHP delivery counted as an attempt
    assert await state(nats_server) == {"stream": 0, "dead": 0, "ack_pending": 0}
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0


async def test_supervisor_killed_with_deliveries_in_flight_php_workers_run_them(
    tmp_path, nats_server, supervisors, fleet
):
    config = write_config(tmp_path, nats_server.url, job={"prefetch": 30},
                          nats={"ack_wait": 3}, supervisor={"lease": 3})  # renewals: 2 s slack
    supervisor = supervisors(config, E2E_HANG_ALWAYS="1")  # it creates the queue
    await until(lambda: queue_exists(nats_server), 20, "the queue")
    pids = await php_publish(nats_server, [{"n": n} for n in range(60)])
    await until(lambda: started(tmp_path), 20, "a handler to start")
    await until(lambda: _ack_pending(nats_server, 30), 10, "prefetch 30 held")
    supervisor.signal(signal.SIGKILL)  # with 1 running and 29 buffered
    supervisor.wait(10)
    php = await Queue5NatsWorker(nats_server.url, QUEUE).connect(mode="adopt")
    assert php.spare == 4  # the supervisor made MaxDeliver 3 + 1 with the mark
    fleet.run(php)
    await until(lambda: {p for p, _ in fleet.ran} == set(pids), 30, "every message")
    attempts = collections.Counter(a for _, a in fleet.ran)
    assert attempts == {0: 30, 1: 30}  # the 30 it held came back once, after ack_wait
    assert handled(tmp_path) == []
    assert await state(nats_server) == {"stream": 0, "dead": 0, "ack_pending": 0}


async def _ack_pending(server: NatsServer, count: int) -> bool:
    return (await state(server))["ack_pending"] == count


async def test_dead_letters_are_queue_5s_and_its_retry_brings_them_back(
    tmp_path, nats_server, supervisors, fleet
):
    config = write_config(tmp_path, nats_server.url, job={"max_attempts": 2})
    supervisor = supervisors(config)
    await until(lambda: queue_exists(nats_server), 20, "the queue")
    [failing] = await php_publish(nats_server, [{"fail": True}])
    client = await nats.connect(nats_server.url)
    await client.jetstream().publish(NAMES.subject, b'["not", "an", "object"]',
                                     headers={"Content-Type": "application/json"})
    await until(lambda: _dead(nats_server, 2), 30, "two dead letters")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    js = client.jetstream()
    first, second = [await js.get_msg(NAMES.dead_stream, seq) for seq in (1, 2)]
    by_body = {m.data: m.headers or {} for m in (first, second)}
    poison = by_body[b'["not", "an", "object"]']
    assert poison["Content-Type"] == "application/json"  # copied, as queue 5 parks
    [failed_raw] = [body for body in by_body if body != b'["not", "an", "object"]']
    assert orjson.loads(failed_raw)["pid"] == failing  # the bytes as they were stored
    assert "Content-Type" not in by_body[failed_raw]  # queue 5's reject writes none
    await client.close()

    php = await Queue5NatsWorker(nats_server.url, QUEUE, max_deliver=2).connect(mode="adopt")
    assert await php.retry() == 2
    fleet.run(php)
    await until(lambda: len(fleet.ran) == 1, 20, "the retried job")
    assert fleet.ran == [(failing, 0)]
    assert php.parked == ["payload could not be decoded"]


async def _dead(server: NatsServer, count: int) -> bool:
    return (await state(server))["dead"] == count


async def test_rollback_php_workers_take_over_released_work_with_the_whole_budget(
    tmp_path, nats_server, supervisors, fleet
):
    php_setup = await Queue5NatsWorker(nats_server.url, QUEUE, ack_wait=30).connect()
    await php_setup.close()  # the PHP fleet made the queue (N3); it is stopped for now
    pids = await php_publish(nats_server, [{"n": n, "sleep": 0.05} for n in range(60)])
    config = write_config(tmp_path, nats_server.url, job={"prefetch": 40},
                          supervisor={"lease": 30})
    supervisor = supervisors(config)
    await until(lambda: len(handled(tmp_path)) >= 3, 20, "some progress")
    supervisor.signal(signal.SIGTERM)  # the rollback: stop the supervisor, start PHP
    assert supervisor.wait(20) == 0
    assert (await state(nats_server))["ack_pending"] == 0  # released, not left to ack_wait
    php = await Queue5NatsWorker(nats_server.url, QUEUE).connect()
    fleet.run(php)
    done = set(handled(tmp_path))
    await until(lambda: {p for p, _ in fleet.ran} | done == set(pids), 20, "every message")
    assert not done & {p for p, _ in fleet.ran}
    assert {a for _, a in fleet.ran} == {0}  # released work kept its whole budget
    assert await state(nats_server) == {"stream": 0, "dead": 0, "ack_pending": 0}


async def test_rollback_with_retries_and_dead_letters_in_flight(
    tmp_path, nats_server, supervisors, fleet, run
):
    """Issue 39.5: the rollback to PHP workers by ``drain`` while retries wait out their
    NAK delay in JetStream and dead letters sit in the dead stream. ``drain`` stops the
    supervisor and ends ok, ``check`` agrees; the PHP worker gets each waiting retry when
    its delay is over (attempts 1, once) and runs the dead letters its retry() moves back:
    nothing is left in the work or dead stream, nothing unacknowledged."""
    log = tmp_path / "succeeded"
    conf = {"max_attempts": 2}
    first = supervisors(write_config(tmp_path, nats_server.url, job={**conf, "retry_backoff": 1},
                                     handler="tests.handlers.fails_until:handle"))
    await until(lambda: queue_exists(nats_server), 20, "the queue")
    doomed = await php_publish(nats_server, [{"succeed_at": 99, "log": str(log)}] * 5)
    await until(lambda: _dead(nats_server, 5), 60, "five dead letters")
    first.signal(signal.SIGTERM)
    assert first.wait(20) == 0
    config = write_config(tmp_path, nats_server.url, job={**conf, "retry_backoff": 12},
                          handler="tests.handlers.fails_until:handle")
    second = supervisors(config)
    waiting = await php_publish(nats_server, [{"succeed_at": 1, "log": str(log)}] * 5)
    easy = await php_publish(nats_server, [{"succeed_at": 0, "log": str(log)}] * 20)
    await until(lambda: len(lines(log)) == 20, 30, "the jobs that succeed at once")
    await until(lambda: second.output().count("attempt 0 fails on purpose") >= 5, 30,
                "the five first runs to fail (their retries wait 12 s)")

    php = await Queue5NatsWorker(nats_server.url, QUEUE).connect(mode="adopt")
    fleet.run(php)
    code, out = await run("drain", str(config), "--timeout", "30")
    assert code == 0 and "ok: no supervisor of ours answers" in out, out
    code, out = await run("check", str(config))
    assert code == 0, out
    assert await php.retry() == 5
    await until(lambda: {pid for pid, _ in fleet.ran} >= set(waiting) | set(doomed), 60,
                "the PHP worker to run the retries and the dead letters")
    ran = collections.Counter(pid for pid, _ in fleet.ran)
    assert all(ran[pid] == 1 for pid in waiting + doomed)
    assert {attempts for pid, attempts in fleet.ran if pid in waiting} == {1}
    assert {attempts for pid, attempts in fleet.ran if pid in doomed} == {0}  # afresh
    assert not set(easy) & set(ran)  # the supervisor had finished those
    assert await state(nats_server) == {"stream": 0, "dead": 0, "ack_pending": 0}

