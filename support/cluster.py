"""A private Redis Cluster for tests, on loopback ports of our own: three masters, and with
``replicas=1`` one replica each.

Each node is a ``redis-server --cluster-enabled yes``; ``redis-cli --cluster create`` joins
them. A node also listens on its cluster bus port (port + 10000), so both must be free:
ports are drawn below the kernel's ephemeral range, where outgoing connections do not land.

With replicas, each replica authenticates to its master as the ACL user ``replication``.
Switching that user off on a master (``ClusterNode.cut_replication``) is how a test makes
its writes acknowledged but not replicated, deterministically: the replica's link drops and
cannot come back, so a failover then takes back exactly what the master wrote after the cut.
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
from typing import Any

import redis
from redis.crc import key_slot

from support.servers import wait_for_port

BUS_OFFSET = 10_000
PORT_RANGE = (15_000, 22_000)  # bus ports 25000..32000, below 32768 (the ephemeral range)
SLOTS = 16_384
#: The user replicas authenticate as (masteruser/masterauth), on every node.
REPLICATION_USER, REPLICATION_PASSWORD = "replication", "replication-secret"


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

    def __init__(self, port: int, directory: Path, node_timeout: int = 5000,
                 replicated: bool = False, persist: bool = False) -> None:
        self.port = port
        self.dir = directory
        self.node_timeout = node_timeout
        self.replicated = replicated
        self.persist = persist  # appendfsync always: a killed node comes back with its data
        self.process: subprocess.Popen | None = None
        self.client = redis.Redis(port=port, socket_timeout=10)

    def start(self) -> None:
        args = [
            shutil.which("redis-server") or "redis-server", "--port", str(self.port),
            "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
            *(["--appendonly", "yes", "--appendfsync", "always",
               "--appenddirname", f"appendonly-{self.port}"] if self.persist
              else ["--appendonly", "no"]),
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.dir / f"nodes-{self.port}.conf"),
            "--cluster-node-timeout", str(self.node_timeout),
            "--logfile", str(self.dir / f"{self.port}.log"),
        ]
        if self.replicated:
            args += [
                "--user", REPLICATION_USER, "on", f">{REPLICATION_PASSWORD}", "~*", "&*", "+@all",
                "--masteruser", REPLICATION_USER, "--masterauth", REPLICATION_PASSWORD,
                # A replica whose link was cut may still be promoted (that is the point).
                "--cluster-replica-validity-factor", "0",
                # A (re)joining replica syncs at once, not after the default 5 s wait for others.
                "--repl-diskless-sync-delay", "0",
            ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        wait_for_port(self.port)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def replication(self) -> dict[str, Any]:
        return self.client.info("replication")

    @property
    def role(self) -> str:
        return self.replication().get("role", "")

    def cut_replication(self) -> None:
        """From now on this master's writes reach no replica (until restore_replication)."""
        self.client.execute_command("ACL", "SETUSER", REPLICATION_USER, "off")
        self.client.execute_command("CLIENT", "KILL", "USER", REPLICATION_USER)

    def restore_replication(self) -> None:
        self.client.execute_command("ACL", "SETUSER", REPLICATION_USER, "on")

    def kill(self) -> None:
        """SIGKILL, keeping nodes.conf: ``start()`` brings it back with its identity."""
        if self.alive:
            assert self.process is not None
            self.process.kill()
            self.process.wait(10)
        self.process = None
        self.client.connection_pool.disconnect()

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
    """Three masters (``replicas`` each), every slot covered."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout: int = 5000,
                 persist: bool = False) -> None:
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            raise RuntimeError("needs redis-server and redis-cli (apt-get install redis-server)")
        self.masters = masters
        self.replicas = replicas
        self.node_timeout = node_timeout
        self.persist = persist  # every node keeps its data across a kill (appendfsync always)
        self.dir = Path(tempfile.mkdtemp(prefix="qs-cluster-"))
        self.nodes: list[ClusterNode] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def seed_url(self) -> str:
        """Every node, comma-separated: the ``[broker] url`` of a client that must start
        while any one of them is down."""
        return ",".join(node.url for node in self.nodes)

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
        count = self.masters * (1 + self.replicas)
        self.nodes = [ClusterNode(port, self.dir, self.node_timeout, self.replicas > 0,
                                  self.persist) for port in cluster_ports(count)]
        for node in self.nodes:
            node.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, check=True, timeout=30,
        )
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node reports cluster_state:ok, all slots covered, all nodes known,
        every replica's link to its master up, and all agree on who serves each slot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (all(self._node_ok(node) for node in self.nodes) and self._agreed()
                    and self._replicas_linked()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"cluster not ok after {timeout}s")

    def _node_ok(self, node: ClusterNode) -> bool:
        with contextlib.suppress(redis.RedisError):
            info = node.info()
            if not (info.get("cluster_state") == "ok"
                    and info.get("cluster_slots_ok") == str(SLOTS)
                    and info.get("cluster_known_nodes") == str(len(self.nodes))):
                return False
            replication = node.replication()
            return (replication.get("role") == "master"
                    or replication.get("master_link_status") == "up")
        return False

    def _replicas_linked(self) -> bool:
        """Each master has all its replicas connected (a demoted master has become one)."""
        with contextlib.suppress(redis.RedisError):
            roles = [node.replication() for node in self.nodes]
            linked = [r for r in roles if r.get("master_link_status") == "up"]
            masters = [r for r in roles if r.get("role") == "master"]
            return len(masters) == self.masters and len(linked) == len(roles) - self.masters
        return False

    def _agreed(self) -> bool:
        """Every node sees the same slot owners and the same master of each replica."""
        views = set()
        for node in self.nodes:
            with contextlib.suppress(redis.RedisError):
                slots = tuple(sorted(
                    (start, end, int(primary[1]))
                    for start, end, primary, *_ in node.client.execute_command("CLUSTER", "SLOTS")
                ))
                views.add((slots, self._replication_map(node)))
        return len(views) == 1

    @staticmethod
    def _replication_map(node: ClusterNode) -> tuple[tuple[str, str], ...]:
        text = node.client.execute_command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else text
        return tuple(sorted((fields[0], fields[3]) for fields in
                            (line.split() for line in text.splitlines() if line)))

    def flush(self) -> None:
        """Empty every node's data (replicas follow their masters) and script cache."""
        for node in self.primaries():
            node.client.flushall()
        self.flush_scripts()
        for node in self.primaries():  # the replicas have it too before a test starts
            node.client.execute_command("WAIT", self.replicas, 5000)

    def flush_scripts(self) -> None:
        for node in self.nodes:
            node.client.script_flush()

    def primaries(self) -> list[ClusterNode]:
        return [node for node in self.nodes if node.alive and node.role == "master"]

    def live(self) -> ClusterNode:
        return next(node for node in self.nodes if node.alive)

    # -- slots ----------------------------------------------------------------------------

    def owner(self, slot: int) -> ClusterNode:
        """The node that serves ``slot`` (as the first live node sees it)."""
        for start, end, primary, *_ in self.live().client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                port = int(primary[1])
                return next(node for node in self.nodes if node.port == port)
        raise LookupError(f"slot {slot} is not covered")

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        """A replica of ``master`` (as the replica itself reports its master)."""
        for node in self.nodes:
            with contextlib.suppress(redis.RedisError):
                if node.alive and node.replication().get("master_port") == master.port:
                    return node
        raise LookupError(f"{master.port} has no replica")

    # -- failover -------------------------------------------------------------------------

    def failover(self, replica: ClusterNode, mode: str = "", timeout: float = 30.0) -> None:
        """``CLUSTER FAILOVER [FORCE|TAKEOVER]`` on ``replica``; until every live node has it
        serving its master's former slots."""
        replica.client.execute_command("CLUSTER", "FAILOVER", *([mode] if mode else []))
        self.wait_promoted(replica, timeout)

    def wait_promoted(self, node: ClusterNode, timeout: float = 30.0) -> float:
        """Until ``node`` is a master that every live node agrees on; the seconds it took."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if node.role == "master" and self._live_agree_on(node):
                    return time.monotonic() - started
            time.sleep(0.02)
        raise TimeoutError(f"{node.port} not promoted after {timeout}s")

    def _live_agree_on(self, node: ClusterNode) -> bool:
        for other in self.nodes:
            if not other.alive:
                continue
            primaries = {int(p[1]) for _, _, p, *_ in other.client.execute_command(
                "CLUSTER", "SLOTS")}
            if node.port not in primaries:
                return False
        return True

    def revive(self, node: ClusterNode) -> None:
        """Start a killed node again: it rejoins as a replica of whoever took its slots."""
        node.start()
        self.wait_ok()

    def heal(self) -> None:
        """Every node running and replicating, as a test found it (after a failed test)."""
        for node in self.nodes:
            if not node.alive:
                node.start()
            elif self.replicas:
                with contextlib.suppress(redis.RedisError):
                    node.restore_replication()
        self.wait_ok(60)

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
