"""``python -m bench`` and ``python -m bench.mixed`` stopped by SIGTERM (kill, ``timeout``,
systemd) leave nothing running: the supervisor or peer workers, their processes and the
private redis-server they started all end with them, as they do after Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from support import processes
from support.supervision import ROOT

pytestmark = pytest.mark.slow  # every test here takes a second or more


def assert_terminated_cleanly(args: list[str], marker: str, count: int = 1) -> None:
    """Run ``python ARGS``; once ``count`` of its descendants' titles hold ``marker``,
    SIGTERM it: it exits 128+15 and every process it started is gone."""
    bench = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and bench.poll() is None:
            # A child may end between the listing and the read (issue 39.6): it reads "".
            family = processes.family(bench.pid)[1:]
            if sum(marker in processes.title(child) for child in family) >= count:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the bench's {marker!r} was never seen running")
        family = processes.family(bench.pid)[1:]
        assert any("redis-server" in processes.name(child) for child in family)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [processes.title(process) for process in alive]
    finally:
        for process in [*family, *processes.family(bench.pid)[:1]]:
            processes.kill(process)


@pytest.mark.timeout(180)  # measured 25-45 s on a loaded 2-core machine
def test_a_terminated_bench_leaves_no_process_behind(tmp_path):
    assert_terminated_cleanly(
        ["-m", "bench", "--broker", "redis", "--prefetch", "100", "--messages", "400000",
         "--handlers", "noop", "--latency-load", "0", "--out", str(tmp_path / "results")],
        "bench running")


@pytest.mark.parametrize(("peer", "marker", "count"), [
    ("ours", "bench running", 1),  # the supervisor's title; its handler processes follow
    ("take-when-free", "bench.mixed_peers", 3),  # the parent and its two processes
])
def test_a_terminated_mixed_bench_leaves_no_process_behind(tmp_path, peer, marker, count):
    assert_terminated_cleanly(
        ["-m", "bench.mixed", "--messages", "20000", "--repeat", "1", "--workloads",
         "mixed+hung", "--processes", "2", "--peers", peer, "--out", str(tmp_path / "results")],
        marker, count)
