"""The console script ``queue-supervisor`` (issue 28, L4): started from a directory other
local users can write to, it imports none of their files, where ``python -m supervisor``
imports their ``examples/__init__.py`` first (the current directory leads its sys.path).

The shared test venv is installed from another checkout, so the script is made here the way
pip makes it, from this checkout's pyproject.toml (scripts/wheel-check.sh runs the one a
real install makes).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support.supervision import ROOT

SCRIPT = "queue-supervisor"


def entry_point() -> str:
    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]
    return project["scripts"][SCRIPT]


def make_script(folder: Path) -> Path:
    """The wrapper pip writes into a venv's bin/ for ``[project.scripts]``."""
    module, _, function = entry_point().partition(":")
    script = folder / SCRIPT
    script.write_text(
        f"#!{sys.executable}\n"
        "import re\nimport sys\n"
        f"from {module} import {function}\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        f"    sys.exit({function}())\n"
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def shared_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A folder as a local user could leave it: a job file beside packages named like the
    project's (``examples`` of the handler, ``broker`` that every command imports) that
    record their import. Returns (the folder, the record)."""
    folder, record = tmp_path / "shared", tmp_path / "imported"
    for package in ("examples", "broker"):
        (folder / package).mkdir(parents=True)
        (folder / package / "__init__.py").write_text(
            f"open({str(record)!r}, 'a').write('the local {package} ran')\n")
    (folder / "job.toml").write_text(
        '[broker]\nurl = "redis://127.0.0.1:6379/0"\n'
        '[job]\nqueue = "q"\nhandler = "examples.noop:handle"\n')
    return folder, record


def run_in(folder: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout, after the script's own path
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=60)


def test_pyproject_declares_the_console_script_and_it_answers_help(monkeypatch, capsys):
    module, _, function = entry_point().partition(":")
    main = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{SCRIPT}", "--help"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {SCRIPT} ")


@pytest.mark.slow
def test_the_console_script_imports_nothing_from_the_working_directory(
        tmp_path, shared_folder):
    folder, record = shared_folder
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    script = make_script(bin_folder)

    done = run_in(folder, str(script), "acl", "job.toml")
    assert done.returncode == 0, done.stderr
    assert "ACL SETUSER q-job" in done.stdout and not record.exists()

    done = run_in(folder, sys.executable, "-P", "-m", "supervisor", "acl", "job.toml")
    assert done.returncode == 0, done.stderr
    assert not record.exists()

    # What docs/operations.md ("Other local users") warns about: the module form runs the
    # local package.
    run_in(folder, sys.executable, "-m", "supervisor", "acl", "job.toml")
    assert record.exists()
