"""``python -m bench.chaos``: the chaos soak from the command line (see ``bench.chaos.run``)."""

from __future__ import annotations

import argparse
import sys

from bench.chaos.run import HANDLER, Settings, run_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description="Publish stats-usage messages, run real supervisors, inject faults at "
        "seeded moments, and check that nothing is lost and the usage totals are exact.",
    )
    parser.add_argument("--broker", choices=("redis", "nats", "both", "redis-cluster"),
                        default="redis",
                        help="redis-cluster: three masters with a replica each, and the "
                        "failover fault (not part of both)")
    parser.add_argument("--messages", type=int, default=5000, help="messages per broker")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="publishing and fault window per broker (s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--supervisors", type=int, default=2)
    parser.add_argument("--async-tasks", type=int, default=0, metavar="N",
                        help="run the async stats-usage handler (aiosqlite), N deliveries at "
                        "once per handler process (prefetch rises to cover them); default: "
                        "the plain one")
    parser.add_argument("--coroutines", type=int, default=2,
                        help="handler processes per supervisor (default 2)")
    parser.add_argument("--prefetch", type=int, default=50, help="per supervisor")
    parser.add_argument("--work-ms", type=float, default=5.0,
                        help="milliseconds every handler call sleeps (default 5)")
    parser.add_argument("--gap", default="4,8",
                        help="least and most seconds between two faults (default 4,8)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="longest wait for recovery after the fault window (s)")
    parser.add_argument("--keep", action="store_true",
                        help="keep logs, ledger and database even when the run passes")
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"),
                        help="the supervisors' log level (logs are kept with --keep)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--store", choices=("clickhouse", "sqlite"), default=None,
                        help="the stats-usage store: the embedded ClickHouse engine (default) "
                        "or SQLite (the only store of the async handler, and its default)")
    parser.add_argument("--handler", default=HANDLER,
                        help="the job's handler (default the stats-usage handler with the "
                        "soak's ledger; the test suite passes an unsafe variant)")
    parser.add_argument("--faults", default="",
                        help="comma-separated fault kinds to inject (default: every kind)")
    parser.add_argument("--nats-cluster", action="store_true",
                        help="NATS: three servers in a JetStream cluster, the work stream on "
                        "3 replicas; the broker fault is then 'failover' (the stream leader, "
                        "or another server, killed and started again) instead of "
                        "'broker_restart'")
    parser.add_argument("--sabotage", action="store_true",
                        help="self-test of the checks: one message is never published and "
                        "one total is corrupted, so the run must fail naming both")
    args = parser.parse_args(argv)
    faults = tuple(kind for kind in args.faults.split(",") if kind)
    unknown = set(faults) - set(fault_kinds())
    if unknown:
        parser.error(f"unknown fault kind(s) {sorted(unknown)}; known: "
                     f"{', '.join(fault_kinds())}")
    if args.async_tasks and args.store == "clickhouse":
        parser.error("--async-tasks runs the async handler, which writes to SQLite only")
    store = args.store or ("sqlite" if args.async_tasks else "clickhouse")
    low, _, high = args.gap.partition(",")
    settings = Settings(
        broker=args.broker, messages=args.messages, seconds=args.seconds, seed=args.seed,
        supervisors=args.supervisors, coroutines=args.coroutines,
        gap=(float(low), float(high or low)),
        tasks_per_process=args.async_tasks,
        prefetch=args.prefetch, work_ms=args.work_ms,
        drain_timeout=args.drain_timeout, keep=args.keep, quiet=args.quiet,
        sabotage=args.sabotage, log_level=args.log_level, store=store,
        handler=args.handler, faults=faults, nats_cluster=args.nats_cluster,
    )
    brokers = ["redis", "nats"] if args.broker == "both" else [args.broker]
    return run_all(brokers, settings)


def fault_kinds() -> list[str]:
    from bench.chaos.cluster_side import RedisClusterSide
    from bench.chaos.nats_side import NatsSide
    from bench.chaos.run import PROCESS_FAULTS, STORE_FAULTS
    from bench.chaos.sides import RedisSide

    kinds = [*PROCESS_FAULTS, *(k for ks in STORE_FAULTS.values() for k in ks)]
    return list(dict.fromkeys([*kinds, *RedisSide.faults, *NatsSide.known_faults,
                               *RedisClusterSide.faults]))


if __name__ == "__main__":
    sys.exit(main())
