"""``python -m bench.mixed``: mixed-duration jobs (issue 38): throughput and the short jobs'
queue latency of the supervisor, Dramatiq and a peer that takes a job only when it is free.

    python -m bench.mixed --out bench/results/<date>-2core-issue38-mixed

For each workload (``mixed``: 99% jobs of 1 ms and 1% of 500 ms; ``mixed+hung``: the same
with one job that sleeps an hour), each number of processes (2 and 4) and each peer, on one
private redis-server: a backlog run for throughput, then a paced run for latency. Every peer
runs the same handler (``bench.mixed_jobs``), which records each job's publish, start and
end. Writes results.json and README.md (the table, the targets, the method) to ``--out``.
This is its own command, not a mode of ``python -m bench``: that harness's axes are prefetch
and handler of a no-op throughput run, timed by the broker's counters; here they are
workload, processes and peer, timed by the handler's own records, with a report of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench import machine, mixed_jobs, mixed_peers
from bench.common import (
    NAMESPACE,
    QUEUE,
    Family,
    percentiles,
    start,
    stop,
    wait_for_line,
    wait_until_title,
)
from broker import envelope
from broker.errors import describe

STAGING = f"{mixed_peers.KEYS.ready}.staging"
SETTLE_AFTER_START = 0.5  # seconds: every process up and waiting on the empty queue
POLL = 0.01  # seconds between two reads of the records' sizes (the clock comes from records)
RUN_TIMEOUT = 600.0

METHOD = """\
- Workloads: job n sleeps 1 ms, except one job in every hundred (at a seeded random place
  within its hundred: the same jobs for every peer and run) that sleeps 500 ms; with
  `mixed+hung`, job 10 sleeps an hour. A sleep, as a handler waiting on I/O: the peers
  compare on how they hand jobs to processes, not on how fast they compute.
- One handler for every peer (`bench.mixed_jobs.run`): sleep the job's time, then append
  one record (job number, publish time, start, end; `time.time()`) to its process's file.
  Which jobs ran, when a run ended and how long each job waited come from these records
  alone, the same way for every peer.
- Peers, each with N processes running one job at a time: the supervisor
  (`python -m supervisor`, coroutines N, prefetch {prefetch_per_process} x N, no
  handler_timeout, shutdown_deadline 1 s so a stop does not wait for the hung job);
  Dramatiq (N processes of one worker thread, its Redis broker, default middleware and
  default prefetch of 2 per process, idle back-off 10 ms instead of 1 s); take-when-free
  (N processes, each a redis-py loop: BLMOVE one envelope to a processing list, run it,
  LREM it). The supervisor and take-when-free read the same queue-5 envelopes; Dramatiq
  its own messages with the same payloads.
