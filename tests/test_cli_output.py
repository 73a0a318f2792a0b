"""The command line's own output (issue 25, item 9): ``--version``, and a reader of stdout
that leaves early (``publish -v ... | head``)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from support.supervision import ROOT, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")


@pytest.mark.parametrize("args", [["--version"], ["status", "--version"],
                                  ["publish", "--version"]])
def test_version_names_the_package_and_its_clients(args):
    done = subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"queue-supervisor {metadata.version('queue-supervisor')}, ")
    assert f"redis {metadata.version('redis')}" in line
    assert f"nats-py {metadata.version('nats-py')}" in line
    assert f"Python {sys.version.split()[0]}" in line


@pytest.mark.slow
def test_publish_into_a_reader_that_leaves_early_ends_quietly(tmp_path: Path, redis_url):
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"n": 1}\n' * 5000)  # 5,000 pids: more than a pipe's buffer holds
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert reader.stdin is not None
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "publish", "-v", str(config), str(lines)],
        cwd=ROOT, stdout=reader.stdin, stderr=subprocess.PIPE, text=True, timeout=60)
    reader.stdin.close()
    assert reader.stdout is not None
    first = reader.stdout.read()
    reader.wait(timeout=30)
    assert first.decode().startswith("published 5000 messages")
    assert done.stderr == ""  # no "Broken pipe", no traceback
    assert done.returncode == 1  # Python's code for it ("Note on SIGPIPE"), documented
