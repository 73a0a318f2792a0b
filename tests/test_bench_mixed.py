"""``python -m bench.mixed`` (issue 38's mixed-duration benchmark): the workload it defines,
the records its one handler writes, its peers' processes, and the whole command at tiny
sizes. No figure is asserted, only that the table is made and says what happened: every
job done once, and no short job left behind the hung one by the supervisor."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import psutil
import pytest
import redis

from bench import mixed, mixed_jobs
from bench.common import child_env
from bench.latency import ENV_DIR
from support.supervision import ROOT

HAS_DRAMATIQ = importlib.util.find_spec("dramatiq") is not None


def test_one_job_in_every_hundred_is_slow_and_the_same_for_any_run_length():
    slow = [n for n in range(1000) if mixed_jobs.duration_ms(n, "mixed") == mixed_jobs.SLOW_MS]
    assert [n // 100 for n in slow] == list(range(10))
    assert {mixed_jobs.duration_ms(n, "mixed") for n in range(1000)} == {1, 500}
    assert [mixed_jobs.payload(n, "mixed")["ms"] for n in range(300)] == [
        mixed_jobs.duration_ms(n, "mixed") for n in range(300)]


def test_the_hung_workload_differs_by_its_one_hung_job():
    differ = [n for n in range(1000)
              if mixed_jobs.duration_ms(n, "mixed") != mixed_jobs.duration_ms(n, "mixed+hung")]
    assert differ == [mixed_jobs.HUNG_AT]
    assert mixed_jobs.duration_ms(mixed_jobs.HUNG_AT, "mixed+hung") == mixed_jobs.HUNG_MS
    assert mixed_jobs.hung("mixed+hung", 1000) == 1
    assert mixed_jobs.hung("mixed+hung", mixed_jobs.HUNG_AT) == 0  # never published
    assert mixed_jobs.hung("mixed", 1000) == 0


def test_the_records_say_what_ran_once_twice_and_not_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setattr(mixed_jobs, "_fd", None)
    for n in (0, 1, 1, 3):  # job 2 never ran, job 1 ran twice
        mixed_jobs.run({"n": n, "ms": 1, "t": 100.0 + n})
    assert mixed_jobs.finished(str(tmp_path)) == 4
    seen = mixed.outcome(tmp_path, "mixed", 4)
    assert (seen["done"], seen["ran_twice"], seen["not_done"]) == (3, 1, 1)
    record = next(r for r in seen["records"] if r.n == 3)
    assert record.published == 103.0
    assert record.ended - record.started >= 0.001
    assert record.waited == record.started - 103.0


def test_each_round_of_runs_starts_with_the_next_peer():
    names = ["ours", "dramatiq", "take-when-free"]
    assert [mixed.in_turn(names, r)[0] for r in range(4)] == [
        "ours", "dramatiq", "take-when-free", "ours"]


def _peer_processes(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["take-when-free", pytest.param(
    "dramatiq", marks=pytest.mark.skipif(not HAS_DRAMATIQ, reason="dramatiq not installed"))])
def test_a_peer_runs_the_jobs_and_its_processes_follow_it(peer, redis_url, tmp_path):
    """The peer runs the queue's jobs in its processes (one record each), and a SIGKILL of
    its parent ends them too (PDEATHSIG): a killed harness leaves no worker behind."""
    client = redis.Redis.from_url(redis_url)
    for source, destination in mixed.fill(redis_url, client, mixed.PEERS[peer], 30, "mixed"):
        client.rename(source, destination)
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.mixed_peers", peer, redis_url, "--processes", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env=child_env(**{ENV_DIR: str(tmp_path)}))
    family: list[psutil.Process] = []
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        family = _peer_processes(child.pid)
        assert len(family) == 2
        deadline = time.monotonic() + 60
        while mixed_jobs.finished(str(tmp_path)) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = mixed.outcome(tmp_path, "mixed", 30)
        assert (seen["done"], seen["ran_twice"]) == (30, 0)
        assert len({r.n for r in seen["records"]}) == 30
        child.kill()
        child.wait(10)
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [process.cmdline() for process in alive]
    finally:
        for process in [*family, psutil.Process(child.pid) if child.poll() is None else None]:
            if process is not None and process.is_running():
                process.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_command_makes_the_table_at_tiny_sizes(tmp_path):
    peers = ["ours", "take-when-free"] + (["dramatiq"] if HAS_DRAMATIQ else [])
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "bench.mixed", "--messages", "150", "--repeat", "1",
         "--processes", "2", "--latency-seconds", "1", "--give-up", "3",
         "--peers", ",".join(peers), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert [(row["workload"], row["processes"]) for row in rows] == [
        ("mixed", 2), ("mixed+hung", 2)]
    readme = (out / "README.md").read_text()
    assert "python -m bench.mixed --messages 150" in readme
    for row in rows:
        assert row["rate"] > 0
        assert list(row["peers"]) == peers
        for name, peer in row["peers"].items():
            assert f"| {row['workload']} | 2 | {peer['system']} ({peer['prefetch']}) |" in readme
            [backlog], [paced] = peer["backlog_runs"], peer["latency_runs"]
            assert "error" not in backlog and "error" not in paced, (name, backlog, paced)
            assert backlog["jobs_per_s"] > 0 and backlog["ran_twice"] == 0
            assert paced["ran_twice"] == 0 and paced["short"]["samples"] > 0
            assert peer["p50_ms"] <= peer["p99_ms"] <= peer["max_ms"]
            if name != "dramatiq":  # Dramatiq's prefetch strands a job behind the hung one
                assert backlog["not_done"] == 0 and paced["not_done"] == 0, (name, row)
                assert backlog["done"] == 150 - mixed_jobs.hung(row["workload"], 150)
    assert "- mixed, 2 processes: our p99" in readme
    assert "- mixed+hung, 2 processes: our p99" in readme
