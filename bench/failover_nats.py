"""``python -m bench.failover_nats``: a supervisor on a three-server JetStream cluster while
one server is killed (SIGKILL), and what one stream costs the servers.

Failover scenarios (a fresh cluster each; the work stream and consumer have 3 replicas):
``stream_leader``, ``consumer_leader``, ``connected_server`` (the server the supervisor's
connection is on) and ``follower`` (a server that is none of those, when there is one), each
killed with SIGKILL; ``stream_leader_sigterm``: the stream leader stopped with SIGTERM (a
graceful shutdown, which hands its leaderships over first).
Messages are published at a steady rate from a separate client (its own retries, with
``Nats-Msg-Id`` so a repeat is deduplicated); the victim is killed at ``--kill-at``, started
again ``--down`` seconds later (it rejoins), and the run drains. Per scenario:

- messages, handled (unique), duplicates (handler calls beyond one per message), lost
  (published, confirmed, never handled);
- recovery: from the kill to the first handler call of a message published after it (the
  whole path works again: publish, stream, consumer, pull, handler);
- caught up: from the kill until every message published before it had run (includes
  redeliveries after ack_wait of deliveries whose acks were lost);
- publish stall: the longest a publish waited for its PubAck around the kill;
- handler gap: the longest pause between two handler calls in the 20 s after the kill
  (publishing goes on at a steady rate, so a pause is the outage as consumers see it);
- the supervisor's uncertain acks and reconnections (from its log).

``--capacity N``: N messages published and then consumed (no-op handler) on streams of 1
and 3 replicas; the CPU of each server per message, by role (stream leader or not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
import psutil

from bench import machine
from broker import envelope
from broker.nats import NatsBroker
from broker.nats.setup import QueueNames
from support.servers import NatsCluster, NatsServer
from support.supervision import Supervisor, wait_for, write_config
from support.waiting import until

QUEUE = "failover"
NAMES = QueueNames.of(QUEUE)
CLIENT_NAME = f"queue-supervisor {QUEUE}"
SCENARIOS = ("stream_leader", "consumer_leader", "connected_server", "follower",
             "stream_leader_sigterm")


@dataclass
class Settings:
    rate: float = 300.0  # messages published per second
    seconds: float = 20.0  # publishing window
    kill_at: float = 6.0  # seconds into the window
    down: float = 8.0  # seconds the victim stays down
    ack_wait: float = 3.0
    lease: float = 3.0
    prefetch: int = 50
    coroutines: int = 2
    work_ms: float = 2.0


@dataclass
class Failover:
    scenario: str
    victim: str = ""
    roles: str = ""  # what the victim was: stream/consumer leader, the supervisor's server
    messages: int = 0
    handled: int = 0
    duplicates: int = 0
    lost: int = 0
    recovery_s: float | None = None
    caught_up_s: float | None = None
    publish_stall_s: float = 0.0
    handler_gap_s: float = 0.0  # the longest pause between handler calls after the kill
    uncertain: int = 0
    reconnects: int = 0
    notes: list[str] = field(default_factory=list)


class Publisher:
    """Publishes at a steady rate; records when each message's PubAck arrived."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.confirmed: dict[str, float] = {}  # pid -> unix time of its PubAck
        self.sent_at: dict[str, float] = {}  # pid -> unix time of its first try
        self.stalls: list[tuple[float, float]] = []  # (first try, seconds to confirm)

    async def run(self, rate: float, seconds: float) -> None:
        client = await nats.connect(self.url.split(","), max_reconnect_attempts=-1,
                                    reconnect_time_wait=0.1, error_cb=_quiet)
        js = client.jetstream(timeout=2)
        began = time.monotonic()
        tasks = []
        for n in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, began + n / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(self._one(js, n)))
        await asyncio.gather(*tasks)
        await client.close()

    async def _one(self, js: Any, n: int) -> None:
        pid, raw = envelope.build(QUEUE, {"n": n})
        first = time.monotonic()
        self.sent_at[pid] = first
        while True:
            try:
                await js.publish(NAMES.subject, raw, headers={"Nats-Msg-Id": pid})
                break
            except Exception:  # no leader, no server: repeat (deduplicated by Nats-Msg-Id)
                await asyncio.sleep(0.1)
        self.confirmed[pid] = time.monotonic()
        self.stalls.append((first, self.confirmed[pid] - first))


