"""The chaos soak's choice of a supervisor to SIGTERM (bench.chaos.run.Fleet.pick)."""

from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace

from bench.chaos.run import Fleet

_TITLED = ("import setproctitle, sys, time\n"
           "setproctitle.setproctitle('queue-supervisor: q running [buffer 0/1]')\n"
           "print('titled', flush=True)\n"
           "time.sleep(60)\n")


def test_a_sigterm_fault_picks_only_a_supervisor_whose_loop_runs(tmp_path):
    # A SIGTERM that lands before the supervisor installed its handlers ends it by the
    # default action (-15), which the soak then reports as a problem of the supervisor.
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    consuming = subprocess.Popen([sys.executable, "-c", _TITLED], stdout=subprocess.PIPE,
                                 text=True)
    try:
        assert consuming.stdout.readline() == "titled\n"
        fleet = Fleet(None, tmp_path, tmp_path, "", {})  # type: ignore[arg-type]
        fleet.members = [SimpleNamespace(pid=starting.pid), SimpleNamespace(pid=consuming.pid)]
        rng = random.Random(1)
        assert {fleet.pick(rng, consuming=True).pid for _ in range(20)} == {consuming.pid}
        assert {fleet.pick(rng).pid for _ in range(60)} == {starting.pid, consuming.pid}
        fleet.members = [SimpleNamespace(pid=starting.pid)]
        assert fleet.pick(rng, consuming=True) is None
    finally:
        for process in (starting, consuming):
            process.kill()
            process.wait()
