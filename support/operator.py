"""Operator commands as tests run them: in a subprocess as an operator types them, or in
this process (the ``run`` and ``conf`` fixtures, which tests/conftest.py offers to every
test module); and the failed/dead lists as a PHP worker leaves them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from broker import envelope
from supervisor import cli
from support.servers import environ_without_broker
from support.supervision import QUEUE, ROOT, keys, write_config


def command(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor ARGS`` as an operator runs it (no broker URL override)."""
    env = {**environ_without_broker(), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def conf(tmp_path: Path, redis_url: str) -> str:
    return str(write_config(tmp_path, redis_url, handler="examples.noop:handle"))


@pytest.fixture
def run(capsys):
    """Run ``python -m supervisor ARGS`` in this process: returns (exit code, stdout)."""

    async def runner(*args: str) -> tuple[int, str]:
        code = await asyncio.to_thread(cli.main, list(args))
        return code, capsys.readouterr().out

    return runner


async def php_failed(redis_client, source: str, payload: dict) -> str:
    """A job a PHP worker rejected: pid in the list, the record kept, no failure record."""
    pid, raw = envelope.build(QUEUE, payload)
    await redis_client.set(keys().job(pid), envelope.requeued(envelope.decode(raw), 3))
    await redis_client.lpush(keys().failed if source == "failed" else keys().dead, pid)
    return pid


async def listed(redis_client, source: str = "failed") -> list[str]:
    key = keys().failed if source == "failed" else keys().dead
    return [pid.decode() for pid in reversed(await redis_client.lrange(key, 0, -1))]
