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

from support.supervision import ROOT


def command_line(process: psutil.Process) -> str:
    """Its command line; empty for one that ended meanwhile (or is a zombie)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def assert_terminated_cleanly(args: list[str], marker: str, processes: int = 1) -> None:
    """Run ``python ARGS``; once ``processes`` of its descendants' command lines hold
    ``marker``, SIGTERM it: it exits 128+15 and every process it started is gone."""
    bench = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and bench.poll() is None:
            family = psutil.Process(bench.pid).children(recursive=True)
            if sum(marker in command_line(child) for child in family) >= processes:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the bench's {marker!r} was never seen running")
        family = psutil.Process(bench.pid).children(recursive=True)
        assert any("redis-server" in child.name() for child in family)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [process.cmdline() for process in alive]
    finally:
        for process in [*family, psutil.Process(bench.pid) if bench.poll() is None else None]:
            if process is not None and process.is_running():
                process.kill()


def test_a_terminated_bench_leaves_no_process_behind(tmp_path):
    assert_terminated_cleanly(
        ["-m", "bench", "--broker", "redis", "--prefetch", "100", "--messages", "400000",
         "--handlers", "noop", "--latency-load", "0", "--out", str(tmp_path / "results")],
        "bench running")


@pytest.mark.parametrize("peer,marker,processes", [
    ("ours", "bench running", 1),  # the supervisor's title; its handler processes follow
    ("take-when-free", "bench.mixed_peers", 3),  # the parent and its two processes
])
def test_a_terminated_mixed_bench_leaves_no_process_behind(tmp_path, peer, marker, processes):
    assert_terminated_cleanly(
        ["-m", "bench.mixed", "--messages", "20000", "--repeat", "1", "--workloads",
         "mixed+hung", "--processes", "2", "--peers", peer, "--out", str(tmp_path / "results")],
        marker, processes)
