"""Handler code outside the working directory (issue 25, item 9): the start-up error of a
handler module that is not found says where it is looked for and what to do, and the
documented remedy (PYTHONPATH) works; the exit code stays 2 (a configuration error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import exits
from support.supervision import ROOT

JOB = '[broker]\nurl = "redis://127.0.0.1:1/0"\n[job]\nqueue = "q"\nhandler = "{spec}"\n'


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's handler project away from the working directory: myjobs/tasks.py, and a
    module that imports a dependency nobody installed."""
    code = tmp_path / "project"
    (code / "myjobs").mkdir(parents=True)
    (code / "myjobs" / "__init__.py").write_text("")
    (code / "myjobs" / "tasks.py").write_text("def handle(message):\n    pass\n")
    (code / "myjobs" / "needs.py").write_text(
        "import not_installed_dependency_x\n\ndef handle(message):\n    pass\n")
    return code


def start(tmp_path: Path, spec: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Load the job file as ``python -m supervisor`` does, from ROOT (not the project)."""
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(spec=spec))
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",
                                                                  "QUEUE_BROKER_URL")}
    script = ("import sys; from supervisor.config import load, ConfigError\n"
              "try:\n    load(sys.argv[1])\nexcept ConfigError as e:\n"
              "    print(e, file=sys.stderr); sys.exit(2)\n")
    return subprocess.run([sys.executable, "-c", script, str(job)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**environ, **env})


def test_a_handler_not_on_the_path_says_how_to_put_it_there(tmp_path, project):
    done = start(tmp_path, "myjobs.tasks:handle")
    assert done.returncode == exits.CONFIG
    error = done.stderr.strip()
    assert "No module named 'myjobs'" in error
    assert "myjobs is neither installed in this Python's environment nor on PYTHONPATH" in error
    assert f"{sys.executable} -m pip install" in error
    assert "set PYTHONPATH to the folder that contains myjobs/" in error
    assert 'docs/handlers.md: "Where handler code lives"' in error


def test_pythonpath_as_the_message_says_finds_it(tmp_path, project):
    done = start(tmp_path, "myjobs.tasks:handle", PYTHONPATH=str(project))
    assert done.returncode == 0, done.stderr


def test_a_missing_dependency_of_the_handler_is_named_as_such(tmp_path, project):
    done = start(tmp_path, "myjobs.needs:handle", PYTHONPATH=str(project))
    assert done.returncode == exits.CONFIG
    assert ("myjobs.needs imports not_installed_dependency_x, which this Python "
            f"({sys.executable}) does not have: install it into the same environment"
            in done.stderr)


def test_the_supervisor_exits_2_with_the_hint(tmp_path, project):
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(spec="myjobs.tasks:handle"))
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",
                                                                  "QUEUE_BROKER_URL")}
    done = subprocess.run([sys.executable, "-m", "supervisor", str(job)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == exits.CONFIG
    assert "set PYTHONPATH to the folder that contains myjobs/" in done.stderr
