"""What every benchmark run shares: payloads, process measurements, waiting, percentiles."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "bench"
NAMESPACE = "utopia-queue"

#: Seconds between two polls of "is everything done?" (Redis: a GET on its own connection).
POLL = 0.002
#: NATS: an HTTP request to the monitor port, which costs the server more than a GET.
NATS_POLL = 0.01


def stats_usage_payload(n: int, published: float | None = None) -> dict[str, Any]:
    """A stats-usage message (~210-byte envelope); ``t`` is the float publish time that the
    latency handler reads (the envelope's own timestamp is whole seconds)."""
    return {
        "project": {"$id": f"project-{n % 50}"},
        "metrics": [{"key": "executions", "value": 1}, {"key": "network.requests", "value": n % 7}],
        "t": time.time() if published is None else published,
    }


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process the harness starts: this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH", "")])))
    env.pop("QUEUE_BROKER_URL", None)
    env.update(extra)
    return env


def start(args: list[str], *, capture: bool = False, **env: str) -> subprocess.Popen:
    """``python ARGS`` from this checkout; ``capture``: read its stdout (peers say "ready")."""
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=child_env(**env),
        stdout=subprocess.PIPE if capture else subprocess.DEVNULL, stderr=None, text=True,
    )


def stop(child: subprocess.Popen, timeout: float = 30) -> None:
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


def wait_for_line(child: subprocess.Popen, expected: str, timeout: float = 30) -> None:
    """Wait for a peer process to print ``expected`` on its stdout (it is ready)."""
    deadline = time.monotonic() + timeout
    assert child.stdout is not None
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"process {child.pid} exited with {child.wait()} before ready")
        if line.strip() == expected:
            return
    raise RuntimeError(f"process {child.pid} not ready after {timeout}s")


def wait_until_title(pid: int, word: str, timeout: float = 30) -> None:
    """The supervisor's process title says "running" once its loop is up."""
    process = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    while word not in " ".join(process.cmdline()):
        if time.monotonic() > deadline:
            raise RuntimeError("the supervisor did not start")
        time.sleep(0.05)


def until(done: Callable[[], bool], child: subprocess.Popen | None, timeout: float,
          poll: float = POLL) -> None:
    """Poll ``done()`` every ``poll`` seconds; fail if ``child`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not done():
        if child is not None and child.poll() is not None:
            raise RuntimeError(f"process {child.pid} exited with {child.returncode} mid-run")
        if time.monotonic() > deadline:
            raise RuntimeError(f"run not finished after {timeout:.0f}s")
        time.sleep(poll)


@dataclass
class Family:
    """A process and everything it forked: CPU seconds and peak resident memory."""

    pid: int
    seen: dict[int, float] = field(default_factory=dict)  # pid -> last CPU seconds read

    def members(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        return []

    def cpu(self) -> float:
        """CPU seconds of the family; a member that exited keeps its last reading."""
        for member in self.members():
            with contextlib.suppress(psutil.Error):
                times = member.cpu_times()
                self.seen[member.pid] = times.user + times.system
        return sum(self.seen.values())

    def root_cpu(self) -> float:
        """CPU seconds of the root process alone, as last read by ``cpu()``."""
        return self.seen.get(self.pid, 0.0)

    def peak_rss(self) -> tuple[float, float]:
        """Peak RSS (VmHWM, MiB) of the root, and the sum over its descendants."""
        root = children = 0.0
        for member in self.members():
            peak = vm_hwm(member.pid)
            if member.pid == self.pid:
                root = peak
            else:
                children += peak
        return root, children


def vm_hwm(pid: int) -> float:
    """Peak resident set size of ``pid`` in MiB (Linux /proc), 0 if unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentiles(samples: list[float]) -> dict[str, float | None]:
    """p50, p99 and max of ``samples`` in milliseconds."""
    if not samples:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": 0}
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {"p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": ordered[-1] * 1000,
            "samples": len(ordered)}


def per_job(value: float | None, jobs: int, scale: float = 1.0) -> float | None:
    return None if value is None or not jobs else value / jobs * scale
