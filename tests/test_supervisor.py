"""End-to-end tests of ``python -m supervisor`` with a real redis-server and real processes."""

from __future__ import annotations

import collections
import functools
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest

from broker import envelope
from support import processes
from support.envelopes import publish
from support.servers import environ_without_broker
from support.supervision import (
    QUEUE,
    ROOT,
    counter,
    keys,
    lines,
    outstanding,
    wait_for,
    write_config,
)


@pytest.fixture
def start(supervisors, redis_url: str):
    """start(config, **env): a supervisor on this test's Redis, stopped afterwards."""
    return functools.partial(supervisors, redis_url=redis_url)


def handled(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "handled")


@pytest.mark.slow
def test_prefetch_bounds_outstanding_deliveries_and_all_are_handled_once(
    tmp_path, redis_url, client, start
):
    pids = publish(client, [{"n": n, "sleep": 0.001} for n in range(1500)])
    config = write_config(tmp_path, redis_url, job={"coroutines": 1, "prefetch": 100})
    supervisor = start(config)
    samples = []
    while len(handled(tmp_path)) < len(pids):
        samples.append(outstanding(client))
        assert supervisor.process.poll() is None, supervisor.output()
        time.sleep(0.005)
    assert max(samples) <= 100
    assert max(samples) > 1  # it really did prefetch
    assert sorted(handled(tmp_path)) == sorted(pids)
    wait_for(lambda: counter(client, "success") == len(pids), 10, "all commits")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    assert counter(client, "processing") == 0 and outstanding(client) == 0
    assert client.keys("utopia-queue.consumers.*") == []  # gone from `status` at once


def test_sparse_queue_message_is_handled_promptly(tmp_path, redis_url, client, start):
    # A long blocking timeout: waiting for a batch to fill would take 20 s, so "promptly"
    # can be told apart with seconds to spare on a loaded machine.
    config = write_config(tmp_path, redis_url, job={"prefetch": 100},
                          broker={"block_timeout": 20.0})
    supervisor = start(config)
    wait_for(lambda: "consuming" in supervisor.output(), 15, "the supervisor to start")
    time.sleep(0.5)  # it is now blocked on the empty queue
    began = time.monotonic()
    [pid] = publish(client, [{"n": 1}])
    wait_for(lambda: handled(tmp_path) == [pid], 15, "the one message")
    # Well within the blocking timeout (20 s), not after a batch of 100 filled.
    assert time.monotonic() - began < 10


@pytest.mark.slow
def test_graceful_stop_releases_unstarted_and_finishes_the_running_one(
    tmp_path, redis_url, client, start
):
    payloads = [{"n": 0, "sleep": 2.0}] + [{"n": n} for n in range(1, 50)]
    pids = publish(client, payloads)
    config = write_config(tmp_path, redis_url, job={"prefetch": 50},
                          supervisor={"shutdown_deadline": 30})
    supervisor = start(config)
    wait_for(lambda: lines(tmp_path / "started"), 15, "the first handler to start")
    wait_for(lambda: outstanding(client) == 50, 5, "all 50 prefetched")
    began = time.monotonic()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()
    assert time.monotonic() - began < 10  # well before the 30 s deadline
    assert handled(tmp_path) == [pids[0]]
    ready = [orjson.loads(raw) for raw in client.lrange(keys().ready, 0, -1)]
    assert sorted(e["pid"] for e in ready) == sorted(pids[1:])
    assert all(e.get("attempts", 0) == 0 for e in ready)
    # Released to the consumer end in order: the next consumer takes pids[1] first.
    assert orjson.loads(client.lindex(keys().ready, -1))["pid"] == pids[1]
    assert counter(client, "success") == 1
    assert outstanding(client) == 0 and counter(client, "processing") == 0


@pytest.mark.slow
def test_bounded_stop_kills_a_hung_handler_and_requeues_its_delivery(
    tmp_path, redis_url, client, start
):
    [pid] = publish(client, [{"n": 1}])
    deadline = 3
    config = write_config(tmp_path, redis_url, supervisor={"shutdown_deadline": deadline})
    supervisor = start(config, E2E_HANG_ALWAYS="1")
    wait_for(lambda: lines(tmp_path / "started"), 15, "the handler to start")
    family = supervisor.family()
    assert len(family) >= 3  # supervisor, fork server, handler
    began = time.monotonic()
    supervisor.signal(signal.SIGTERM)
    supervisor.wait(deadline + 10)
    assert time.monotonic() - began < deadline + 3
    _, alive = psutil.wait_procs(family, timeout=3)
    assert not alive, f"processes survived the stop: {alive}"
    # The stopping supervisor requeued it itself (the killed run counts), as recovery would:
    # nothing it owned outlives it (a queue-5 worker would wait reapAfter, 25 h, for it).
    assert outstanding(client) == 0 and counter(client, "processing") == 0
    [requeued] = [orjson.loads(raw) for raw in client.lrange(keys().ready, 0, -1)]
    assert (requeued["pid"], requeued["attempts"]) == (pid, 1)
    # A second supervisor handles it.
    second = start(write_config(tmp_path, redis_url))
    wait_for(lambda: handled(tmp_path) == [pid], 20, "a second supervisor to handle it")
    second.signal(signal.SIGTERM)
    assert second.wait(15) == 0


