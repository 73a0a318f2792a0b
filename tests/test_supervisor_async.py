"""End-to-end: ``python -m supervisor`` with an async def handler (tests.handlers.
e2e_aio_record), several deliveries at once per process, on a private redis-server."""

from __future__ import annotations

import collections
import functools
import signal
import time
from pathlib import Path

import orjson
import psutil
import pytest

from support.envelopes import publish
from support.supervision import counter, keys, lines, outstanding, wait_for, write_config

pytestmark = pytest.mark.slow  # every test here takes a second or more

HANDLER = "tests.handlers.e2e_aio_record:handle"


@pytest.fixture
def start(supervisors, redis_url: str):
    return functools.partial(supervisors, redis_url=redis_url)


def config_for(tmp_path: Path, redis_url: str, **job):
    return write_config(tmp_path, redis_url, handler=HANDLER, job=job)


def started(tmp_path: Path) -> list[list[str]]:
    """[pid, attempts, process, in flight] per handler call."""
    return [line.split() for line in lines(tmp_path / "started")]


def attempts_of(tmp_path: Path) -> dict[str, list[int]]:
    runs: dict[str, list[int]] = collections.defaultdict(list)
    for pid, attempts, _, _ in started(tmp_path):
        runs[pid].append(int(attempts))
    return runs


def handled(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "handled")


def test_many_at_once_per_process_prefetch_bounded_all_confirmed_once(
    tmp_path, redis_url, client, start
):
    pids = publish(client, [{"n": n, "sleep": 0.2} for n in range(400)])
    supervisor = start(config_for(tmp_path, redis_url, coroutines=2, tasks_per_process=40,
                                  prefetch=100))
    samples = []
    while len(lines(tmp_path / "succeeded")) < len(pids):
        samples.append(outstanding(client))
        assert supervisor.process.poll() is None, supervisor.output()
        time.sleep(0.01)
    assert max(samples) <= 100
    calls = started(tmp_path)
    assert len({process for _, _, process, _ in calls}) == 2
    assert max(int(in_flight) for *_, in_flight in calls) >= 30  # really at once
    assert sorted(handled(tmp_path)) == sorted(pids) == sorted(lines(tmp_path / "flushed"))
    states = collections.Counter(line.split()[1] for line in lines(tmp_path / "succeeded"))
    assert states == {"confirmed": len(pids)}  # every async on_success after its commit
    wait_for(lambda: counter(client, "success") == len(pids), 10, "all commits")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    assert outstanding(client) == 0


def test_a_process_killed_with_tasks_in_flight_blames_the_running_not_the_returned(
    tmp_path, redis_url, client, start
):
    # One process, ten tasks: three return at once and wait for a gated flush(), three wait
    # on a gate, one kills the process half a second in (first attempt only).
    flush_gate, gate = tmp_path / "flush-gate", "gate"
    returned = publish(client, [{"n": n} for n in range(3)])
    running = publish(client, [{"gate": gate} for _ in range(3)])
    [crasher] = publish(client, [{"crash_once": 0.5}])
    supervisor = start(config_for(tmp_path, redis_url, tasks_per_process=10, max_attempts=3),
                       E2E_FLUSH_GATE=str(flush_gate))
    wait_for(lambda: "worker lost" in supervisor.output(), 20, "the process to die")
    wait_for(lambda: len(started(tmp_path)) >= 14, 20, "every delivery to run again")
    flush_gate.touch()
    (tmp_path / gate).touch()
    wait_for(lambda: counter(client, "success") == 7, 20, "all seven committed")
    runs = attempts_of(tmp_path)
    assert all(runs[pid] == [0, 0] for pid in returned), runs  # returned: no attempt
    assert all(runs[pid] == [0, 1] for pid in running), runs  # running: worker lost
    assert runs[crasher] == [0, 1]
    assert len({process for _, _, process, _ in started(tmp_path)}) == 2
    assert client.llen(keys().failed) == 0 and outstanding(client) == 0


def test_the_timeout_cancels_a_yielding_task_and_the_process_lives_on(
    tmp_path, redis_url, client, start
):
    [hung] = publish(client, [{"hang": True}])
    supervisor = start(config_for(tmp_path, redis_url, tasks_per_process=4, handler_timeout=1.0,
                                  max_attempts=1))
    wait_for(lambda: client.lrange(keys().failed, 0, -1) == [hung.encode()], 20, "the failure")
    [ok] = publish(client, [{"n": 1}])
    wait_for(lambda: handled(tmp_path) == [ok], 10, "work after the timeout")
    assert len({process for _, _, process, _ in started(tmp_path)}) == 1  # never killed
    assert "handler timeout after 1.0s" in supervisor.output()
    assert "worker lost" not in supervisor.output()


