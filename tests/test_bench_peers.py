"""``python -m bench --peers``: which Dramatiq runs it makes (``--peer-prefetch``). The runs
themselves are replaced by recorders here: this checks the choice, not Dramatiq."""

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
