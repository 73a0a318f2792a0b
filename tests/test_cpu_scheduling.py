"""``[supervisor] cpu_scheduling``: with "batch" the supervisor process, every thread of it,
runs under SCHED_BATCH while its handler processes keep the policy it was started with;
"inherit" (the default) changes nothing; a policy chosen by whoever started it (chrt,
systemd's CPUSchedulingPolicy=) other than the normal one is kept, and a refusal is told
and survived.

The end-to-end checks run a real supervisor on the test's Redis; the unit checks run in a
fresh interpreter, since a process's policy is its own and the test process's must not change.
"""

from __future__ import annotations

import json
import logging
import os

import psutil
import pytest

from support.servers import free_port
from support.supervision import python_script, wait_for, write_config

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling")


def policies(process: psutil.Process) -> set[int]:
    """The policy of every thread of ``process``."""
    return {os.sched_getscheduler(thread.id) for thread in process.threads()}


def running_family(supervisor) -> tuple[psutil.Process, list[psutil.Process]]:
    """The supervisor and its handler processes (children of its fork server), once the
    handler process exists."""
    def handlers() -> list[psutil.Process]:
        family = supervisor.family()
        return [p for p in family[2:] if p.ppid() != supervisor.pid]
    found = wait_for(handlers, 30, "a handler process")
    return psutil.Process(supervisor.pid), found


@pytest.mark.parametrize("setting", ["batch", "inherit"])
def test_the_supervisor_runs_under_the_chosen_policy_and_its_handlers_keep_theirs(
        tmp_path, redis_url, supervisors, setting):
    started_with = os.sched_getscheduler(0)  # this process's, which the supervisor inherits
    expected = (os.SCHED_BATCH if setting == "batch" and started_with == os.SCHED_OTHER
                else started_with)
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle",
                          supervisor={"cpu_scheduling": setting, "metrics_port": free_port()})
    supervisor = supervisors(config, redis_url)
    main, handlers = running_family(supervisor)
    wait_for(lambda: "running" in " ".join(main.cmdline()), 30, "the supervisor running")
    assert len(main.threads()) > 1  # the metrics server's thread, started after the switch
    assert policies(main) == {expected}
    fork_server = psutil.Process(handlers[0].ppid())
    for process in (fork_server, *handlers):
        assert policies(process) == {started_with}
    supervisor.signal()
    assert supervisor.wait(30) == 0, supervisor.output()


# A fresh interpreter: sets the policy it is told to start with, applies the setting, and
# reports the policy and what was logged.
PROBE = """
import json, logging, os, sys
from supervisor import cli

start, setting, refuse = sys.argv[1], sys.argv[2], sys.argv[3] == "refuse"
os.sched_setscheduler(0, getattr(os, start), os.sched_param(0))
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append([record.levelname, record.getMessage()])
logging.getLogger("supervisor").addHandler(handler)
logging.getLogger("supervisor").setLevel(logging.INFO)
if refuse:
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")
    os.sched_setscheduler = refused
cli.use_cpu_scheduling(setting)
print(json.dumps({"policy": os.sched_getscheduler(0), "logged": records}))
"""


def probe(start: str, setting: str, refuse: bool = False) -> dict:
    done = python_script(PROBE, start, setting, "refuse" if refuse else "allow", timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_batch_switches_a_normal_process_silently():
    assert probe("SCHED_OTHER", "batch") == {"policy": os.SCHED_BATCH, "logged": []}


def test_inherit_leaves_the_policy_alone():
    assert probe("SCHED_OTHER", "inherit") == {"policy": os.SCHED_OTHER, "logged": []}


def test_a_policy_chosen_by_whoever_started_it_is_kept_and_said():
    report = probe("SCHED_IDLE", "batch")
    assert report["policy"] == os.SCHED_IDLE
    assert report["logged"] == [[
        "INFO", "cpu_scheduling = batch: keeping the scheduling policy the supervisor was "
        "started with (SCHED_IDLE)",
    ]]


def test_a_refusal_is_told_and_the_supervisor_runs_on_as_it_is():
    report = probe("SCHED_OTHER", "batch", refuse=True)
    assert report["policy"] == os.SCHED_OTHER
    [(level, message)] = report["logged"]
    assert level == logging.getLevelName(logging.WARNING)
    assert message.startswith("cpu_scheduling = batch: SCHED_BATCH refused (")
    assert message.endswith("the supervisor keeps the normal scheduling policy")


def test_an_unknown_policy_is_a_config_error(tmp_path):
    from supervisor.config import ConfigError, load

    config = write_config(tmp_path, "redis://127.0.0.1:1/0",
                          supervisor={"cpu_scheduling": "fifo"})
    with pytest.raises(ConfigError, match=r"\[supervisor\] cpu_scheduling.*inherit.*batch"):
        load(config)
