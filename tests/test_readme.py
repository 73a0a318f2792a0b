"""The documented commands, run as written: the README's quick start CI runs, the operator
commands (docs/operator-commands.md)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.docs import README, block_after, commands
from support.supervision import ROOT


def test_ci_runs_the_quick_starts_test_command_word_for_word():
    quick_start = commands(block_after(README, "## Quick start"))
    assert quick_start == [
        "bash scripts/setup.sh && .venv/bin/python -m supervisor conf/stats-usage.toml",
        "bash scripts/install.sh && .venv/bin/python -m pytest -n auto",
    ]
    assert quick_start[1] in (ROOT / ".ci" / "run").read_text().splitlines()
    # Both scripts work on a stock Debian python3 (PEP 668): into .venv, never the system.
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert '"$python" -m venv .venv' in install and ".venv/bin/python -m pip install" in install
    assert ".venv/bin/python -m examples.demo" in (ROOT / "scripts" / "setup.sh").read_text()


@pytest.mark.parametrize("path", [
    "stats-usage.chdb", "stats-usage.sqlite", "stats-usage.sqlite-wal", "stats-usage.sqlite-shm",
    ".venv/bin/python",
])
def test_what_a_run_leaves_in_the_checkout_is_ignored_by_git(path):
    done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert done.returncode == 0, f"{path} is not ignored"


def test_the_operator_command_examples_run_as_written(redis_url, tmp_path):
    """Every line of the operator commands' block (docs/operator-commands.md), against a
    private Redis (the URL given as QUEUE_BROKER_URL, as a unit's .env would)."""
    lines = commands(block_after("operator-commands.md", "# Operator commands"))
    (tmp_path / "jobs.jsonl").write_text('{"projectId":"p1","metrics":[]}\n')
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    # `python` is this interpreter, as after `. .venv/bin/activate`.
    env.update(QUEUE_BROKER_URL=redis_url, PYTHONPATH=str(ROOT),
               PATH=os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", ""))))
    conf = str(ROOT / "conf" / "stats-usage.toml")
    assert len(lines) >= 8
    for line in lines:
        # Run from a scratch folder (jobs.jsonl is there), the job file by absolute path.
        command = line.replace("conf/stats-usage.toml", shlex.quote(conf))
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        assert "Traceback" not in done.stderr, line
