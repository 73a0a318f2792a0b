"""Failovers under load: duplicates, losses and recovery time per failover.

    python -m bench.failover --repeat 3 --wait-replicas 0,1 --out bench/results/<name>

A private Redis Cluster, three masters with a replica each (``support.cluster``, node
timeout 2 s). Per run: two ``python -m supervisor`` (coroutines 1, prefetch 100, a handler
that records each pid with the time) consume a hash-tagged queue while a producer in this
process publishes 20 messages every 10 ms (about 2,000/s, each confirmed before the next,
``publish_many`` with the run's ``wait_replicas``). Once half of a 30,000 message backlog
is handled, the queue's master is struck:

- ``sigkill``: SIGKILL; the replica is elected after the node timeout.
- ``manual``: ``CLUSTER FAILOVER`` on the replica (it catches up with the master first).
- ``sigkill-lagging``: the master's replication link is cut 0.3 s before the SIGKILL, so the
  replica misses the last 0.3 s of writes (the worst case of a lagging replica; a healthy
  one on a LAN is a fraction of a millisecond behind).

The backlog is queued (and replicated) before the supervisors start. A killed master is
started again 1 s after its replica took over (it rejoins as a replica). The producer goes
on for 6 s after the strike (a publish that fails or is not confirmed is
retried as a new message, and not counted as published). Then everything is drained, and:
published (confirmed), lost (confirmed but never handled), duplicates (extra runs), the
longest pause in handling around the strike, and how long the promotion took.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import machine
from broker.redis import RedisBroker
from broker.redis.replication import Replication
from support.cluster import PrivateCluster
from support.supervision import Supervisor, outstanding, wait_for, write_config

NS = "{bench}"
QUEUE = "e2e"  # support.supervision's queue
BATCH, EVERY = 20, 0.01
AFTER = 6.0
BACKLOG = 30_000
SCENARIOS = ("sigkill", "manual", "sigkill-lagging")


def strike(cluster: PrivateCluster, scenario: str) -> float:
    """Fail the queue's master over as ``scenario`` says; seconds until promoted. A killed
    master is started again 1 s after the promotion (as a service manager would): it
    rejoins as the new master's replica, which wait_replicas = 1 needs."""
    master = cluster.owner(cluster_slot())
    replica = cluster.replica_of(master)
    started = time.monotonic()
    if scenario == "manual":
        cluster.failover(replica)
        return time.monotonic() - started
    if scenario == "sigkill-lagging":
        master.cut_replication()
        time.sleep(0.3)
    master.kill()
    cluster.wait_promoted(replica, 60)
    promoted = time.monotonic() - started
    time.sleep(1.0)
    cluster.revive(master)
    return promoted


def cluster_slot() -> int:
    from redis.crc import key_slot

    return key_slot(b"bench")


async def produce(url: str, replication: Replication, stop: asyncio.Event,
                  confirmed: list[str]) -> int:
    """Publish until ``stop``; returns how many publishes failed (retried as new ones)."""
    broker = RedisBroker(url, QUEUE, namespace=NS, cluster=True, replication=replication)
    await broker.connect()
    failed, n = 0, 0
    try:
        while not stop.is_set():
            try:
                confirmed += await broker.publish_many(
                    QUEUE, [{"n": n + i} for i in range(BATCH)])
                n += BATCH
            except Exception:  # not confirmed (NotReplicated, a dead master...): publish again
                failed += 1
            await asyncio.sleep(EVERY)
    finally:
        await broker.close()
    return failed


async def prefill(cluster: PrivateCluster, count: int) -> list[str]:
    """``count`` messages queued and confirmed by the replica before anything consumes."""
    broker = RedisBroker(cluster.seed_url, QUEUE, namespace=NS, cluster=True,
                         replication=Replication(1, 10.0))
    await broker.connect()
    try:
        return await broker.publish_many(QUEUE, [{"backlog": n} for n in range(count)])
    finally:
        await broker.close()


