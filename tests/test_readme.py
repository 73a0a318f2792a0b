"""The documented commands, run as written: the README's quick start CI runs, the operator
commands (docs/operator-commands.md)."""

from __future__ import annotations

import ast
import collections
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from broker.redis.keys import QueueKeys
from support.docs import README, block_after, commands, text
from support.supervision import ROOT, wait_for

#: A log line as a terminal shows it: time, level, logger[process]: message.
TERMINAL_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ ([A-Z]+) ([\w. -]+)\[\d+\]: (.*)$")


def test_ci_runs_the_quick_starts_test_command_word_for_word():
    quick_start = commands(block_after(README, "## Quick start"))
    assert quick_start == [
        "bash scripts/setup.sh && .venv/bin/python -m supervisor conf/stats-usage.toml",
        ".venv/bin/python -m examples.stats_usage",  # the totals the job wrote
        "bash scripts/install.sh && .venv/bin/python -m pytest -n auto",
    ]
    assert quick_start[2] in (ROOT / ".ci" / "run").read_text().splitlines()
    # Both scripts work on a stock Debian python3 (PEP 668): into .venv, never the system.
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert '"$python" -m venv .venv' in install and ".venv/bin/python -m pip install" in install
    assert ('.venv/bin/python -m examples.demo conf/stats-usage.toml --messages '
            '"${DEMO_MESSAGES:-1000}"') in (ROOT / "scripts" / "setup.sh").read_text()


def shown_output() -> tuple[str, list[str]]:
    """What the README shows the first quick-start command print: the demo's line, and the
    supervisor's log lines as they read on a terminal."""
    readme = text(README)
    start = readme.index("**What the first command prints**")
    shown = re.findall(r"```text\n(.*?)```", readme[start:readme.index("\n## ", start)], re.S)
    demo, *logs = "".join(shown).splitlines()
    return demo, logs


def same_run(line: str, url: str, *checkouts: str) -> str:
    """A log line with what differs from run to run (paths, URL, times) made alike."""
    for checkout in checkouts:
        line = line.replace(checkout, "CHECKOUT")
    line = line.replace(url, "redis://127.0.0.1:6379/0")
    line = re.sub(r"\(modified [^)]*\)", "(modified ...)", line)
    return re.sub(r"stopped after [\d.]+s", "stopped after ...s", line)


def test_the_quick_start_prints_what_the_readme_shows(redis_url, client, tmp_path):
    """The first command's job against a private Redis (its URL as QUEUE_BROKER_URL), run
    from a scratch folder (the store, stats-usage.chdb, is made there): the demo's line, the
    supervisor's lines (JSON, stderr being no terminal), the stop, the totals."""
    demo_line, log_lines = shown_output()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "STATS_USAGE_DB")}
    env.update(QUEUE_BROKER_URL=redis_url, PYTHONPATH=str(ROOT))
    conf = str(ROOT / "conf" / "stats-usage.toml")

    demo = subprocess.run([sys.executable, "-m", "examples.demo", conf, "--messages", "1000"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert demo.stdout.strip() == demo_line, demo.stderr
    job = subprocess.Popen([sys.executable, "-m", "supervisor", conf], cwd=tmp_path, env=env,
                           stderr=subprocess.PIPE, text=True)
    try:
        keys = QueueKeys("utopia-queue", "stats-usage")
        wait_for(lambda: client.llen(keys.ready) == client.llen(keys.processing) == 0, 90,
                 "the 1,000 demo messages done")
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, stderr
    printed = [orjson.loads(line) for line in stderr.splitlines()]
    got = [f"{r['level'].upper()} {r['logger']}: {r['message']}" for r in printed]
    shown = []
    for line in log_lines:
        level, logger, message = TERMINAL_LINE.match(line).groups()
        if not message.startswith("progress: "):  # a minute after the start: not waited for
            shown.append(f"{level} {logger}: {message}")
    url, checkouts = redis_url, (str(tmp_path.resolve()), str(ROOT))  # the store; the code
    assert collections.Counter(same_run(line, url, "/root/queue-supervisor") for line in shown) \
        == collections.Counter(same_run(line, url, *checkouts) for line in got)

    # The totals command: a line per project and metric, adding up to what the demo sent.
    totals = commands(block_after(README, "## Quick start"))[1]
    done = subprocess.run(["bash", "-c", totals.replace(".venv/bin/python", sys.executable)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    assert len(rows) == 30
    summed: collections.Counter[str] = collections.Counter()
    for _, metric, value in rows:
        summed[metric] += int(value)
    assert summed == ast.literal_eval(demo_line.partition("totals: ")[2])


@pytest.mark.parametrize("path", [
    "stats-usage.chdb", "stats-usage.sqlite", "stats-usage.sqlite-wal", "stats-usage.sqlite-shm",
    ".venv/bin/python",
])
def test_what_a_run_leaves_in_the_checkout_is_ignored_by_git(path):
    done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert done.returncode == 0, f"{path} is not ignored"


@pytest.mark.slow
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