- Throughput (backlog run): the queue is filled under staging names, the peer started and
  left until idle, then the jobs are made available at once (RENAME); jobs/s = jobs done /
  (the last job's end - the RENAME). Its latency is not reported: in a backlog the last job
  waits for the whole drain, so it would only restate the drain time.
- Short jobs' queue latency (paced run): the peer waits on an empty queue; a publisher
  process sends jobs 0, 1, 2, ... at a fixed rate, {load:g} x the slowest peer's median
  backlog jobs/s for this workload and process count (the same rate for every peer of a
  row), for {seconds:g} s; latency = handler start - publish time, of the 1 ms jobs.
- A run ends when every job but the hung one is done, or when none has finished for
  {give_up:g} s: those left are "not done" (stranded behind the hung job), and are in no
  figure but that count.
- Each figure is the median of {repeat} run(s) (every run is in results.json); the peers' runs
  alternate (run r starts with the next peer in turn), so the machine's drift spreads over
  all of them. Worker, Redis, publisher and harness share the machine's cores.
"""


# -- the peers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    envelopes: str  # "queue5" (the supervisor's list) or "dramatiq"
    launch: Callable[[str, int, Path, argparse.Namespace], subprocess.Popen]
    prefetch: Callable[[int, argparse.Namespace], int]  # jobs a process may hold, in all


def launch_ours(url: str, processes: int, folder: Path, args: argparse.Namespace
                ) -> subprocess.Popen:
    config = folder / "bench.toml"
    config.write_text(
        f'[broker]\nurl = "{url}"\nnamespace = "{NAMESPACE}"\n'
        f'[job]\nqueue = "{QUEUE}"\nhandler = "bench.mixed_jobs:handle"\n'
        f"coroutines = {processes}\nprefetch = {processes * args.prefetch_per_process}\n"
        f'[supervisor]\nlog_level = "warning"\nshutdown_deadline = 1\n'
    )
    child = start(["-m", "supervisor", str(config)], BENCH_LATENCY_DIR=str(folder))
    try:
        wait_until_title(child.pid, "running", timeout=60)
    except BaseException:
        stop(child)
        raise
    return child


def launcher(name: str) -> Callable[[str, int, Path, argparse.Namespace], subprocess.Popen]:
    def launch(url: str, processes: int, folder: Path, args: argparse.Namespace
               ) -> subprocess.Popen:
        child = start(["-m", "bench.mixed_peers", name, url, "--processes", str(processes)],
                      capture=True, BENCH_LATENCY_DIR=str(folder))
        try:
            wait_for_line(child, "ready", timeout=60)
        except BaseException:
            stop(child)
            raise
        return child

    return launch


PEERS = {
    "ours": Peer("ours", "queue5", launch_ours,
                 lambda processes, args: processes * args.prefetch_per_process),
    "dramatiq": Peer("dramatiq", "dramatiq", launcher("dramatiq"),
                     lambda processes, args: 2 * processes),
    "take-when-free": Peer("take-when-free", "queue5", launcher("take-when-free"),
                           lambda processes, args: processes),
}
LABELS = {"ours": "queue-supervisor", "dramatiq": "Dramatiq",
          "take-when-free": "take-when-free (BLMOVE loop)"}


@contextlib.contextmanager
def running(peer: Peer, url: str, processes: int, folder: Path, args: argparse.Namespace
            ) -> Iterator[subprocess.Popen]:
    """The peer started, idle on its queue; stopped (and its processes gone) on the way out."""
    child = peer.launch(url, processes, folder, args)
    try:
        time.sleep(SETTLE_AFTER_START)
        yield child
    finally:
        stop(child)


def fill(url: str, client: redis.Redis, peer: Peer, messages: int, workload: str
         ) -> list[tuple[str, str]]:
    """Store the backlog under staging names; the RENAMEs that make it available."""
    if peer.envelopes == "dramatiq":
        return mixed_peers.fill_dramatiq(url, messages, workload)
    for first in range(0, messages, 1000):
        client.lpush(STAGING, *(envelope.build(QUEUE, mixed_jobs.payload(n, workload))[1]
                                for n in range(first, min(messages, first + 1000))))
    return [(STAGING, mixed_peers.KEYS.ready)]


# -- one run -----------------------------------------------------------------------------------


def wait_for_jobs(folder: Path, expected: int, child: subprocess.Popen, give_up: float) -> None:
    """Until ``expected`` jobs have finished, or none has for ``give_up`` seconds."""
    began = last_change = time.monotonic()
    last = -1
    while True:
        count = mixed_jobs.finished(str(folder))
        if count >= expected:
            return
        now = time.monotonic()
        if count != last:
            last, last_change = count, now
        elif now - last_change > give_up:
            return
        if child.poll() is not None:
            raise RuntimeError(f"the worker exited with {child.returncode} mid-run")
        if now - began > RUN_TIMEOUT:
            raise RuntimeError(f"run not finished after {RUN_TIMEOUT:.0f}s")
        time.sleep(POLL)


def outcome(folder: Path, workload: str, published: int) -> dict[str, Any]:
    """What the records say: jobs done (each counted once), run twice, not done; the end."""
    records = mixed_jobs.read(str(folder))
    first: dict[int, mixed_jobs.Record] = {}
    for record in records:
        first.setdefault(record.n, record)
    expected = published - mixed_jobs.hung(workload, published)
    return {"published": published, "done": len(first), "not_done": expected - len(first),
            "ran_twice": len(records) - len(first),
            "last_end": max((r.ended for r in records), default=None),
            "records": list(first.values())}


def backlog_run(url: str, peer: Peer, processes: int, workload: str,
                args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    renames = fill(url, client, peer, args.messages, workload)
    expected = args.messages - mixed_jobs.hung(workload, args.messages)
    with tempfile.TemporaryDirectory(prefix="bench-mixed-") as workdir:
        folder = Path(workdir)
        with running(peer, url, processes, folder, args) as child:
            family = Family(child.pid)
            cpu_before = family.cpu()
            began = time.time()
            pipe = client.pipeline(transaction=True)
            for source, destination in renames:
                pipe.rename(source, destination)
            pipe.execute()
            wait_for_jobs(folder, expected, child, args.give_up)
            cpu = family.cpu() - cpu_before
        result = outcome(folder, workload, args.messages)
    result.pop("records")
    seconds = (result.pop("last_end") or began) - began
    return {**result, "seconds": round(seconds, 3),
            "jobs_per_s": result["done"] / seconds if seconds > 0 else None,
            "client_us_per_job": cpu / result["done"] * 1e6 if result["done"] else None,
            "load_after": machine.load()[0]}


def latency_run(url: str, peer: Peer, processes: int, workload: str, rate: float,
                args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    messages = max(1, round(rate * args.latency_seconds))
    expected = messages - mixed_jobs.hung(workload, messages)
    with tempfile.TemporaryDirectory(prefix="bench-mixed-") as workdir:
        folder = Path(workdir)
        with running(peer, url, processes, folder, args) as child:
            publisher = start(["-m", "bench.mixed_publisher", url, "--envelopes", peer.envelopes,
                               "--workload", workload, "--rate", f"{rate:.3f}",
                               "--messages", str(messages)], capture=True)
            try:
                said = publisher.communicate(timeout=RUN_TIMEOUT)[0].split()
                if publisher.returncode:
                    raise RuntimeError(f"the publisher exited with {publisher.returncode}")
                wait_for_jobs(folder, expected, child, args.give_up)
            finally:
                stop(publisher)
        result = outcome(folder, workload, messages)
    records = result.pop("records")
    result.pop("last_end")
    waited = {ms: [r.waited for r in records if mixed_jobs.duration_ms(r.n, workload) == ms]
              for ms in (mixed_jobs.SHORT_MS, mixed_jobs.SLOW_MS)}
    return {**result, "rate": round(rate, 1),
            "achieved_rate": float(said[-1].removesuffix("/s")) if said else None,
            "short": percentiles(waited[mixed_jobs.SHORT_MS]),
            "slow": percentiles(waited[mixed_jobs.SLOW_MS]),
            "load_after": machine.load()[0]}


def attempt(label: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One run; a failure is recorded with its reason, not fatal."""
    print(f"  {label} ...", end=" ", flush=True, file=sys.stderr)
    try:
        result = call()
    except Exception as error:
        traceback.print_exc()
        return {"error": describe(error)}
    if "short" in result:
        short = result["short"]
        said = (f"p50 {short['p50_ms']:.1f} / p99 {short['p99_ms']:.1f} / max "
                f"{short['max_ms']:.1f} ms" if short["samples"] else "no short job done")
    else:
        said = f"{result['jobs_per_s'] or 0:,.1f} jobs/s"
    print(f"{said}, not done {result['not_done']}", file=sys.stderr, flush=True)
    return result


# -- a row: one workload, one process count, every peer ------------------------------------------


def in_turn(names: list[str], round_: int) -> list[str]:
    """The peers in the order of run ``round_``: each round starts with the next one."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def median(runs: list[dict[str, Any]], pick: Callable[[dict[str, Any]], Any]) -> Any:
    values = [value for value in (pick(run) for run in runs if "error" not in run)
              if value is not None]
    return statistics.median(values) if values else None


def measure_row(url: str, workload: str, processes: int, names: list[str],
                args: argparse.Namespace) -> dict[str, Any]:
    backlog: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.repeat):
        for name in in_turn(names, round_):
            backlog[name].append(attempt(
                f"{workload} x{processes} {name} backlog {round_ + 1}/{args.repeat}",
                functools.partial(backlog_run, url, PEERS[name], processes, workload, args)))
    capacities = [median(backlog[name], lambda run: run["jobs_per_s"]) for name in names]
    known = [capacity for capacity in capacities if capacity]
    rate = args.latency_load * min(known) if known and args.latency_load > 0 else None
    latency: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.repeat if rate else 0):
        for name in in_turn(names, round_):
            latency[name].append(attempt(
                f"{workload} x{processes} {name} at {rate:,.0f}/s {round_ + 1}/{args.repeat}",
                functools.partial(latency_run, url, PEERS[name], processes, workload,
                                  rate or 0.0, args)))
    return {"workload": workload, "processes": processes, "rate": rate,
            "peers": {name: summary(name, processes, backlog[name], latency[name], args)
                      for name in names}}


def summary(name: str, processes: int, backlog: list[dict[str, Any]],
            latency: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "system": LABELS[name], "prefetch": PEERS[name].prefetch(processes, args),
        "jobs_per_s": median(backlog, lambda run: run["jobs_per_s"]),
        "client_us_per_job": median(backlog, lambda run: run["client_us_per_job"]),
        "not_done_backlog": median(backlog, lambda run: run["not_done"]),
        "p50_ms": median(latency, lambda run: run["short"]["p50_ms"]),
        "p99_ms": median(latency, lambda run: run["short"]["p99_ms"]),
        "max_ms": median(latency, lambda run: run["short"]["max_ms"]),
        "not_done_latency": median(latency, lambda run: run["not_done"]),
        "backlog_runs": backlog, "latency_runs": latency,
    }


# -- the report --------------------------------------------------------------------------------


def _num(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _runs(runs: list[dict[str, Any]], pick: Callable[[dict[str, Any]], Any], digits: int
          ) -> str:
    return ", ".join("failed" if "error" in run else _num(pick(run), digits) for run in runs)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | processes | peer (prefetch in all) | jobs/s (runs) "
             "| short jobs' queue latency ms: p50 / p99 / max | p99 runs | latency rate /s "
             "| not done (backlog / paced) |",
             "|---|---:|---|---|---|---|---:|---|"]
    for row in rows:
        for peer in row["peers"].values():
            lines.append(
                f"| {row['workload']} | {row['processes']} | {peer['system']} "
                f"({peer['prefetch']}) | {_num(peer['jobs_per_s'], 1)} "
                f"({_runs(peer['backlog_runs'], lambda r: r['jobs_per_s'], 1)}) "
                f"| {_num(peer['p50_ms'], 1)} / {_num(peer['p99_ms'], 1)} / "
                f"{_num(peer['max_ms'], 1)} "
                f"| {_runs(peer['latency_runs'], lambda r: r['short']['p99_ms'], 1)} "
                f"| {_num(row['rate'], 1)} | {_num(peer['not_done_backlog'])} / "
                f"{_num(peer['not_done_latency'])} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 38: our short jobs' p99 within 2x of the take-when-free peer's, per row."""
    lines = []
    for row in rows:
        ours, free = row["peers"].get("ours"), row["peers"].get("take-when-free")
        if not ours or not free:
            continue
        what = f"{row['workload']}, {row['processes']} processes"
        if not ours["p99_ms"] or not free["p99_ms"]:
            lines.append(f"- {what}: no p99 to compare")
            continue
        ratio = ours["p99_ms"] / free["p99_ms"]
        lines.append(f"- {what}: our p99 {ours['p99_ms']:.1f} ms, take-when-free "
                     f"{free['p99_ms']:.1f} ms: {ratio:.2f}x "
                     f"({'met' if ratio <= 2 else 'NOT met'}: within 2x)")
    return lines


def markdown(results: dict[str, Any]) -> str:
    about = results["machine"]
    return "\n".join([
        f"# Mixed-duration jobs: {results['name']}",
        "",
        f"`{results['command']}`",
        "",
        f"Machine: {about['cpu']}, {about['cores_logical']} logical cores, {about['python']}, "
        f"{about['servers'].get('redis', 'redis')}; load average at the start "
        f"{about['load_at_start']}, at the end {results['load_at_end']}; busy processes at "
        f"the start: {', '.join(results['busy_at_start']) or 'none'}. "
        f"{results['minutes']} minutes.",
        "",
        results["settings"],
        "",
        table(results["rows"]),
        "",
        "Targets:",
        "",
        *(targets(results["rows"]) or ["- (no row has both the supervisor and take-when-free)"]),
        "",
        "## How it is measured",
        "",
        results["method"],
    ])


# -- the command -------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.mixed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(mixed_jobs.WORKLOADS),
                        help="comma-separated: mixed, mixed+hung (default both)")
    parser.add_argument("--processes", default="2,4", help="comma-separated (default 2,4)")
    parser.add_argument("--peers", default="ours,dramatiq,take-when-free",
                        help="comma-separated: ours, dramatiq, take-when-free (default all)")
    parser.add_argument("--messages", type=int, default=4000, help="jobs per backlog run")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per peer and configuration; figures are their medians")
    parser.add_argument("--latency-load", type=float, default=0.5,
                        help="publish rate of the paced runs, as a share of the slowest "
                             "peer's backlog jobs/s in the same row (0: no paced runs)")
    parser.add_argument("--latency-seconds", type=float, default=20.0)
    parser.add_argument("--prefetch-per-process", type=int, default=10,
                        help="the supervisor's prefetch is this times its processes")
    parser.add_argument("--give-up", type=float, default=5.0,
                        help="seconds without a finished job after which a run ends and the "
                             "jobs left count as not done")
    parser.add_argument("--out", type=Path, help="results folder, e.g. bench/results/<name>")
    args = parser.parse_args(argv)
    for name, allowed in (("workloads", mixed_jobs.WORKLOADS), ("peers", PEERS)):
        unknown = set(words(getattr(args, name))) - set(allowed)
        if unknown:
            parser.error(f"unknown {name} {sorted(unknown)}; use {', '.join(allowed)}")
    args.repeat = max(1, args.repeat)
    return args


