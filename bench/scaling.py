"""Many supervisors on one queue: total jobs/s, Redis CPU per job, fairness, per-job work.

    python -m bench.scaling --supervisors 1,2,4,8 --messages 40000 --out bench/results/<name>

One private redis-server (one master: a queue lives in one slot, so in a Cluster one
master carries it too) with one replica attached, so ``--wait-replicas`` runs compare with
the same server load. Per configuration: fill a staging list while nothing consumes, start
N ``python -m supervisor`` (no-op handler, coroutines 1, prefetch 100), wait until all are
up and idle, RENAME staging -> ready, time until the success counter reaches the count.

Measured per run: jobs/s; server CPU per job; requests (commands a client sent, scripts
counted once) per job, split into reserve/claim/settle/other calls; jobs per supervisor
(from each one's /metrics: fairness as min/max and Jain's index); CPU of the supervisors
(parent and handler processes) and of the whole machine, to show where the time went; and,
after the run, the idle server load of N supervisors (renewal, blocking receives, sweeps and
the reap lock) in commands/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from bench import machine, redis_side
from bench.common import NAMESPACE, QUEUE, Family, start, stop, wait_until_title
from broker.redis.keys import QueueKeys
from support.servers import RedisServer, free_port

KEYS = QueueKeys(NAMESPACE, QUEUE)
STAGING = f"{KEYS.ready}.staging"
SETTLE_AFTER_START = 1.0  # every supervisor blocked on the empty queue
IDLE_SECONDS = 10.0


@dataclass
class Run:
    supervisors: int
    wait_replicas: int
    messages: int
    seconds: float
    jobs_per_s: float
    server_us_per_job: float
    requests_per_job: float
    server_commands_per_job: float  # every command Redis ran, scripts' inner ones included
    server_commands: dict[str, int]  # the same by command name, for the whole run
    script_calls_per_job: float
    reserve_calls: int
    claim_calls: int
    settle_calls: int
    other_requests: dict[str, int]
    per_supervisor: list[int]
    fairness_min_max: float
    fairness_jain: float
    cpu_share: dict[str, float]  # of the machine's CPU time during the run (all cores)
    idle_commands_per_s: float
    idle_server_cpu_pct: float


def job_file(folder: Path, url: str, metrics_port: int, wait_replicas: int) -> Path:
    path = folder / f"job-{metrics_port}.toml"
    path.write_text(
        f'[broker]\nurl = "{url}"\nnamespace = "{NAMESPACE}"\n'
        f"wait_replicas = {wait_replicas}\n"
        f'[job]\nqueue = "{QUEUE}"\nhandler = "examples.noop:handle"\ncoroutines = 1\n'
        f"prefetch = 100\n"
        f'[supervisor]\nlog_level = "warning"\nmetrics_port = {metrics_port}\n'
    )
    return path


def received(port: int) -> int:
    """Deliveries this supervisor received, from its own metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith("queue_supervisor_deliveries_received_total"):
                return int(float(line.split()[-1]))
    return 0


