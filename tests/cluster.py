"""A private three-master Redis Cluster for tests, on loopback ports of our own.

Each node is a ``redis-server --cluster-enabled yes``; ``redis-cli --cluster create`` joins
them. A node also listens on its cluster bus port (port + 10000), so both must be free:
ports are drawn below the kernel's ephemeral range, where outgoing connections do not land.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.crc import key_slot

from support.servers import wait_for_port

BUS_OFFSET = 10_000
PORT_RANGE = (15_000, 22_000)  # bus ports 25000..32000, below 32768 (the ephemeral range)
SLOTS = 16_384


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int) -> list[int]:
    """``count`` ports whose bus ports (port + 10000) are free as well."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(*PORT_RANGE)
        if port not in ports and _bindable(port) and _bindable(port + BUS_OFFSET):
            ports.append(port)
    return ports


class ClusterNode:
    """One ``redis-server`` cluster node we own."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.dir = directory
        self.process: subprocess.Popen | None = None
        self.client = redis.Redis(port=port, socket_timeout=10)

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server", "--port", str(self.port),
                "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "no", "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / f"nodes-{self.port}.conf"),
                "--cluster-node-timeout", "5000", "--logfile", str(self.dir / f"{self.port}.log"),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def info(self) -> dict[str, str]:
        text = self.client.execute_command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else text
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    @property
    def node_id(self) -> str:
        return self.client.execute_command("CLUSTER", "MYID").decode()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None
        self.client.close()


class PrivateCluster:
    """Three masters, no replicas, every slot covered."""

    def __init__(self, masters: int = 3) -> None:
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            raise RuntimeError("needs redis-server and redis-cli (apt-get install redis-server)")
        self.masters = masters
        self.dir = Path(tempfile.mkdtemp(prefix="qs-cluster-"))
        self.nodes: list[ClusterNode] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, attempts: int = 5) -> PrivateCluster:
        for attempt in range(attempts):
            try:
                self._start_once()
                return self
            except (TimeoutError, subprocess.CalledProcessError):
                # A port taken between the check and the bind: start over on new ports.
                self.stop()
                if attempt == attempts - 1:
                    raise
        return self

    def _start_once(self) -> None:
        self.nodes = [ClusterNode(port, self.dir) for port in cluster_ports(self.masters)]
        for node in self.nodes:
            node.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, check=True, timeout=30,
        )
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node reports cluster_state:ok, all slots covered, all nodes known."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._node_ok(node) for node in self.nodes):
                return
            time.sleep(0.05)
        raise TimeoutError(f"cluster not ok after {timeout}s")

    def _node_ok(self, node: ClusterNode) -> bool:
        with contextlib.suppress(redis.RedisError):
            info = node.info()
            return (info.get("cluster_state") == "ok"
                    and info.get("cluster_slots_ok") == str(SLOTS)
                    and info.get("cluster_known_nodes") == str(len(self.nodes)))
        return False

    def flush(self) -> None:
        """Empty every node's data and script cache."""
        for node in self.nodes:
            node.client.flushall()
        self.flush_scripts()

    def flush_scripts(self) -> None:
        for node in self.nodes:
            node.client.script_flush()

    # -- slots ----------------------------------------------------------------------------

    def owner(self, slot: int) -> ClusterNode:
        """The node that serves ``slot`` (as the first node sees it)."""
        for start, end, primary, *_ in self.nodes[0].client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                port = int(primary[1])
                return next(node for node in self.nodes if node.port == port)
        raise LookupError(f"slot {slot} is not covered")

    def owner_of(self, key: str) -> ClusterNode:
        return self.owner(key_slot(key.encode()))

    def migrate_slot(self, slot: int, target: ClusterNode) -> None:
        """Move ``slot`` to ``target`` the way ``redis-cli --cluster reshard`` does."""
        if self.owner(slot) is target:
            return
        migration = self.begin_migration(slot, target)
        migration.move_keys()
        migration.finish()

    def begin_migration(self, slot: int, target: ClusterNode) -> Migration:
        """Mark ``slot`` IMPORTING on ``target`` and MIGRATING on its owner."""
        source = self.owner(slot)
        target.client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        source.client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
        return Migration(self, slot, source, target)

    def stabilize(self, slot: int) -> None:
        """Clear a migration left half-done (by a failed test)."""
        for node in self.nodes:
            with contextlib.suppress(redis.RedisError):
                node.client.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")

    def other_than(self, node: ClusterNode) -> ClusterNode:
        return next(other for other in self.nodes if other is not node)

    # -- life -----------------------------------------------------------------------------

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []
        for conf in self.dir.glob("nodes-*.conf"):
            conf.unlink()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Migration:
    """A slot on its way from ``source`` to ``target``: keys move in batches, then the slot."""

    def __init__(self, cluster: PrivateCluster, slot: int, source: ClusterNode,
                 target: ClusterNode) -> None:
        self.cluster, self.slot, self.source, self.target = cluster, slot, source, target

    def move_keys(self, keys: list[str] | None = None, per_call: int = 100) -> None:
        """MIGRATE ``keys`` (default: every key still on the source) to the target."""
        if keys is not None:
            self._migrate(keys)
            return
        while batch := self.source.client.execute_command(
            "CLUSTER", "GETKEYSINSLOT", self.slot, per_call
        ):
            self._migrate(batch)

    def _migrate(self, keys: list) -> None:
        self.source.client.execute_command(
            "MIGRATE", "127.0.0.1", self.target.port, "", 0, 10_000, "KEYS", *keys
        )

    def finish(self) -> None:
        """Move what is left, then assign the slot to the target on every node."""
        self.move_keys()
        target_id = self.target.node_id
        others = [n for n in self.cluster.nodes if n not in (self.target, self.source)]
        for node in (self.target, self.source, *others):
            node.client.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", target_id)
        self.cluster.wait_ok()