async def _quiet(error: Exception) -> None:
    pass


def handler_calls(path: Path) -> list[tuple[str, float]]:
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        pid, _, at = line.partition(" ")
        with contextlib.suppress(ValueError):
            calls.append((pid, float(at)))
    return calls


def roles_of(cluster: NatsCluster, server: NatsServer) -> list[str]:
    roles = []
    if cluster.leader(NAMES.stream) is server:
        roles.append("stream leader")
    if cluster.leader(NAMES.stream, NAMES.consumer) is server:
        roles.append("consumer leader")
    if server in cluster.serving(CLIENT_NAME):
        roles.append("supervisor's server")
    return roles


def pick_victim(cluster: NatsCluster, scenario: str) -> NatsServer | None:
    if scenario in ("stream_leader", "stream_leader_sigterm"):
        return cluster.leader(NAMES.stream)
    if scenario == "consumer_leader":
        return cluster.leader(NAMES.stream, NAMES.consumer)
    if scenario == "connected_server":
        serving = cluster.serving(CLIENT_NAME)
        return serving[0] if serving else None
    spare = [s for s in cluster.servers if not roles_of(cluster, s)]
    return spare[0] if spare else None


async def create_queue(url: str, settings: Settings) -> None:
    broker = NatsBroker(url, QUEUE, ack_wait=settings.ack_wait, replicas=3)
    await broker.connect()
    await broker.close()


def start_supervisor(workdir: Path, url: str, settings: Settings, handler: str,
                     log: Path) -> Supervisor:
    config = write_config(
        workdir, url, handler=handler,
        job={"queue": QUEUE, "prefetch": settings.prefetch, "coroutines": settings.coroutines},
        nats={"ack_wait": settings.ack_wait, "replicas": 3},
        supervisor={"lease": settings.lease, "log_level": "warning"},
    )
    supervisor = Supervisor(config, workdir, "", BENCH_RECORD=str(log),
                            BENCH_WORK_MS=str(settings.work_ms))
    wait_for(lambda: consuming(supervisor), 30, "the supervisor to consume")
    return supervisor


def consuming(supervisor: Supervisor) -> bool:
    try:
        return "running" in " ".join(psutil.Process(supervisor.pid).cmdline())
    except psutil.Error:
        return False


async def stream_messages(url: str) -> int:
    client = await nats.connect(url.split(","), allow_reconnect=False, error_cb=_quiet)
    try:
        return (await client.jetstream(timeout=5).stream_info(NAMES.stream)).state.messages
    finally:
        await client.close()


async def failover(scenario: str, settings: Settings) -> Failover:
    result = Failover(scenario)
    workdir = Path(tempfile.mkdtemp(prefix="failover-"))
    log = workdir / "calls"
    cluster = NatsCluster().start()
    supervisor = None
    try:
        await create_queue(cluster.url, settings)
        supervisor = start_supervisor(workdir, cluster.url, settings,
                                      "bench.record:handle", log)
        publisher = Publisher(cluster.url)
        publishing = asyncio.ensure_future(publisher.run(settings.rate, settings.seconds))
        await asyncio.sleep(settings.kill_at)
        victim = pick_victim(cluster, scenario)
        if victim is None:
            publishing.cancel()
            result.notes.append("no such server in this cluster's layout: skipped")
            return result
        result.victim, result.roles = victim.name, ", ".join(roles_of(cluster, victim))
        killed = time.monotonic()
        victim.stop(signal.SIGTERM if scenario.endswith("_sigterm") else signal.SIGKILL)
        await asyncio.sleep(settings.down)
        victim.start()
        await publishing
        pids = set(publisher.confirmed)
        await _drain(log, pids, cluster.url)
        supervisor.signal(signal.SIGTERM)
        await asyncio.to_thread(supervisor.wait, 30)
        measure(result, handler_calls(log), publisher, killed, supervisor.output())
        return result
    finally:
        if supervisor is not None:
            supervisor.stop()
        cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


