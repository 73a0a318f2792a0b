"""``python -m bench`` stopped by SIGTERM (kill, ``timeout``, systemd) leaves nothing
running: the supervisor, its handler processes and the private redis-server it started all
end with it, as they do after Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from support import processes
from support.supervision import ROOT


def test_a_terminated_bench_leaves_no_process_behind(tmp_path):
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--broker", "redis", "--prefetch", "100",
         "--messages", "400000", "--handlers", "noop", "--latency-load", "0",
         "--out", str(tmp_path / "results")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and bench.poll() is None:
            # A child may end between the listing and the read (issue 39.6): it reads "".
            family = processes.family(bench.pid)[1:]
            if any("bench running" in processes.title(child) for child in family):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the bench's supervisor was never seen running")
        assert any("redis-server" in processes.name(child) for child in family)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [processes.title(process) for process in alive]
    finally:
        for process in [*family, *processes.family(bench.pid)[:1]]:
            processes.kill(process)