def test_killed_handler_is_replaced_and_its_message_ends_in_failed(
    tmp_path, redis_url, client, start
):
    [crasher] = publish(client, [{"crash": True}])
    config = write_config(tmp_path, redis_url, job={"max_attempts": 3})
    supervisor = start(config)
    wait_for(lambda: client.lrange(keys().failed, 0, -1) == [crasher.encode()], 30,
             "the crashing message to reach failed")
    starts = [line.split() for line in lines(tmp_path / "started")]
    assert [attempts for pid, attempts, _ in starts] == ["0", "1", "2"]
    assert len({process for _, _, process in starts}) == 3  # a new process each time
    record = orjson.loads(client.get(keys().job(crasher)))
    assert record["attempts"] == 2  # the record of the last run, kept as queue 5 keeps it
    # The replacement handles ordinary work.
    [ok] = publish(client, [{"n": 1}])
    wait_for(lambda: handled(tmp_path) == [ok], 10, "work after the crashes")
    # Each death is told with the job it hit and what follows, in one line.
    told = [line for line in supervisor.output().splitlines() if "worker lost" in line]
    assert told and all(
        f"while handling {crasher}: that run failed" in line
        and "a new handler process takes its place" in line for line in told
    ), told


def test_failing_handler_is_rejected_by_policy_and_malformed_never_reaches_it(
    tmp_path, redis_url, client, start
):
    [failing] = publish(client, [{"fail": True}])
    client.lpush(keys().ready, b"{not json", b'["array"]')
    [ok] = publish(client, [{"n": 2}])
    config = write_config(tmp_path, redis_url, job={"max_attempts": 2})
    supervisor = start(config)
    wait_for(lambda: client.lrange(keys().failed, 0, -1) == [failing.encode()], 20,
             "the failing message to reach failed")
    wait_for(lambda: handled(tmp_path) == [ok], 10, "the good message")
    assert sorted(client.lrange(keys().poison, 0, -1)) == sorted([b"{not json", b'["array"]'])
    started = [line.split()[0] for line in lines(tmp_path / "started")]
    assert collections.Counter(started) == {failing: 2, ok: 1}
    assert counter(client, "failed") == 2  # two failed runs; poison counts in no counter
    # Exactly one log line per malformed message, with its reason and never its bytes.
    malformed = [line for line in supervisor.output().splitlines() if "malformed" in line]
    assert len(malformed) == 2, malformed
    assert not any("not json" in line or "array\\\"]" in line for line in malformed)
    assert any("invalid JSON" in line for line in malformed)
    assert any("array" in line for line in malformed)


def test_a_hostile_pid_leaves_short_safe_log_lines(tmp_path, redis_url, client, start):
    # Terminal escapes, a forged record after CR/LF, 100 KB: the handler's error repeats it.
    pid = "\x1b[2J\x1b[H" + "p\r\n2026-01-01 ERROR supervisor[1]: forged " + "x" * 100_000
    client.lpush(keys().ready, envelope.build(QUEUE, {"fail": True}, pid=pid)[1])
    supervisor = start(write_config(tmp_path, redis_url, job={"max_attempts": 1}))
    wait_for(lambda: client.lrange(keys().failed, 0, -1) == [pid.encode()], 20,
             "the message to fail")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    output = supervisor.output()
    assert "\x1b" not in output and "\r" not in output
    records = [orjson.loads(line) for line in output.splitlines()]  # no forged line
    [failed] = [r for r in records if "failed: RuntimeError: asked to fail" in r["message"]]
    assert failed["message"].startswith("job \\x1b[2J\\x1b[Hp\\x0d\\x0a2026-01-01 ERROR")
    assert "...[cut: 100" in failed["message"]
    for line in output.splitlines():
        assert len(line) < 2000, line[:300]