def test_a_task_blocking_the_loop_is_killed_after_the_grace_and_a_later_one_is_spared(
    tmp_path, redis_url, client, start
):
    # handler_timeout 6 s. The blocker starts at 0 and blocks the loop from 5.5 s, so it
    # cannot be cancelled (its timer is due before the timeout's); the bystander starts at
    # ~1 s (it has until 5.5 s to get going) and waits on a gate. The kill comes at
    # 6 + 2 (grace) s, when only the blocker is past its time.
    [blocker] = publish(client, [{"wait_then_block": [5.5, 60]}])
    supervisor = start(config_for(tmp_path, redis_url, tasks_per_process=4, handler_timeout=6.0,
                                  max_attempts=1))
    wait_for(lambda: started(tmp_path), 20, "the blocker to start")
    time.sleep(1.0)
    [bystander] = publish(client, [{"gate": "gate"}])
    wait_for(lambda: len(started(tmp_path)) == 2, 5, "the bystander to start")
    wait_for(lambda: client.lrange(keys().failed, 0, -1) == [blocker.encode()], 20,
             "the blocker to fail")
    (tmp_path / "gate").touch()
    wait_for(lambda: bystander in handled(tmp_path), 20, "the bystander, run again")
    assert attempts_of(tmp_path)[bystander] == [0, 0]  # no attempt counted against it
    assert "handler timeout after 6.0s (not cancelled within 2s)" in supervisor.output()


def test_graceful_stop_finishes_running_tasks_and_releases_the_rest(
    tmp_path, redis_url, client, start
):
    pids = publish(client, [{"n": n, "sleep": 1.5} for n in range(30)])
    supervisor = start(config_for(tmp_path, redis_url, tasks_per_process=10, prefetch=30))
    wait_for(lambda: len(started(tmp_path)) == 10, 15, "ten tasks running")
    wait_for(lambda: outstanding(client) == 30, 5, "all prefetched")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()
    first = [pid for pid, *_ in started(tmp_path)]
    assert sorted(handled(tmp_path)) == sorted(first) and len(first) == 10
    assert counter(client, "success") == 10
    ready = [orjson.loads(raw) for raw in client.lrange(keys().ready, 0, -1)]
    assert sorted(e["pid"] for e in ready) == sorted(set(pids) - set(first))
    assert all(e.get("attempts", 0) == 0 for e in ready)
    assert outstanding(client) == 0


def test_bounded_stop_kills_hung_tasks_and_requeues_them_for_a_second_supervisor(
    tmp_path, redis_url, client, start
):
    pids = publish(client, [{"n": n} for n in range(5)])
    config = write_config(tmp_path, redis_url, handler=HANDLER,
                          job={"tasks_per_process": 5}, supervisor={"shutdown_deadline": 3})
    supervisor = start(config, E2E_HANG_ALWAYS="1")
    wait_for(lambda: len(started(tmp_path)) == 5, 15, "five hung tasks")
    title = psutil.Process(supervisor.pid).cmdline
    wait_for(lambda: " ".join(title()).strip().endswith("1/1 busy, 5 running]"), 5, "the title")
    began = time.monotonic()
    supervisor.signal(signal.SIGTERM)
    supervisor.wait(15)
    assert time.monotonic() - began < 3 + 3
    # Requeued by the stopping supervisor, as recovery would (not released, not blamed):
    # the killed runs count, nothing stays owned by it.
    assert outstanding(client) == 0
    ready = [orjson.loads(raw) for raw in client.lrange(keys().ready, 0, -1)]
    assert sorted(e["pid"] for e in ready) == sorted(pids)
    assert all(e["attempts"] == 1 for e in ready)
    start(config)
    wait_for(lambda: sorted(handled(tmp_path)) == sorted(pids), 30, "the second supervisor")


def test_recycling_after_max_jobs_with_tasks_in_flight(tmp_path, redis_url, client, start):
    pids = publish(client, [{"n": n, "sleep": 0.05} for n in range(30)])
    start(config_for(tmp_path, redis_url, tasks_per_process=4, prefetch=4,
                     max_jobs_per_process=10))
    wait_for(lambda: sorted(handled(tmp_path)) == sorted(pids), 30, "all messages")
    counts = list(collections.Counter(process for _, _, process, _ in started(tmp_path)).values())
    # Each retires after 10 and finishes what it held then (at most 4 more).
    assert len(counts) >= 3 and all(10 <= count <= 14 for count in counts[:-1]), counts
