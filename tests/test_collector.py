"""The supervisor's garbage collector (``supervisor.cli.quiet_collector``): what exists
before its loop starts is frozen out of the collector's sight, young collections run once per
10,000 new containers, and the handler processes, forked from the fork server started
before that, keep CPython's own collector.

Each check runs in a fresh interpreter: the collector's settings are per process, and the
test process's own must not change.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from support.supervision import python_script, write_config

# Runs supervisor.cli.run with the event loop replaced by a probe: it reports the
# collector's state at the moment the loop would start, and at the moment the fork server
# (the parent of every handler process, which keeps what it had when forked) starts.
PROBE = """
import gc, json, os, sys
from supervisor import cli
from supervisor.config import load
from worker.forkserver import ForkServer

seen = {}
start = ForkServer.start

def probe_start(self):
    seen["forkserver"] = [gc.get_freeze_count(), list(gc.get_threshold())]
    return start(self)

def probe_loop(coroutine):
    coroutine.close()
    seen["supervisor"] = [gc.get_freeze_count(), list(gc.get_threshold())]
    return 0

ForkServer.start = probe_start
cli.asyncio_run = probe_loop
code = cli.run(load(sys.argv[1]))
print(json.dumps({"code": code, **seen}))
"""


def run_probe(tmp_path: Path) -> dict:
    config = write_config(tmp_path, "redis://127.0.0.1:1/0", handler="examples.noop:handle")
    done = python_script(PROBE, str(config), timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_loop_starts_with_startup_objects_frozen_and_young_collections_rarer(tmp_path):
    from supervisor.cli import YOUNG_COLLECTION_EVERY

    report = run_probe(tmp_path)
    assert report["code"] == 0
    frozen, threshold = report["supervisor"]
    assert frozen > 10_000  # the modules, the config and the handler: all of start-up
    assert threshold == [YOUNG_COLLECTION_EVERY, 10, 10]


def test_handler_processes_keep_cpythons_collector(tmp_path):
    """Handlers run user code, which may make cycles: their processes come from the fork
    server, started before the supervisor's collector changes, so they keep the default."""
    frozen, threshold = run_probe(tmp_path)["forkserver"]
    assert frozen == 0
    assert threshold == list(gc.get_threshold())  # CPython's own, as this process has it
