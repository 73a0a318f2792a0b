"""Helpers for end-to-end tests that run ``python -m supervisor`` as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import redis

from broker.redis.keys import QueueKeys
from support import processes

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "e2e"
NAMESPACE = "utopia-queue"


def python_script(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter from the checkout; it must exit 0."""
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    return done


def write_config(directory: Path, url: str, handler: str = "tests.handlers.e2e_record:handle",
                 **sections: dict[str, Any]) -> Path:
    """A job file for ``url``; ``sections`` override keys, e.g. job={"prefetch": 10}."""
    values: dict[str, dict[str, Any]] = {
        "broker": {"url": url, "namespace": NAMESPACE, "block_timeout": 1.0},
        "job": {"queue": QUEUE, "handler": handler, "coroutines": 1, "prefetch": 10},
        "supervisor": {"shutdown_deadline": 10, "lease": 3, "maintenance_interval": 1},
    }
    for name, overrides in sections.items():
        values.setdefault(name, {}).update(overrides)
    lines = []
    for name, keys in values.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in keys.items()]
    path = directory / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


class Supervisor:
    """A running ``python -m supervisor`` with its output captured to a file."""

    def __init__(self, config: Path, workdir: Path, redis_url: str,
                 namespace: str = NAMESPACE, module: str = "supervisor", **env: str) -> None:
        """``namespace`` is passed on to the handler's on_success check (E2E_NAMESPACE);
        ``module`` is what runs the job file (``tests.faults TARGET`` injects a failure);
        ``env`` may replace PYTHONPATH (the checkout's folder, where the test handlers are)."""
        self.log_path = workdir / f"supervisor-{time.monotonic_ns()}.log"
        environ = {k: v for k, v in os.environ.items() if k != "QUEUE_BROKER_URL"}
        environ.update({"E2E_DIR": str(workdir), "E2E_REDIS": redis_url,
                        "E2E_NAMESPACE": namespace, "PYTHONPATH": str(ROOT), **env})
        self.log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(
            [sys.executable, "-m", *module.split(), str(config)], cwd=ROOT, env=environ,
            stdout=self.log_file, stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def family(self) -> list[psutil.Process]:
        """The supervisor and every process below it (fork server, handlers)."""
        return processes.family(self.pid)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self.log_file.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Make sure nothing of it survives the test."""
        for process in self.family():
            processes.kill(process)
        if self.process.poll() is None:
            self.process.wait(10)
        self.log_file.close()


def wait_for(condition: Callable[[], Any], timeout: float, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def keys(namespace: str = NAMESPACE) -> QueueKeys:
    return QueueKeys(namespace, QUEUE)


def lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def counter(client: redis.Redis, name: str, namespace: str = NAMESPACE) -> int:
    return int(client.get(keys(namespace).stat(name)) or 0)


# Read in one script so a claim (reservation -> processing) cannot be counted twice.
_OUTSTANDING = """
local total = redis.call('LLEN', KEYS[1])
for _, reservation in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    total = total + redis.call('LLEN', reservation)
end
return total
"""


def outstanding(client: redis.Redis, namespace: str = NAMESPACE) -> int:
    """Deliveries this queue's consumers hold: processing entries plus reserved payloads."""
    k = keys(namespace)
    return client.eval(_OUTSTANDING, 2, k.processing, k.reservations)