def words(text: str) -> list[str]:
    return [word.strip() for word in text.split(",") if word.strip()]


def stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends a run as Ctrl-C does: every ``finally`` runs, so no worker, publisher or
    server it started is left behind."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    names = words(args.peers)
    busy, load_at_start = machine.busy_processes(), machine.load()
    started = time.time()
    rows: list[dict[str, Any]] = []
    from support.servers import RedisServer

    server = RedisServer().start()
    try:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        print(f"Redis {version} at {server.url}", file=sys.stderr)
        for workload in words(args.workloads):
            for processes in (int(n) for n in words(args.processes)):
                rows.append(measure_row(server.url, workload, processes, names, args))
    finally:
        server.close()
    results = {
        "name": args.out.name if args.out else "bench.mixed",
        "command": "python -m bench.mixed " + shlex.join(argv),
        "settings": (f"{args.messages:,} jobs per backlog run; paced runs at "
                     f"{args.latency_load:g} x the slowest peer's jobs/s for "
                     f"{args.latency_seconds:g} s; median of {args.repeat} run(s); the "
                     f"supervisor's prefetch {args.prefetch_per_process} per process; a run "
                     f"gives up {args.give_up:g} s after its last finished job."),
        "method": METHOD.format(prefetch_per_process=args.prefetch_per_process,
                                load=args.latency_load, seconds=args.latency_seconds,
                                give_up=args.give_up, repeat=args.repeat),
        "machine": machine.describe({"redis": f"redis {version}"}, load_at_start),
        "busy_at_start": busy, "load_at_end": machine.load(),
        "minutes": round((time.time() - started) / 60, 1), "rows": rows,
    }
    text = markdown(results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "README.md").write_text(text + "\n")
        print(f"wrote {args.out}/results.json and README.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