@pytest.mark.slow
def test_supervisor_killed_midway_loses_nothing(tmp_path, redis_url, client, start):
    # 0.02 s each: ~3 s of work is left after "some progress", so the kill finds some held.
    pids = publish(client, [{"n": n, "sleep": 0.02} for n in range(400)])
    config = write_config(tmp_path, redis_url, handler="tests.handlers.e2e_record:handle",
                          job={"prefetch": 50, "coroutines": 2})
    first = start(config)
    wait_for(lambda: len(handled(tmp_path)) > 100, 30, "some progress")
    for process in first.family():
        processes.kill(process)
    first.wait(10)
    assert outstanding(client) > 0  # it died holding work
    second = start(config)
    wait_for(lambda: set(handled(tmp_path)) == set(pids), 60, "every pid handled")
    wait_for(lambda: outstanding(client) == 0 and client.llen(keys().ready) == 0, 20,
             "nothing left behind")
    second.signal(signal.SIGTERM)
    assert second.wait(15) == 0


@pytest.mark.slow
def test_on_success_runs_only_after_the_commit_is_confirmed(tmp_path, redis_url, client, start):
    pids = publish(client, [{"n": n} for n in range(200)])
    start(write_config(tmp_path, redis_url, job={"prefetch": 20}))
    wait_for(lambda: len(lines(tmp_path / "succeeded")) == len(pids), 30, "on_success calls")
    states = collections.Counter(line.split()[1] for line in lines(tmp_path / "succeeded"))
    assert states == {"confirmed": len(pids)}


def test_a_failing_flush_leaves_its_messages_uncommitted(tmp_path, redis_url, client, start):
    pids = publish(client, [{"n": n} for n in range(5)])
    config = write_config(tmp_path, redis_url, handler="tests.handlers.e2e_flushing:handle",
                          job={"max_attempts": 2})
    start(config, E2E_FLUSH_FAIL="1")
    wait_for(lambda: client.llen(keys().failed) == len(pids), 30, "all to fail")
    assert counter(client, "success") == 0
    assert not lines(tmp_path / "succeeded")
    assert not lines(tmp_path / "flushed")


@pytest.mark.parametrize("job", [
    {"prefetch": 100, "flush_every": 50},
    # Dispatch fills one process before the next for a handler with flush() (16 of 8 or
    # 32 here): the same messages flushed and committed, each once, also when flush_every
    # is below what one process is given.
    {"prefetch": 8, "coroutines": 4},
    {"prefetch": 32, "coroutines": 4, "flush_every": 5},
])
def test_flush_barrier_commits_after_flush(tmp_path, redis_url, client, start, job):
    pids = publish(client, [{"n": n} for n in range(300)])
    config = write_config(tmp_path, redis_url, handler="tests.handlers.e2e_flushing:handle",
                          job=job)
    start(config)
    wait_for(lambda: len(lines(tmp_path / "succeeded")) == len(pids), 30, "on_success calls")
    assert sorted(lines(tmp_path / "flushed")) == sorted(pids)
    assert counter(client, "success") == len(pids)


def test_a_failure_reported_ahead_of_held_successes_keeps_the_accounting(
    tmp_path, redis_url, client, start
):
    # A plain handler with flush() holds its successes; one that raises is FAILED at once,
    # ahead of the DONE of the held ones before it. Without STARTED records the supervisor
    # must take that as "the held ones before it started" (it exited 4 with AccountingError
    # 'handler 1 reported delivery 41, next queued 26' in the chaos soaks).
    payloads = [{"n": n, "fail": n % 7 == 3} for n in range(400)]
    pids = publish(client, payloads)
    failing = {pid for pid, payload in zip(pids, payloads, strict=True) if payload["fail"]}
    config = write_config(tmp_path, redis_url, handler="tests.handlers.e2e_flushing:handle",
                          job={"prefetch": 100, "coroutines": 2, "flush_every": 50,
                               "max_attempts": 1})
    supervisor = start(config)
    wait_for(lambda: len(lines(tmp_path / "succeeded")) == len(pids) - len(failing)
             or supervisor.process.poll() is not None, 60, "every success confirmed")
    assert supervisor.process.poll() is None, supervisor.output()
    wait_for(lambda: client.llen(keys().failed) == len(failing), 30, "the failures recorded")
    assert sorted(lines(tmp_path / "flushed")) == sorted(set(pids) - failing)
    assert counter(client, "success") == len(pids) - len(failing)
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("job", "extra", "expected"),
    [
        ({"prefetch": 1, "coroutines": 4}, "", "prefetch"),
        ({"prefetchh": 5}, "", "prefetchh"),
        ({"handler": "tests.handlers.nonexistent:handle"}, "", "handler"),
        ({"maxCoroutines": 2, "coroutines": 2}, "", "maxCoroutines"),
        ({}, "bad-url", "url"),
    ],
)
def test_bad_configuration_exits_2_and_consumes_nothing(
    tmp_path, redis_url, client, start, job, extra, expected
):
    publish(client, [{"n": 1}])
    url = "http://127.0.0.1:1" if extra == "bad-url" else redis_url
    config = write_config(tmp_path, url, job=job)
    supervisor = start(config)
    assert supervisor.wait(30) == 2
    output = supervisor.output()
    assert expected in output and str(config) in output
    assert len(output.strip().splitlines()) == 1, output
    assert client.llen(keys().ready) == 1 and outstanding(client) == 0