def read_handled(path: Path) -> list[tuple[str, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().split("\n")[:-1]:  # the last may still be being written
        pid, _, at = line.partition(" ")
        rows.append((pid, float(at)))
    return rows


async def one_run(cluster: PrivateCluster, scenario: str, wait: int, folder: Path,
                  lease: float = 3.0) -> dict[str, Any]:
    cluster.heal()
    cluster.flush()
    record = folder / f"handled-{scenario}-{wait}-{time.monotonic_ns()}.txt"
    config = write_config(
        folder, cluster.seed_url, handler="bench.record:handle",
        broker={"cluster": True, "namespace": NS, "wait_replicas": wait},
        job={"coroutines": 1, "prefetch": 100},
        supervisor={"lease": lease, "maintenance_interval": 1, "log_level": "warning"},
    )
    backlog = await prefill(cluster, BACKLOG)
    supervisors = [Supervisor(config, folder, "", namespace=NS, BENCH_RECORD=str(record))
                   for _ in range(2)]
    confirmed: list[str] = []
    stop = asyncio.Event()
    struck_at = promoted = failed = 0.0
    try:
        producer = asyncio.create_task(
            produce(cluster.seed_url, Replication(wait, 1.0), stop, confirmed))
        # Strike halfway through the backlog, so that every run has consumers busy with
        # older work and a producer's pushes waiting behind it at the strike.
        await asyncio.to_thread(
            wait_for, lambda: len(read_handled(record)) >= BACKLOG // 2, 60, "half the backlog")
        struck_at = time.monotonic()
        promoted = await asyncio.to_thread(strike, cluster, scenario)
        await asyncio.sleep(max(0.0, AFTER - (time.monotonic() - struck_at)))
        stop.set()
        failed = await producer
        wanted = set(confirmed) | set(backlog)
        await asyncio.to_thread(
            wait_for, lambda: wanted <= {pid for pid, _ in read_handled(record)}, 60,
            "every confirmed message handled")
    except AssertionError:
        pass  # reported as lost below
    finally:
        await asyncio.sleep(1.0)
        client = cluster_client(cluster)
        left = outstanding(client, NS)
        client.close()
        alive = sum(s.process.poll() is None for s in supervisors)
        for supervisor in supervisors:
            if supervisor.process.poll() is not None:  # it should have lived through it
                print(f"supervisor exited ({supervisor.process.returncode}):\n"
                      f"{supervisor.output()[-4000:]}", file=sys.stderr)
            supervisor.stop()
    rows = read_handled(record)
    counts = Counter(pid for pid, _ in rows)
    times = sorted(at for _, at in rows)
    window = [at for at in times if at >= struck_at - 1]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    return {
        "scenario": scenario, "wait_replicas": wait, "lease": lease, "backlog": len(backlog),
        "published": len(confirmed), "publish_failures": failed, "handled": len(rows),
        "lost_backlog": len(set(backlog) - set(counts)),  # only consumers' writes touched
        "lost_published": len(set(confirmed) - set(counts)),  # confirmed pushes
        "duplicates": sum(n - 1 for n in counts.values()),
        "pause_s": round(max(gaps, default=0.0), 2), "promoted_s": round(promoted, 2),
        "outstanding_after": left, "supervisors_alive": alive,
    }


def cluster_client(cluster: PrivateCluster) -> Any:
    import redis
    from redis.cluster import ClusterNode as Seed

    return redis.RedisCluster(startup_nodes=[Seed("127.0.0.1", n.port) for n in cluster.nodes
                                             if n.alive])


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | wait_replicas | lease s | runs | backlog + published | lost of the backlog "
        "| lost of the published | duplicates (per run) | publish failures "
        "| pause in handling s (max) | promotion s (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["scenario"], run["wait_replicas"], run["lease"]), []).append(run)
    for (scenario, wait, lease), group in groups.items():
        lines.append(
            f"| {scenario} | {wait} | {lease:g} | {len(group)} "
            f"| {sum(r['backlog'] for r in group):,} + {sum(r['published'] for r in group):,} "
            f"| {sum(r['lost_backlog'] for r in group)} "
            f"| {sum(r['lost_published'] for r in group)} "
            f"| {' '.join(str(r['duplicates']) for r in group)} "
            f"| {sum(r['publish_failures'] for r in group)} "
            f"| {max(r['pause_s'] for r in group)} | {max(r['promoted_s'] for r in group)} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    cluster = PrivateCluster(replicas=1, node_timeout=args.node_timeout).start()
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(args.repeat):
                for scenario in args.scenarios.split(","):
                    for wait in (int(w) for w in args.wait_replicas.split(",")):
                        run = await one_run(cluster, scenario, wait, Path(folder),
                                            args.lease)
                        print(json.dumps(run), flush=True)
                        runs.append(run)
    finally:
        cluster.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--wait-replicas", default="0,1")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--node-timeout", type=int, default=2000, help="ms")
    parser.add_argument("--lease", type=float, default=3.0,
                        help="[supervisor] lease (s); below the failover time, claims of "
                        "deliveries still running expire during it (duplicates)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    about = machine.describe({}, machine.load())
    about["busy_at_start"] = machine.busy_processes()
    runs = asyncio.run(main_async(args))
    about["load_at_end"] = machine.load()
    text = table(runs)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "failover.json").write_text(json.dumps(
            {"machine": about, "runs": runs}, indent=2))
        (args.out / "failover.md").write_text(text)
    # A consumer's writes taken back never lose work; only a push can be lost, and only
    # without wait_replicas and with a lagging replica.
    safe = all(run["lost_backlog"] == 0 and (run["lost_published"] == 0 or (
        run["scenario"] == "sigkill-lagging" and not run["wait_replicas"])) for run in runs)
    return 0 if safe else 1


if __name__ == "__main__":
    raise SystemExit(main())
