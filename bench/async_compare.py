"""Async handlers against sync processes and arq: figures, not a test.

    python -m bench.async_compare [--messages 20000] [--arq-python PATH] [--out DIR]

On one private redis-server (a free loopback port):

- I/O-bound, a handler awaiting 50 ms with 200 deliveries in flight: the supervisor with an
  async handler (2 processes x 100 tasks), the supervisor with a plain handler in 200
  processes (``time.sleep``), and an arq worker (``max_jobs = 200``, run by
  ``--arq-python``, an interpreter that has arq: it pins redis-py below 6).
- CPU-bound, a handler computing 5 ms without yielding: async with 1 and 2 processes (10
  tasks each), which must scale with processes, not tasks; the same with a plain handler.

Each run fills the queue first, starts the worker, and measures from the first completed
job to the last: jobs/s over that span, and the memory of every process of the worker at
its peak: the sum of RSS (shared pages counted in every process) and of PSS (shared pages
divided among their sharers: what the processes really cost together). Prints a markdown
table; ``--out`` also writes it to README.md with results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.common import NAMESPACE, QUEUE, ROOT, child_env, stats_usage_payload
from bench.machine import describe, load
from broker import envelope
from broker.redis.keys import QueueKeys

RING_SLOTS = 256  # per ring: 200 processes need no 2 MiB rings for 200-byte envelopes
SAMPLE = 0.05  # seconds between memory samples and completion polls


@dataclass
class Result:
    name: str
    processes: int  # handler processes (arq: 1)
    in_flight: int
    jobs: int  # measured: completed between the first and the last observation
    seconds: float
    jobs_per_s: float
    rss_mib: float  # peak of the sum over every process of the worker
    pss_mib: float
    cpu_s: float  # CPU seconds of every process of the worker, whole run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.async_compare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20000, help="per I/O-bound run")
    parser.add_argument("--cpu-messages", type=int, default=1500, help="per CPU-bound run")
    parser.add_argument("--wait-ms", type=float, default=50)
    parser.add_argument("--spin-ms", type=float, default=5)
    parser.add_argument("--arq-python", default=shutil.which("python3") or sys.executable,
                        help="an interpreter with arq installed (skipped if it has none)")
    parser.add_argument("--only", default="", help="comma-separated run names")
    parser.add_argument("--out", type=Path, help="folder for README.md and results.json")
    args = parser.parse_args(argv)
    from support.servers import RedisServer

    began_load = load()
    server = RedisServer().start()
    env = {"BENCH_WAIT_MS": str(args.wait_ms), "BENCH_SPIN_MS": str(args.spin_ms)}
    runs = [
        ("async 2 x 100", lambda: supervisor(server.url, "bench.async_handlers:wait", 2, 100,
                                             args.messages, env)),
        ("sync 200 processes", lambda: supervisor(server.url, "bench.async_handlers:wait_sync",
                                                  200, 1, args.messages, env)),
        ("arq max_jobs 200", lambda: arq(server.url, args.arq_python, 200, args.messages,
                                         args.wait_ms)),
        ("cpu: async 1 x 10", lambda: supervisor(server.url, "bench.async_handlers:spin", 1, 10,
                                                 args.cpu_messages, env)),
        ("cpu: async 2 x 10", lambda: supervisor(server.url, "bench.async_handlers:spin", 2, 10,
                                                 args.cpu_messages, env)),
        ("cpu: sync 1 process", lambda: supervisor(server.url, "bench.async_handlers:spin_sync",
                                                   1, 1, args.cpu_messages, env)),
        ("cpu: sync 2 processes", lambda: supervisor(
            server.url, "bench.async_handlers:spin_sync", 2, 1, args.cpu_messages, env)),
    ]
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    results: list[Result] = []
    try:
        for name, run in runs:
            if only and name not in only:
                continue
            server.cli("FLUSHALL")
            result = run()
            if result is None:
                print(f"{name}: skipped ({args.arq_python} has no arq)", file=sys.stderr)
                continue
            result.name = name
            results.append(result)
            print(f"{name}: {result.jobs_per_s:.0f} jobs/s, RSS {result.rss_mib:.0f} MiB, "
                  f"PSS {result.pss_mib:.0f} MiB", file=sys.stderr, flush=True)
    finally:
        server.close()
    table = render(results, args, began_load)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "README.md").write_text(table)
        (args.out / "results.json").write_text(json.dumps(
            {"results": [asdict(r) for r in results], "machine": describe({}, began_load),
             "settings": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


def supervisor(url: str, handler: str, processes: int, tasks: int, messages: int,
               env: dict[str, str]) -> Result:
    import tempfile

    in_flight = processes * tasks
    client = redis.Redis.from_url(url)
    fill(client, messages)
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bench.toml"
        config.write_text(
            f'[broker]\nurl = "{url}"\nnamespace = "{NAMESPACE}"\n'
            f'[job]\nqueue = "{QUEUE}"\nhandler = "{handler}"\ncoroutines = {processes}\n'
            f"tasks_per_process = {tasks}\nprefetch = {2 * in_flight}\n"
            f'[supervisor]\nlog_level = "warning"\nring_slots = {RING_SLOTS}\n'
        )
        child = subprocess.Popen([sys.executable, "-m", "supervisor", str(config)], cwd=ROOT,
                                 env=child_env(**env))
        success = QueueKeys(NAMESPACE, QUEUE).stat("success")
        try:
            return measure(child, lambda: int(client.get(success) or 0), messages, processes,
                           in_flight)
        finally:
            child.terminate()
            child.wait(60)


def arq(url: str, python: str, max_jobs: int, messages: int, wait_ms: float) -> Result | None:
    if subprocess.run([python, "-c", "import arq"], capture_output=True).returncode:
        return None
    environ = child_env()
    subprocess.run([python, "-m", "bench.peer_arq", "fill", url, "--messages", str(messages)],
                   cwd=ROOT, env=environ, check=True)
    client = redis.Redis.from_url(url)
    child = subprocess.Popen(
        [python, "-m", "bench.peer_arq", "work", url, "--max-jobs", str(max_jobs),
         "--wait-ms", str(wait_ms)], cwd=ROOT, env=environ, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        return measure(child, lambda: messages - int(client.zcard("arq:queue")), messages, 1,
                       max_jobs)
    finally:
        child.terminate()
        child.wait(60)


def fill(client: redis.Redis, messages: int) -> None:
    key = QueueKeys(NAMESPACE, QUEUE).ready
    for start in range(0, messages, 1000):
        raws = [envelope.build(QUEUE, stats_usage_payload(n))[1]
                for n in range(start, min(messages, start + 1000))]
        client.lpush(key, *raws)


def measure(child: subprocess.Popen, done: Any, messages: int, processes: int,
            in_flight: int) -> Result:
    """Poll ``done()`` until it reaches ``messages``; memory sampled all along."""
    family = psutil.Process(child.pid)
    rss = pss = 0.0
    first: tuple[float, int] | None = None
    deadline = time.monotonic() + 600
    cpu: dict[int, float] = {}
    while True:
        count = done()
        now = time.monotonic()
        if first is None and count > 0:
            first = (now, count)
        try:  # ended since the last poll: reported below, as the worker's exit
            members = [family, *family.children(recursive=True)]
        except psutil.Error:
            members = []
        rss_sum = pss_sum = 0.0
        for member in members:
            with contextlib.suppress(psutil.Error):
                info = member.memory_full_info()
                rss_sum += info.rss
                pss_sum += info.pss
                times = member.cpu_times()
                cpu[member.pid] = times.user + times.system
        rss, pss = max(rss, rss_sum / 2**20), max(pss, pss_sum / 2**20)
        if count >= messages:
            break
        if child.poll() is not None:
            raise RuntimeError(f"worker exited with {child.returncode} mid-run")
        if now > deadline:
            raise RuntimeError(f"only {count} of {messages} done after 600 s")
        time.sleep(SAMPLE)
    assert first is not None
    seconds = max(now - first[0], 1e-9)
    jobs = count - first[1]
    return Result("", processes, in_flight, jobs, seconds, jobs / seconds, rss, pss,
                  sum(cpu.values()))


def render(results: list[Result], args: argparse.Namespace, began_load: list[float]) -> str:
    lines = [
        f"# Async handlers: {args.wait_ms:g} ms awaited per job (I/O) or {args.spin_ms:g} ms "
        "computed (CPU)",
        "",
        f"Machine: {describe({}, began_load)['cpu']}, {psutil.cpu_count()} cores; load "
        f"average at the start {began_load}, at the end {load()} (the harness's own runs "
        "count in it). One private redis-server. Memory: peak sums "
        "over every process of the worker (supervisor, fork server, handlers; arq: its one "
        "process).",
        "",
        "| run | processes | in flight | jobs | jobs/s | RSS MiB | PSS MiB | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {r.name} | {r.processes} | {r.in_flight} | {r.jobs} | {r.jobs_per_s:.0f} | "
          f"{r.rss_mib:.0f} | {r.pss_mib:.0f} | {r.cpu_s:.1f} |" for r in results),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
