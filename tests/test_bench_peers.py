"""``python -m bench --peers``: which Dramatiq runs it makes (``--peer-prefetch``). The runs
themselves are replaced by recorders here: this checks the choice, not Dramatiq. Also what
``--cpu-scheduling`` writes into the supervisor's job file."""

from __future__ import annotations

import pytest

import bench.__main__ as bench_main
from bench import runs


@pytest.fixture
def dramatiq_prefetches(monkeypatch) -> list[int]:
    """The prefetch of every Dramatiq run started (the raw loop's run is recorded apart)."""
    started: list[int] = []

    def peer_redis(target, system, module, messages, extra, fill, done, env=None):
        if system == "dramatiq":
            started.append(int(env["dramatiq_queue_prefetch"]))
        return {"jobs_per_s": 1.0, "system": system}

    monkeypatch.setattr(runs, "peer_redis", peer_redis)
    return started


def test_dramatiq_runs_at_prefetch_100_and_1_by_default(dramatiq_prefetches):
    rows: list[dict] = []
    bench_main.run_redis_peers(bench_main.parse(["--peers"]), None, rows)
    assert dramatiq_prefetches == [100, 1]
    assert [row.get("prefetch") for row in rows if row.get("system") == "dramatiq"] == [100, 1]


def test_peer_prefetch_chooses_the_dramatiq_runs(dramatiq_prefetches):
    rows: list[dict] = []
    bench_main.run_redis_peers(
        bench_main.parse(["--peers", "--peer-prefetch", "100"]), None, rows)
    assert dramatiq_prefetches == [100]


def test_the_supervisor_runs_take_the_cpu_scheduling_asked_for(tmp_path, monkeypatch):
    """``--cpu-scheduling batch`` reaches the job file of every supervisor run, and the
    default is the supervisor's own."""
    from supervisor.config import load

    assert bench_main.parse([]).cpu_scheduling == "inherit" == runs.CPU_SCHEDULING
    monkeypatch.setattr(runs, "CPU_SCHEDULING", bench_main.parse(
        ["--cpu-scheduling", "batch"]).cpu_scheduling)
    config = runs.job_file(tmp_path, "redis://127.0.0.1:1/0", "examples.noop:handle", 100)
    assert load(config).supervisor.cpu_scheduling == "batch"