@pytest.mark.parametrize(
    ("supervisor_keys", "address_space", "expected"),
    [
        ({"ring_slots": 2**40}, None, "ring_slot_size * ring_slots = 256 * 1099511627776"),
        # 4 handlers x 2 rings of 512 MiB under a 2 GiB address-space limit: mmap fails.
        ({"ring_slot_size": 65536, "ring_slots": 8192}, 2 * 2**30,
         "the handler rings need 4,294,969,344 bytes of shared memory"),
    ],
)
def test_rings_too_large_exit_2_with_one_line(
    tmp_path, redis_url, client, supervisor_keys, address_space, expected
):
    publish(client, [{"n": 1}])
    config = write_config(tmp_path, redis_url, job={"coroutines": 4},
                          supervisor=supervisor_keys)

    def limit_memory() -> None:
        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    done = subprocess.run(
        [sys.executable, "-m", "supervisor", str(config)], cwd=ROOT, capture_output=True,
        text=True, timeout=60, preexec_fn=limit_memory,
        env=dict(environ_without_broker(), PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: {config}: ") and expected in done.stderr
    assert client.llen(keys().ready) == 1 and outstanding(client) == 0


def handler_processes(tmp_path: Path) -> list[str]:
    """The handler process id of each started message, in order."""
    return [line.split()[2] for line in lines(tmp_path / "started")]


@pytest.mark.slow
def test_handler_timeout_kills_the_process_and_fails_the_delivery(
    tmp_path, redis_url, client, start
):
    [hung] = publish(client, [{"hang": True}])
    config = write_config(tmp_path, redis_url, job={"handler_timeout": 1.0, "max_attempts": 1})
    supervisor = start(config)
    wait_for(lambda: client.lrange(keys().failed, 0, -1) == [hung.encode()], 20,
             "the hung message to fail")
    assert "handler timeout" in supervisor.output()
    [ok] = publish(client, [{"n": 1}])
    wait_for(lambda: handled(tmp_path) == [ok], 10, "work after the timeout")
    assert len(set(handler_processes(tmp_path))) == 2  # the killed process was replaced


def test_handler_process_is_recycled_after_max_jobs(tmp_path, redis_url, client, start):
    pids = publish(client, [{"n": n} for n in range(9)])
    config = write_config(tmp_path, redis_url, job={"max_jobs_per_process": 3, "prefetch": 1})
    start(config)
    wait_for(lambda: len(handled(tmp_path)) == len(pids), 30, "all messages")
    processes = handler_processes(tmp_path)
    assert sorted(handled(tmp_path)) == sorted(pids)
    assert [processes.count(p) for p in dict.fromkeys(processes)] == [3, 3, 3]


@pytest.mark.slow
def test_handler_process_is_recycled_above_max_rss(tmp_path, redis_url, client, start):
    pids = publish(client, [{"grow": 120}, {"n": 1}, {"n": 2}])
    config = write_config(tmp_path, redis_url, job={"max_rss_mb": 100, "prefetch": 1})
    supervisor = start(config)
    wait_for(lambda: len(handled(tmp_path)) == len(pids), 30, "all messages")
    processes = handler_processes(tmp_path)
    assert processes[0] != processes[1]  # replaced after the message that grew it
    assert "recycling handler 0" in supervisor.output()


@pytest.mark.slow
def test_process_titles_show_queue_buffer_and_busy_state(tmp_path, redis_url, client, start):
    publish(client, [{"hang": True}])
    supervisor = start(write_config(tmp_path, redis_url))
    wait_for(lambda: lines(tmp_path / "started"), 15, "the handler to start")

    def titles() -> list[str]:
        return [processes.title(p).strip() for p in supervisor.family()]

    wait_for(lambda: any("[buffer 1/10, 1/1 busy]" in t for t in titles()), 5, "parent title")
    assert any(t.startswith("queue-supervisor: e2e running") for t in titles())
    assert any(t == "queue-supervisor: fork server" for t in titles())
    [pid] = [line.split()[0] for line in lines(tmp_path / "started")]
    wait_for(lambda: any(t.startswith(f"queue-supervisor: e2e handler 0 busy: job {pid} "
                                      "attempt 1 since ") for t in titles()), 5, "child title")


def test_second_signal_skips_to_the_kill(tmp_path, redis_url, client, start):
    publish(client, [{"hang": True}])
    config = write_config(tmp_path, redis_url, supervisor={"shutdown_deadline": 60})
    supervisor = start(config)
    wait_for(lambda: lines(tmp_path / "started"), 15, "the handler to start")
    family = supervisor.family()
    supervisor.signal(signal.SIGTERM)
    time.sleep(0.3)
    began = time.monotonic()
    supervisor.signal(signal.SIGINT)
    assert supervisor.wait(20) == 0
    assert time.monotonic() - began < 10  # nowhere near the 60 s deadline
    _, alive = psutil.wait_procs(family, timeout=3)
    assert not alive


@pytest.mark.slow
def test_no_process_survives_a_killed_supervisor(tmp_path, redis_url, client, start):
    publish(client, [{"hang": True}])
    supervisor = start(write_config(tmp_path, redis_url, job={"coroutines": 2, "prefetch": 2}))
    wait_for(lambda: lines(tmp_path / "started"), 15, "the handler to start")
    family = supervisor.family()
    assert len(family) == 5  # supervisor, fork server, handler server, two handlers
    supervisor.signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"orphans: {alive}"


@pytest.mark.slow
def test_extreme_envelopes_neither_stop_receiving_nor_reach_a_handler_wrongly(
    tmp_path, redis_url, client, start
):
    """Hole 2: ``"attempts": 4294967296`` passed decoding, then failed packing into the ring
    inside dispatch: the receive task died without a log line and the supervisor held its
    deliveries forever. Every attempts value PHP accepts now travels to the handler (it still
    runs: attempts only counts earlier runs); one beyond 64 bits is poison."""
    base = {"queue": keys().queue, "timestamp": int(time.time()), "payload": {"n": 0}}
    big = orjson.dumps({**base, "pid": "big-attempts", "attempts": 4294967296})
    huge = orjson.dumps({**base, "pid": "huge-attempts"})[:-1]
    huge += b',"attempts":18446744073709551616}'
    client.lpush(keys().ready, big, huge)
    after = publish(client, [{"n": n} for n in range(1, 4)])
    config = write_config(tmp_path, redis_url, job={"prefetch": 10})
    supervisor = start(config)
    wait_for(lambda: sorted(handled(tmp_path)) == sorted(["big-attempts", *after]), 20,
             "the big-attempts message and every later one handled")
    assert supervisor.process.poll() is None, supervisor.output()
    assert client.lrange(keys().poison, 0, -1) == [huge]
    wait_for(lambda: counter(client, "success") == 4, 10, "all commits")
    started = {line.split()[0]: line.split()[1] for line in lines(tmp_path / "started")}
    assert started["big-attempts"] == "4294967296"
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0


@pytest.mark.slow
def test_progress_lines_and_the_stop_line_say_what_happened(tmp_path, redis_url, client, start):
    pids = publish(client, [{"n": n, "sleep": 0.05} for n in range(30)]
                   + [{"fail": True}])
    config = write_config(tmp_path, redis_url, job={"prefetch": 2, "max_attempts": 1},
                          supervisor={"progress_interval": 0.3})
    supervisor = start(config)
    wait_for(lambda: "progress:" in supervisor.output(), 15, "a progress line")
    wait_for(lambda: len(handled(tmp_path)) == len(pids) - 1, 30, "all messages")
    # The failing job is the last: an idle line may come while it still waits in prefetch.
    wait_for(lambda: counter(client, "failed") == 1, 10, "the failing job settled")
    wait_for(lambda: "oldest ready none waiting" in supervisor.output(), 10, "an idle line")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    messages = [orjson.loads(line)["message"] for line in supervisor.output().splitlines()
                if line.startswith("{")]
    progress = [m for m in messages if m.startswith("progress:")]
    assert any(re.search(r"oldest ready \d+\.\ds$", m) for m in progress)  # a backlog
    assert re.search(r"jobs/s, \d+ done, \d+ failed, 0 released", progress[0])
    [stopped] = [m for m in messages if m.startswith("stopped after")]
    assert "30 done, 1 failed, 0 released, 0 malformed" in stopped
    assert stopped.endswith("0 handed to recovery")
