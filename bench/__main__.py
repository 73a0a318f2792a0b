"""``python -m bench``: reproducible throughput, CPU, traffic and latency figures.

    python -m bench --broker both --prefetch 1,8,32,100 --messages 20000 --peers \\
        --large-history --out bench/results/<name>

Starts private redis-server / nats-server processes on free loopback ports (or uses the
``--url`` given), fills the queue with PHP-compatible stats-usage envelopes, and runs
``python -m supervisor`` (one handler process) for every prefetch with the no-op and the
stats-usage handler (on the embedded ClickHouse engine; ``stats-usage-sqlite``: on SQLite);
then the queue latency at a fixed publish rate, and with ``--peers`` Dramatiq and raw
redis-py / nats-py loops on the same servers. Writes results.json,
README.md (tables, ratios, targets) and chart.png to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import machine, nats_side, redis_side, report, runs
from bench.common import ROOT
from broker.errors import describe

METHOD = """\
- Each configuration: the queue is filled first (Redis: LPUSH into a staging key; NATS:
  publish with a paused durable consumer), `python -m supervisor` (coroutines 1) is started
  and left until idle; then the messages become available at once (Redis: RENAME staging
  -> ready; NATS: resume the consumer and publish one more message that wakes the held
  pulls) and the clock runs until the last one is acknowledged (Redis: the success
  counter; NATS: the work-queue stream is empty). Start-up is never measured.
- Client CPU: the supervisor plus the fork server and handler processes (psutil, user +
  system). Server CPU: Redis `INFO cpu`; nats-server's process CPU. Both per job. CPU is
  read in 10 ms clock ticks: use 20,000 messages or more for the per-job figures.
- Messages per reserve / pull request, and per settle call: Redis, messages / claim.lua
  and settle.lua calls (INFO commandstats counts the commands scripts run: MSET runs only
  in claim.lua, DECRBY only in settle.lua among the scripts a clean run calls); these match
  the supervisor's own counters exactly (checked with --supervisor-metrics). NATS, jobs /
  pull requests, taken as the messages the clients sent less one ack per job (renewals
  would count as pulls; a run this short has none). One receive() on NATS is a blocking
  pull plus no-wait top-ups: --supervisor-metrics adds the supervisor's own messages per
  receive() and per settle call (its Prometheus counters; this costs a little CPU).
- Requests: Redis, calls of commands that no Lua script of the run uses (a client sent
  them), less the harness's own polls; NATS, messages the clients sent (/varz in_msgs).
  Bytes: the server's network bytes in and out (Redis INFO stats: everything on the wire;
  NATS /varz: message payloads only, without subjects and protocol lines).
- Peak RSS: VmHWM of the supervisor, and the sum over its children (fork server and
  handler processes), read just before the stop.
