"""``python -m bench.dashboard_load``: the dashboard's own load on Redis, against a
supervisor's at full speed (issue 27: under 1% of a supervisor at 10,000 jobs/s, with 20
queues and 8 supervisors shown).

    python -m bench.dashboard_load [--messages 100000] [--window 60] [--out DIR]

1. Reference: one supervisor (no-op handler, prefetch 100, as ``python -m bench``) drains
   ``--messages`` stats-usage envelopes made ready at once; Redis CPU (INFO cpu) and the
   commands Redis ran (INFO commandstats: calls and usec, commands inside scripts
   included) are read before and after. Scaled to 10,000 jobs/s: per job x 10,000.
2. Dashboard: 20 queues (each with ready and failed jobs, failure records), 8 of them with
   a running supervisor (idle: its blocking receives and renewals go on). For ``--window``
   seconds without the dashboard, then as long with it (sampling every 5 s, its default)
   and with one browser on a queue page (the heaviest: SCAN for the supervisor records,
   reservations), fetched every 5 s as the page's live part is. The difference of the two
   windows is the dashboard's load.

The machine is shared and noisy: idle supervisors' own commands vary between windows, so
the difference carries that noise; INFO cpu counts 10 ms ticks. Prints one JSON object and
writes it with a README table to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis

from bench import redis_side
from bench.common import start, stop, until, wait_until_title
from broker.failure import Failure
from broker.redis.keys import QueueKeys
from support.envelopes import lpush_batched, of
from support.servers import RedisServer, free_port, wait_for_port
from support.supervision import write_config

NAMESPACE = "utopia-queue"
QUEUES = 20
SUPERVISORS = 8
TARGET_RATE = 10_000


def job(directory: Path, url: str, queue: str, **jobs: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_config(directory, url, handler="examples.noop:handle",
                        broker={"namespace": NAMESPACE},
                        job={"queue": queue, "prefetch": 100, **jobs},
                        supervisor={"lease": 30, "maintenance_interval": 10})


def load(client: redis.Redis, before: redis_side.Snapshot, seconds: float) -> dict[str, Any]:
    after = redis_side.snapshot(client)
    calls = sum(after.calls.values()) - sum(before.calls.values())
    usec = sum(after.usec.values()) - sum(before.usec.values())
    return {"seconds": seconds, "redis_cpu_s": after.cpu - before.cpu, "commands": calls,
            "command_usec": usec, "cpu_per_s": (after.cpu - before.cpu) / seconds,
            "commands_per_s": calls / seconds, "usec_per_s": usec / seconds}


def reference(url: str, client: redis.Redis, work: Path, messages: int) -> dict[str, Any]:
    keys = QueueKeys(NAMESPACE, "reference")
    redis_side.fill(client, "staging", messages)
    supervisor = start(["-m", "supervisor", str(job(work / "reference", url, "reference"))])
    try:
        wait_until_title(supervisor.pid, "running")
        time.sleep(2)
        client.config_resetstat()
        before = redis_side.snapshot(client)
        began = time.monotonic()
        client.rename("staging", keys.ready)
        success = keys.stat("success")
        until(lambda: int(client.get(success) or 0) >= messages, supervisor, 600, poll=0.05)
        elapsed = time.monotonic() - began
        result = load(client, before, elapsed)
    finally:
        stop(supervisor)
    result["jobs_per_s"] = messages / elapsed
    scale = TARGET_RATE / result["jobs_per_s"]
    result["at_10k"] = {"cpu_per_s": result["cpu_per_s"] * scale,
                        "commands_per_s": result["commands_per_s"] * scale,
                        "usec_per_s": result["usec_per_s"] * scale}
    return result


def fleet(url: str, client: redis.Redis, work: Path) -> list[Path]:
    configs = []
    for n in range(QUEUES):
        name = f"queue-{n:02d}"
        keys = QueueKeys(NAMESPACE, name)
        lpush_batched(client, keys.ready, of(name, ({"n": i} for i in range(200))))
        for i in range(30):
            [(pid, raw)] = of(name, [{"failed": i}])
            client.set(keys.job(pid), raw)
            client.lpush(keys.failed, pid)
            client.set(keys.error(pid), Failure("ValueError", f"bad input {i}").encode())
        configs.append(job(work / name, url, name))
    return configs


def measure_dashboard(url: str, client: redis.Redis, work: Path, window: float
                      ) -> dict[str, Any]:
    configs = fleet(url, client, work)
    # The first 8 queues have a supervisor: it drains their ready messages, then idles
    # (blocking receives, renewals, maintenance); the other 12 keep their backlog.
    supervisors = [start(["-m", "supervisor", str(path)]) for path in configs[:SUPERVISORS]]
    dashboard = None
    try:
        for supervisor in supervisors:
            wait_until_title(supervisor.pid, "running", 60)
        time.sleep(5)
        client.config_resetstat()
        before = redis_side.snapshot(client)
        time.sleep(window)
        without = load(client, before, window)

        port = free_port()
        dashboard = start(["-m", "supervisor", "dashboard", *map(str, configs),
                           "--listen", f"127.0.0.1:{port}"])
        wait_for_port(port, 30)
        time.sleep(6)  # its first samples (and connections) are not what it costs later
        client.config_resetstat()
        before = redis_side.snapshot(client)
        began = time.monotonic()
        pages = 0
        while time.monotonic() - began < window:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/live/q/0", timeout=10) as r:
                r.read()
            pages += 1
            time.sleep(5)
        with_dashboard = load(client, before, time.monotonic() - began)
    finally:
        if dashboard is not None:
            stop(dashboard)
        for supervisor in supervisors:
            stop(supervisor)
    return {"queues_shown": len(configs), "supervisors": SUPERVISORS,
            "queue_pages_fetched": pages, "without": without, "with": with_dashboard,
            "dashboard": {name: with_dashboard[name] - without[name]
                          for name in ("cpu_per_s", "commands_per_s", "usec_per_s")}}


def describe(result: dict[str, Any]) -> str:
    ref, dash = result["reference"], result["dashboard"]["dashboard"]
    at10k = ref["at_10k"]
    rows = [("Redis CPU (s per s)", "cpu_per_s", 4), ("commands/s", "commands_per_s", 1),
            ("command time (usec per s)", "usec_per_s", 0)]
    lines = [
        "# The dashboard's load on Redis (issue 27)", "",
        f"Reference: one supervisor drained {result['messages']:,} jobs at "
        f"{ref['jobs_per_s']:,.0f} jobs/s; its Redis load scaled to 10,000 jobs/s. Dashboard: "
        f"{result['dashboard']['queues_shown']} queues shown, {SUPERVISORS} supervisors "
        f"running, sampling every 5 s, one queue page open (fetched every 5 s); the "
        f"difference of two {result['window']:g} s windows with and without it.", "",
        "| | supervisor at 10k jobs/s | dashboard | dashboard / supervisor |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, name, digits in rows:
        share = dash[name] / at10k[name] if at10k[name] else float("nan")
        lines.append(f"| {label} | {at10k[name]:,.{digits}f} | {dash[name]:,.{digits}f} | "
                     f"{share:.3%} |")
    lines += ["", "Shared, noisy 2-core machine: the idle supervisors' own commands differ "
              "between the two windows, and INFO cpu counts 10 ms ticks; read the command "
              "figures first.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qs-bench-dashboard-"))
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    try:
        result: dict[str, Any] = {"messages": args.messages, "window": args.window,
                                  "server": redis_side.server_version(client)}
        result["reference"] = reference(server.url, client, work, args.messages)
        client.flushall()
        result["dashboard"] = measure_dashboard(server.url, client, work, args.window)
    finally:
        client.close()
        server.stop()
    print(json.dumps(result, indent=2))
    print(describe(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "README.md").write_text(describe(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
