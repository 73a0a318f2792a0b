"""``python -m supervisor status`` against a NATS server that is not there, or does not
speak: one clear error line and exit code 1 within seconds (it used to wait 120 s)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.supervision import ROOT, write_config

#: Whole seconds the command may take (3 s connect timeout, 10 s for the whole command),
#: with room for a loaded machine; before the bound it took 120 s.
WITHIN = 25


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield listener.getsockname()[1]
    listener.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # free again once closed: nobody listens there


def status(tmp_path: Path, url: str) -> tuple[int, str, float]:
    config = write_config(tmp_path, url, handler="examples.noop:handle")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "supervisor", "status", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=WITHIN + 60)
    return done.returncode, done.stderr, time.monotonic() - started


def test_status_of_an_unreachable_nats_fails_at_once(tmp_path):
    port = closed_port()
    code, err, took = status(tmp_path, f"nats://127.0.0.1:{port}")
    assert code == 1 and took < WITHIN
    assert err.strip().splitlines()[-1].startswith(
        f"error: status failed: cannot reach NATS at nats://127.0.0.1:{port}: ")


@pytest.mark.slow
def test_status_of_a_nats_port_that_never_answers_fails_in_seconds(tmp_path, silent_port):
    code, err, took = status(tmp_path, f"nats://127.0.0.1:{silent_port}")
    assert code == 1 and took < WITHIN
    assert err.strip().splitlines()[-1] == (
        f"error: status failed: cannot reach NATS at nats://127.0.0.1:{silent_port}: "
        f"no answer within 3s")