- Queue latency: not from a pre-filled queue (there the last message waits for the whole
  backlog, so the figure would only restate the drain time). A publisher process sends at a
  fixed rate (a share of the configuration's measured throughput, given below) to the
  running supervisor; each payload carries its float publish time and a bench handler
  (the no-op plus one 8-byte write per message) records handler start - publish time.
- Peers run on the same servers with the same payloads: Dramatiq (one worker process,
  one thread, its Redis broker and default middleware, a no-op actor, filled with its own
  enqueue under a staging namespace and RENAMEd into place); the Redis raw ceiling (a plain
  redis-py loop: one Lua call moves up to 100 payloads to a processing list, one removes
  them, nothing decoded); the NATS raw ceiling (a plain nats-py loop: fetch 100 from the
  same durable consumer, ack_sync each, one batch's acks overlapped).
- Large history: 100,000 legacy pids (job record, no owner, published now) in the
  processing list and 100,000 keys of other queues in the namespace, before the run; SLOWLOG
  keeps every call above 5 ms (a script and, separately, the commands it ran inside).
  maintain() is called directly, with nothing else running, on an empty queue and over
  10,000 and 100,000 such entries: server CPU per call (INFO cpu) and the longest script
  (SLOWLOG at 0 us).
- Grouped vs per-message settlement: this process drives RedisBroker reserve/claim (batches
  of up to 100, no handler) and commits either with settle.lua (one call per batch) or with
  bench/lua/commit_one.lua (the same owner check and writes for one message), one EVALSHA
  per message, a batch's worth in one pipeline.
- Dramatiq at prefetch 1 backs off (sleeps, up to its worker_timeout, here 10 ms instead of
  its default 1 s) whenever its one prefetched message is still in progress: that is its
  own behaviour, not the harness's.
- Caveats: a single handler process (coroutines 1); worker, server and harness share the
  machine's cores; the harness polls every 2 ms (Redis GET) or 10 ms (NATS monitor HTTP).
"""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--broker", choices=("redis", "nats", "both"), default="redis")
    parser.add_argument("--prefetch", default="1,8,32,100",
                        help="comma-separated prefetch values (default 1,8,32,100)")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--dramatiq-messages", type=int,
                        help="messages per Dramatiq run (default: --messages): at prefetch 1 it "
                             "takes about 7 ms a message, while the raw loops need many "
                             "messages for CPU figures read in 10 ms ticks")
    parser.add_argument("--peer-prefetch", default="100,1",
                        help="comma-separated prefetch values of the Dramatiq runs with "
                             "--peers (default 100,1; prefetch 1 takes minutes)")
    parser.add_argument("--coroutines", default="1",
                        help="comma-separated handler process counts (default 1); a prefetch "
                             "below the count is skipped")
    parser.add_argument("--baseline", type=Path,
                        help="results.json of an earlier run on this machine (an older "
                             "commit, run just before): the report compares against it")
    parser.add_argument("--handlers", default="noop,stats-usage",
                        help="comma-separated: noop, stats-usage (on the embedded ClickHouse "
                             "engine), stats-usage-sqlite, sleep-1ms (default noop,stats-usage)")
    parser.add_argument("--url", action="append", default=[],
                        help="use this server instead of a private one (redis://, nats://); "
                             "may be given once per broker")
    parser.add_argument("--allow-flush", action="store_true",
                        help="allow emptying a --url Redis database that holds keys")
    parser.add_argument("--nats-monitor", help="monitor URL (http://host:8222) of a --url "
                        "NATS server, for its message and byte counts")
    parser.add_argument("--peers", action="store_true",
                        help="also run Dramatiq and the raw redis-py / nats-py loops")
    parser.add_argument("--large-history", action="store_true",
                        help="also run the no-op with 100,000 stale pids and 100,000 other keys")
    parser.add_argument("--latency-load", type=float, default=0.5,
                        help="publish rate of the latency runs, as a share of the "
                             "configuration's measured jobs/s (default 0.5; 0 = no latency)")
    parser.add_argument("--latency-seconds", type=float, default=3.0)
    parser.add_argument("--supervisor-metrics", action="store_true",
                        help="serve the supervisor's Prometheus metrics during the runs and "
                             "report its own receive/settle batch sizes (costs a little CPU)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per configuration; the one with the median jobs/s is kept")
    parser.add_argument("--redis-aof", choices=("no", "everysec", "always"), default="no",
                        help="appendonly/appendfsync of the private redis-server (default no)")
    parser.add_argument("--out", type=Path, help="results folder, e.g. bench/results/<name>")
    return parser.parse_args(argv)


def redis_target(args: argparse.Namespace, cleanup: list) -> runs.RedisTarget:
    url = next((u for u in args.url if u.startswith(("redis://", "rediss://", "unix://"))), None)
    if url:
        target = runs.RedisTarget(url)
        if target.client.dbsize() and not args.allow_flush:
            raise SystemExit(f"error: the database of {url} is not empty and every run "
                             "empties it (FLUSHDB): use an empty one, or --allow-flush")
        return target
    from support.servers import RedisServer

    extra = [] if args.redis_aof == "no" else ["--appendonly", "yes",
                                                "--appendfsync", args.redis_aof]
    server = RedisServer(extra=extra).start()
    cleanup.append(server.close)
    assert server.process is not None
    return runs.RedisTarget(server.url, server_pid=server.process.pid)


def nats_target(args: argparse.Namespace, cleanup: list) -> runs.NatsTargetRun:
    url = next((u for u in args.url if u.startswith(("nats://", "tls://"))), None)
    if url:
        target = nats_side.NatsTarget(url, args.nats_monitor)
    else:
        from support.servers import NatsServer

        server = NatsServer().start()
        cleanup.append(server.close)
        assert server.process is not None
        target = nats_side.NatsTarget(server.url, f"http://127.0.0.1:{server.monitor_port}",
                                      server.process.pid)
    run = runs.NatsTargetRun(target)
    cleanup.insert(0, run.control.close)
    return run


REPEAT = 1  # set from --repeat


def attempt(rows: list[dict[str, Any]], what: dict[str, Any], call) -> dict[str, Any] | None:
    """Run one configuration (``REPEAT`` times, keeping the run of median jobs/s); a failure
    is recorded as a row with the reason, not fatal."""
    label = " ".join(f"{k}={v}" for k, v in what.items())
    print(f"  {label} ...", end=" ", flush=True, file=sys.stderr)
    try:
        tries = sorted((call() for _ in range(REPEAT)), key=lambda row: row["jobs_per_s"])
    except Exception as error:
        traceback.print_exc()
        rows.append({**what, "error": describe(error)})
        return None
    row = tries[len(tries) // 2]
    row["load_after"] = machine.load()[0]  # 1-minute load average once this configuration ran
    if len(tries) > 1:
        row["repeats_jobs_per_s"] = [t["jobs_per_s"] for t in tries]
    rows.append(row)
    print(f"{row['jobs_per_s']:,.0f} jobs/s, client {row.get('client_us_per_job') or 0:.1f} "
          f"µs/job, server {row.get('server_us_per_job') or 0:.1f} µs/job",
          file=sys.stderr, flush=True)
    return row


def with_latency(args, target, row: dict[str, Any] | None, prefetch: int, handler: str,
                 coroutines: int = 1) -> None:
    if row is None or args.latency_load <= 0 or handler not in runs.LATENCY_HANDLERS:
        return
    rate = max(100.0, row["jobs_per_s"] * args.latency_load)
    try:
        row["latency"] = runs.latency_run(target, prefetch, handler, rate,
                                          int(rate * args.latency_seconds), coroutines)
    except Exception as error:
        traceback.print_exc()
        row["latency"] = {"error": str(error)}
        return
    lat = row["latency"]
    print(f"    latency at {rate:,.0f}/s: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, "
          f"max {lat['max_ms']:.1f} ms", file=sys.stderr, flush=True)


def configurations(args, prefetches: list[int], handlers: list[str]):
    """(coroutines, handler, prefetch) to run: a prefetch must cover every process."""
    for coroutines in sorted(set(numbers(args.coroutines))):
        for handler in handlers:
            for prefetch in prefetches:
                if prefetch >= coroutines:
                    yield coroutines, handler, prefetch


def run_ours(args, target, measure, prefetches: list[int], handlers: list[str],
             rows: list[dict[str, Any]]) -> None:
    """Every configuration of ours on one broker (``measure``: runs.supervisor_redis/nats)."""
    for coroutines, handler, prefetch in configurations(args, prefetches, handlers):
        row = attempt(rows, {"system": "queue-supervisor", "broker": target.broker,
                             "handler": handler, "prefetch": prefetch, "coroutines": coroutines},
                      lambda p=prefetch, h=handler, c=coroutines: measure(
                          target, p, args.messages, h, coroutines=c))
        with_latency(args, target, row, prefetch, handler, coroutines)


def run_redis(args, target: runs.RedisTarget, prefetches: list[int], handlers: list[str],
              rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    run_ours(args, target, runs.supervisor_redis, prefetches, handlers, rows)
    if args.large_history:
        from bench import large_history

        for prefetch in prefetches:
            attempt(rows, {"system": "queue-supervisor", "broker": "redis", "handler": "noop",
                           "prefetch": prefetch, "history": True},
                    lambda p=prefetch: runs.supervisor_redis(target, p, args.messages, "noop",
                                                             history=True))
        print("  maintain() calls ...", file=sys.stderr, flush=True)
        results["maintenance"] = large_history.maintenance_comparison(target.client, target.url)
    from bench import settle_compare

    print("  grouped vs per-message settlement ...", file=sys.stderr, flush=True)
    results["settlement"] = settle_compare.compare(target.client, target.url, args.messages)
    if args.peers:
        run_redis_peers(args, target, rows)


def run_redis_peers(args, target: runs.RedisTarget, rows: list[dict[str, Any]]) -> None:
    from bench import peer_dramatiq, peer_redis_raw

    messages = args.dramatiq_messages or args.messages
    raw_messages = args.messages
    for prefetch in numbers(args.peer_prefetch):
        def dramatiq_run(prefetch: int = prefetch) -> dict[str, Any]:
            row = runs.peer_redis(
                target, "dramatiq", "bench.peer_dramatiq", messages, [],
                fill=lambda: peer_dramatiq.fill(target.url, messages),
                done=lambda probe: probe.hlen(f"dramatiq:{peer_dramatiq.QUEUE_NAME}.msgs") == 0,
                env={"dramatiq_queue_prefetch": str(prefetch)},
            )
            row["prefetch"] = prefetch
            return row

        attempt(rows, {"system": "dramatiq", "broker": "redis", "handler": "noop",
                       "prefetch": prefetch}, dramatiq_run)

    def raw_run() -> dict[str, Any]:
        def fill() -> list[tuple[str, str]]:
            redis_side.fill(target.client, runs.STAGING, raw_messages)
            return [(runs.STAGING, runs.KEYS.ready)]

        row = runs.peer_redis(
            target, "raw redis-py + Lua", "bench.peer_redis_raw", raw_messages, ["--batch", "100"],
            fill=fill,
            done=lambda probe: probe.llen_sum(runs.KEYS.ready, peer_redis_raw.PROCESSING) == 0,
        )
        row["prefetch"] = 100
        return row

    attempt(rows, {"system": "raw redis-py + Lua", "broker": "redis", "handler": "noop",
                   "prefetch": 100}, raw_run)


def run_nats(args, run: runs.NatsTargetRun, prefetches: list[int], handlers: list[str],
             rows: list[dict[str, Any]]) -> None:
    run_ours(args, run, runs.supervisor_nats, prefetches, handlers, rows)
    if args.peers:
        def raw_run() -> dict[str, Any]:
            row = runs.peer_nats(run, "raw nats-py", "bench.peer_nats_raw", args.messages,
                                 ["--batch", "100"])
            row["prefetch"] = 100
            return row

        attempt(rows, {"system": "raw nats-py", "broker": "nats", "handler": "noop",
                       "prefetch": 100}, raw_run)


def numbers(text: str) -> list[int]:
    """The whole numbers of a comma-separated option (``--prefetch 1,8,32,100``)."""
    return [int(item) for item in text.split(",") if item.strip()]


def stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (kill, timeout, systemd) ends a run as Ctrl-C does: every ``finally`` runs,
    so no supervisor, handler process or server it started is left behind."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    global REPEAT
    REPEAT = max(1, args.repeat)
    runs.METRICS = args.supervisor_metrics
    sys.path.insert(0, str(ROOT))
    prefetches = numbers(args.prefetch)
    handlers = [h.strip() for h in args.handlers.split(",") if h.strip()]
    unknown = set(handlers) - set(runs.HANDLERS)
    if unknown:
        print(f"error: unknown handler(s) {sorted(unknown)}; use {', '.join(runs.HANDLERS)}",
              file=sys.stderr)
        return 2
    brokers = ["redis", "nats"] if args.broker == "both" else [args.broker]
    busy, load_at_start = machine.busy_processes(), machine.load()
    cleanup: list = []
    rows: list[dict[str, Any]] = []
    servers: dict[str, str] = {}
    results: dict[str, Any] = {
        "name": args.out.name if args.out else "bench",
        "command": "python -m bench " + shlex.join(argv),
        "prefetch": prefetches, "messages": args.messages, "runs": rows,
        "busy_at_start": busy, "method": METHOD,
        "settings": (f"{args.messages:,} messages per configuration"
                     + (f" ({args.dramatiq_messages:,} per Dramatiq run)"
                        if args.dramatiq_messages else "")
                     + f", median of {REPEAT} "
                     f"run(s); coroutines {args.coroutines} (handler processes); "
                     f"Redis appendonly {args.redis_aof}; NATS JetStream file storage "
                     f"(work-queue stream, explicit ack); latency publish rate = "
                     f"{args.latency_load:g} x the configuration's jobs/s for "
                     f"{args.latency_seconds:g} s."),
    }
    started = time.time()
    try:
        if "redis" in brokers:
            target = redis_target(args, cleanup)
            servers["redis"] = redis_side.server_version(target.client)
            print(f"Redis ({servers['redis']}) at {target.url}", file=sys.stderr)
            run_redis(args, target, prefetches, handlers, rows, results)
        if "nats" in brokers:
            run = nats_target(args, cleanup)
            servers["nats"] = nats_side.server_version(run.target)
            print(f"NATS ({servers['nats']}) at {run.url}", file=sys.stderr)
            run_nats(args, run, prefetches, handlers, rows)
    finally:
        for close in cleanup:
            try:
                close()
            except Exception:
                traceback.print_exc()
    results["machine"] = machine.describe(servers, load_at_start)
    results["load_at_end"] = machine.load()
    results["minutes"] = round((time.time() - started) / 60, 1)
    if args.baseline:
        results["baseline"] = json.loads(args.baseline.read_text())
        results["baseline"]["path"] = str(args.baseline)
    print(report.table(rows))
    for line in report.ratios(results):
        print(line)
    for name, value, verdict in report.targets(results):
        print(f"- {name}: {value} ({verdict})")
    if args.out:
        for path in report.write(results, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