async def _drain(log: Path, pids: set[str], url: str,
                 timeout: float = 90.0,  # noqa: ASYNC109 - gives up quietly: lost is counted
                 ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pids <= {pid for pid, _ in handler_calls(log)}:
            with contextlib.suppress(Exception):
                if await stream_messages(url) == 0:
                    return
        await asyncio.sleep(0.25)


def measure(result: Failover, calls: list[tuple[str, float]], publisher: Publisher,
            killed: float, output: str) -> None:
    pids = set(publisher.confirmed)
    ran = [pid for pid, _ in calls]
    result.messages = len(pids)
    result.handled = len(set(ran) & pids)
    result.duplicates = len(ran) - len(set(ran))
    result.lost = len(pids - set(ran))
    after = [at for pid, at in calls if publisher.sent_at.get(pid, 0) > killed]
    result.recovery_s = round(min(after) - killed, 2) if after else None
    first_run: dict[str, float] = {}
    for pid, at in calls:
        first_run.setdefault(pid, at)
    before = [first_run[p] for p, sent in publisher.sent_at.items() if sent <= killed
              and p in first_run]
    result.caught_up_s = round(max(0.0, max(before) - killed), 2) if before else None
    around = [took for first, took in publisher.stalls if first >= killed - 1]
    result.publish_stall_s = round(max(around, default=0.0), 2)
    times = sorted(at for _, at in calls if killed - 1 <= at <= killed + 20)
    gaps = [b - a for a, b in zip([killed, *times], times, strict=False)]
    result.handler_gap_s = round(max(gaps, default=0.0), 2)
    result.uncertain = output.count(" is uncertain (")
    result.reconnects = output.count("NATS reconnected")


# -- capacity -------------------------------------------------------------------------------


@dataclass
class Capacity:
    replicas: int
    messages: int
    publish_per_s: float
    consume_per_s: float
    leader_publish_us: float  # stream leader's CPU per message while publishing
    followers_publish_us: float  # mean of the other two
    leader_consume_us: float
    followers_consume_us: float
    supervisor_us: float


def cpu(server: NatsServer) -> float:
    assert server.process is not None
    times = psutil.Process(server.process.pid).cpu_times()
    return times.user + times.system


def split_cpu(cluster: NatsCluster, leader: NatsServer, before: dict[str, float],
              count: int) -> tuple[float, float]:
    used = {s.name: cpu(s) - before[s.name] for s in cluster.servers}
    others = [used[s.name] for s in cluster.servers if s is not leader]
    return (round(used[leader.name] / count * 1e6, 1),
            round(statistics.mean(others) / count * 1e6, 1))


async def capacity(replicas: int, count: int, settings: Settings) -> Capacity:
    workdir = Path(tempfile.mkdtemp(prefix="capacity-"))
    cluster = NatsCluster().start()
    supervisor = None
    try:
        broker = NatsBroker(cluster.url, QUEUE, ack_wait=30, replicas=replicas)
        await broker.connect()
        leader = cluster.leader(NAMES.stream)
        assert leader is not None
        before = {s.name: cpu(s) for s in cluster.servers}
        began = time.monotonic()
        for start in range(0, count, 5000):
            await broker.publish_many(QUEUE, [{"n": n} for n in range(start,
                                                                      min(count, start + 5000))])
        published = time.monotonic() - began
        await broker.close()
        publish_cpu = split_cpu(cluster, leader, before, count)
        before = {s.name: cpu(s) for s in cluster.servers}
        settings = Settings(**{**asdict(settings), "prefetch": 100, "coroutines": 1})
        config_dir = workdir / "run"
        config_dir.mkdir()
        config = write_config(
            config_dir, cluster.url, handler="examples.noop:handle",
            job={"queue": QUEUE, "prefetch": 100, "coroutines": 1},
            nats={"ack_wait": 30.0, "replicas": replicas},
            supervisor={"lease": 30, "log_level": "warning"},
        )
        supervisor = Supervisor(config, config_dir, "")
        left = count

        async def consuming() -> bool:  # the supervisor's start is not measured
            nonlocal left
            left = await stream_messages(cluster.url)
            return left != count

        async def emptied() -> bool:
            return await stream_messages(cluster.url) == 0

        await until(consuming, 120, "the supervisor to start consuming", every=0.02)
        began = time.monotonic()
        await until(emptied, None, "the stream to empty", every=0.02)  # measured: no bound
        consumed = (time.monotonic() - began) * count / left
        consume_cpu = split_cpu(cluster, leader, before, count)
        client_cpu = 0.0
        for process in supervisor.family():  # one that ended since the listing counts 0
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                client_cpu += times.user + times.system
        return Capacity(replicas, count, round(count / published), round(count / consumed),
                        *publish_cpu, *consume_cpu, round(client_cpu / count * 1e6, 1))
    finally:
        if supervisor is not None:
            supervisor.stop()
        cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


# -- report ---------------------------------------------------------------------------------


def failover_table(results: list[Failover]) -> list[str]:
    lines = ["| scenario | victim was | messages | handled | duplicates | lost | recovery s "
             "| caught up s | publish stall s | handler gap s | uncertain acks | reconnects |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.notes:
            lines.append(f"| {r.scenario} | {'; '.join(r.notes)} | | | | | | | | | | |")
            continue
        lines.append(f"| {r.scenario} | {r.roles or 'no role'} | {r.messages:,} | "
                     f"{r.handled:,} | {r.duplicates} | {r.lost} | {r.recovery_s} | "
                     f"{r.caught_up_s} | {r.publish_stall_s} | {r.handler_gap_s} | {r.uncertain} | "
                     f"{r.reconnects} |")
    return lines


def capacity_table(results: list[Capacity]) -> list[str]:
    lines = ["| replicas | messages | publish msgs/s | consume msgs/s | leader µs/msg publish | "
             "follower µs/msg publish | leader µs/msg consume | follower µs/msg consume | "
             "supervisor µs/msg |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in results:
        lines.append(f"| {c.replicas} | {c.messages:,} | {c.publish_per_s:,} | "
                     f"{c.consume_per_s:,} | {c.leader_publish_us} | {c.followers_publish_us} "
                     f"| {c.leader_consume_us} | {c.followers_consume_us} | {c.supervisor_us} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover_nats",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=0, metavar="N",
                        help="also measure server CPU per message over N messages")
    parser.add_argument("--rate", type=float, default=Settings.rate)
    parser.add_argument("--seconds", type=float, default=Settings.seconds)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args(argv)
    settings = Settings(rate=args.rate, seconds=args.seconds)
    load_at_start = machine.load()
    results: list[Failover] = []
    for _ in range(args.repeat):
        for scenario in args.scenarios.split(","):
            outcome = asyncio.run(failover(scenario, settings))
            print(json.dumps(asdict(outcome)), file=sys.stderr, flush=True)
            results.append(outcome)
    capacities = []
    for replicas in ((1, 3) if args.capacity else ()):
        measured = asyncio.run(capacity(replicas, args.capacity, settings))
        print(json.dumps(asdict(measured)), file=sys.stderr, flush=True)
        capacities.append(measured)
    print("\n".join(failover_table(results)))
    if capacities:
        print("\n".join(capacity_table(capacities)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "machine": machine.describe({"nats-server": "3-server cluster"}, load_at_start),
            "load_at_end": machine.load(), "settings": asdict(settings),
            "failover": [asdict(r) for r in results],
            "capacity": [asdict(c) for c in capacities],
        }, indent=1))
    return 1 if any(r.lost for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