def jain(values: list[int]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


def machine_cpu() -> float:
    times = psutil.cpu_times()
    return times.user + times.system + getattr(times, "irq", 0) + getattr(times, "softirq", 0)


def measure(server: RedisServer, count: int, messages: int, wait_replicas: int,
            folder: Path) -> Run:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    redis_side.fill(client, STAGING, messages)
    ports = [free_port() for _ in range(count)]
    children = [start(["-m", "supervisor", str(job_file(folder, server.url, port, wait_replicas))])
                for port in ports]
    families = [Family(child.pid) for child in children]
    try:
        for child in children:
            wait_until_title(child.pid, "running")
        time.sleep(SETTLE_AFTER_START)
        internal = redis_side.script_commands()
        probe = redis_side.Probe(client)
        redis_side.reset(client)
        server_process = psutil.Process(server.process.pid)  # type: ignore[union-attr]
        before = redis_side.snapshot(client)
        cpu_before = [family.cpu() for family in families]
        parents_before = sum(family.root_cpu() for family in families)
        server_before = sum(server_process.cpu_times()[:2])
        machine_before = machine_cpu()
        started = time.monotonic()
        client.rename(STAGING, KEYS.ready)
        while probe.get_int(KEYS.stat("success")) < messages:
            time.sleep(0.005)
        seconds = time.monotonic() - started
        after = redis_side.snapshot(client)
        machine_used = machine_cpu() - machine_before
        server_used = sum(server_process.cpu_times()[:2]) - server_before
        supervisors_used = sum(f.cpu() for f in families) - sum(cpu_before)
        parents_used = sum(family.root_cpu() for family in families) - parents_before
        counts = [received(port) for port in ports]
        figures = redis_side.delta(before, after, internal, probe)
        executed = (sum(after.calls.values()) - sum(before.calls.values())
                    - sum(probe.sent.values()) - 1)  # less the harness's polls and INFO
        idle = idle_load(client, server_process)
    finally:
        for child in children:
            stop(child)
    requests = figures["requests_by_command"]
    others = {name: n for name, n in requests.items() if name not in ("evalsha", "eval")}
    return Run(
        supervisors=count, wait_replicas=wait_replicas, messages=messages,
        seconds=round(seconds, 3), jobs_per_s=round(messages / seconds),
        server_us_per_job=round(figures["server_cpu_s"] / messages * 1e6, 2),
        requests_per_job=round(figures["requests"] / messages, 4),
        server_commands_per_job=round(executed / messages, 3),
        server_commands={name: after.calls[name] - before.calls.get(name, 0)
                         for name in after.calls if after.calls[name] > before.calls.get(name, 0)},
        script_calls_per_job=round(figures["script_calls"] / messages, 4),
        reserve_calls=figures["reserve_calls"], claim_calls=figures["claim_calls"],
        settle_calls=figures["settle_calls"], other_requests=others,
        per_supervisor=counts,
        fairness_min_max=round(min(counts) / max(counts), 3) if max(counts) else 0.0,
        fairness_jain=round(jain(counts), 4),
        cpu_share={
            "redis_server": round(server_used / machine_used, 3),
            "supervisor_parents": round(parents_used / machine_used, 3),
            "handler_processes": round((supervisors_used - parents_used) / machine_used, 3),
            "other": round(max(0.0, 1 - (server_used + supervisors_used) / machine_used), 3),
            "machine_busy": round(machine_used / (seconds * psutil.cpu_count()), 3),
        },
        idle_commands_per_s=idle[0], idle_server_cpu_pct=idle[1],
    )


def measure_again(server: RedisServer, count: int, messages: int, wait_replicas: int,
                  folder: Path, attempts: int = 3) -> Run:
    """``measure``, started over when a supervisor failed to start (a metrics port that
    another process took between the draw and the bind)."""
    for attempt in range(attempts):
        try:
            return measure(server, count, messages, wait_replicas, folder)
        except (RuntimeError, psutil.Error):
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def idle_load(client: redis.Redis, server: psutil.Process) -> tuple[float, float]:
    """Commands/s and server CPU % while the supervisors of a run sit on an empty queue."""
    time.sleep(1.0)
    before_calls = sum(redis_side.snapshot(client).calls.values())
    before_cpu = sum(server.cpu_times()[:2])
    time.sleep(IDLE_SECONDS)
    calls = sum(redis_side.snapshot(client).calls.values()) - before_calls
    cpu = sum(server.cpu_times()[:2]) - before_cpu
    return round(calls / IDLE_SECONDS, 1), round(cpu / IDLE_SECONDS * 100, 2)


def start_servers() -> tuple[RedisServer, RedisServer]:
    """A master and a replica of it (``WAIT`` needs one; every run pays for it alike)."""
    master = RedisServer().start()
    replica = RedisServer(extra=[]).start()
    redis.Redis(port=replica.port).execute_command("REPLICAOF", "127.0.0.1", master.port)
    client = redis.Redis(port=master.port)
    deadline = time.monotonic() + 30
    while client.info("replication").get("connected_slaves", 0) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not connect")
        time.sleep(0.05)
    return master, replica


def report(runs: list[Run], about: dict[str, Any]) -> str:
    lines = [
        "# Many supervisors on one queue",
        "",
        f"Machine: {about['cpu']}, {about['cores_logical']} logical cores; "
        f"{about['servers']['redis']} (one master, one replica); load average at the start "
        f"{about['load_at_start']}; busy processes at the start: "
        f"{', '.join(about['busy_at_start']) or 'none'}.",
        "",
        "| supervisors | wait_replicas | jobs/s | Redis µs/job | requests/job "
        "| Redis commands/job | scripts/job "
        "| reserve / claim / settle calls | jobs per supervisor | min/max | Jain "
        "| CPU: redis / parents / handlers / other (machine busy) | idle cmds/s "
        "| idle Redis CPU % |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|---:|---:|",
    ]
    for run in runs:
        share = run.cpu_share
        lines.append(
            f"| {run.supervisors} | {run.wait_replicas} | {run.jobs_per_s:,} "
            f"| {run.server_us_per_job} | {run.requests_per_job} "
            f"| {run.server_commands_per_job} | {run.script_calls_per_job} "
            f"| {run.reserve_calls} / {run.claim_calls} / {run.settle_calls} "
            f"| {' '.join(str(n) for n in run.per_supervisor)} | {run.fairness_min_max} "
            f"| {run.fairness_jain} | {share['redis_server']:.0%} / "
            f"{share['supervisor_parents']:.0%} / {share['handler_processes']:.0%} / "
            f"{share['other']:.0%} ({share['machine_busy']:.0%}) "
            f"| {run.idle_commands_per_s} | {run.idle_server_cpu_pct} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supervisors", default="1,2,4,8")
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--wait-replicas", default="0", help="e.g. 0,1: each for every count")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    about = machine.describe({}, machine.load())
    about["busy_at_start"] = machine.busy_processes()
    master, replica = start_servers()
    runs: list[Run] = []
    try:
        about["servers"] = {"redis": redis_side.server_version(redis.Redis(port=master.port))}
        with tempfile.TemporaryDirectory() as folder:
            for wait in (int(w) for w in args.wait_replicas.split(",")):
                for count in (int(n) for n in args.supervisors.split(",")):
                    run = measure_again(master, count, args.messages, wait, Path(folder))
                    print(json.dumps(asdict(run)), flush=True)
                    runs.append(run)
    finally:
        replica.close()
        master.close()
    about["load_at_end"] = machine.load()
    text = report(runs, about)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"machine": about, "runs": [asdict(run) for run in runs]}, indent=2))
        (args.out / "table.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
