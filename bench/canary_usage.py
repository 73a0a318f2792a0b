"""The stats-usage canary table: throughput that also shows it counted right.

    python -m bench.canary_usage --out bench/results/<name> [--baseline-root DIR]

One run, in this order: the stats-usage handler on the embedded ClickHouse engine at
prefetch 1, 8, 32, 100, 1,000 x coroutines 1, 2, 4 (and the no-op at 1,000 for the ratio),
each configuration with wall time, client/server CPU, batch fill, requests, bytes, memory,
redeliveries, queue latency, the machine's load average and its usage totals checked exact
(``python -m bench``, median of ``--repeat``); then the chaos soak on the same machine with
1, 2 and 4 handler processes while handler processes and the writer are SIGKILLed (``python
-m bench.chaos``: nothing lost, totals exact). Throughput alone cannot establish correctness:
a run whose totals are wrong, or a soak that fails, fails the whole table.

Each prefetch gets its own message count (``--messages``), sized so that a run lasts 5 s or
more on a quiet 2-core machine: a shorter run is marked in the table, since its rate is
mostly the noise of the machine (a run of 1 s on a loaded machine says little). The whole
table takes 11-15 minutes on 2 cores (``--scale 0.2`` for a quick look; ``--messages
1000:200000 --no-soaks`` for the prefetch 1,000 rows and the no-op alone).

With ``--baseline-root`` (a checkout of an older commit) the prefetch 100 and 1,000
configurations run there first, back to back, for same-run ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT

COROUTINES = "1,2,4"
#: --reuse: a part whose results.json exists is read, not run again.
REUSE = False
#: Messages per run at each prefetch, for runs of 5 s or more: in round 4
#: (bench/results/2026-12-01-2core-issue26-round4/usage) most rows lasted 2.4-5.2 s with
#: half these counts, and the code since runs prefetch 100 and 1,000 up to twice as fast
#: (2026-12-03, loaded machine: 21,600-27,700 jobs/s at 100, 23,600-46,000 at 1,000).
MESSAGES = "1:5000,8:30000,32:60000,100:130000,1000:200000"
#: The no-op at prefetch 1,000 (the ratio's denominator): 30,900-47,500 jobs/s on 2026-12-03.
NOOP_MESSAGES = 220000
#: Runs shorter than this (seconds) are marked: their rate is mostly the machine's noise.
MIN_SECONDS = 5.0
SOAK = ("--broker", "redis", "--messages", "1500", "--seconds", "16", "--gap", "2,3",
        "--faults", "handler_kill,writer_kill", "--supervisors", "1", "--work-ms", "0",
        "--prefetch", "100", "--quiet")


def bench(root: Path, out: Path, *args: str) -> list[dict[str, Any]]:
    if REUSE and (out / "results.json").exists():
        print(f"reusing {out / 'results.json'}", file=sys.stderr, flush=True)
        return json.loads((out / "results.json").read_text())["runs"]
    command = [sys.executable, "-m", "bench", "--broker", "redis", *args, "--out", str(out)]
    print("$ " + " ".join(command[1:]), file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run(command, cwd=root, env=env, check=True)
    return json.loads((out / "results.json").read_text())["runs"]


def soak(coroutines: int, seed: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.chaos", *SOAK, "--coroutines", str(coroutines),
               "--seed", str(seed)]
    print("$ " + " ".join(command[1:]), file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    faults = {kind: int(count) for kind, count in
              re.findall(r"^(handler_kill|writer_kill) +(\d+)", done.stdout, re.M)}
    return {"coroutines": coroutines, "passed": done.returncode == 0, "faults": faults,
            "output": done.stdout[-6000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_usage", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--messages", default=MESSAGES,
                        help=f"messages per run at each prefetch, PREFETCH:COUNT,... "
                             f"(default {MESSAGES})")
    parser.add_argument("--noop-messages", type=int, default=NOOP_MESSAGES,
                        help="messages per no-op run at prefetch 1,000")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every message count (0.2: a quick, noisy look)")
    parser.add_argument("--latency-seconds", default="2")
    parser.add_argument("--baseline-root", type=Path,
                        help="a checkout of an older commit to run prefetch 100 and 1,000 from")
    parser.add_argument("--baseline-done", action="store_true",
                        help="the baseline ran already: read OUT/baseline/results.json")
    parser.add_argument("--reuse", action="store_true",
                        help="read the parts whose results.json exists instead of running them")
    parser.add_argument("--no-soaks", action="store_true", help="leave the chaos soaks out")
    args = parser.parse_args(argv)
    global REUSE
    REUSE = args.reuse
    args.out = args.out.resolve()  # the baseline runs in another folder
    args.out.mkdir(parents=True, exist_ok=True)
    counts = {int(prefetch): max(1, int(int(count) * args.scale)) for prefetch, count in
              (item.split(":") for item in args.messages.split(",") if item.strip())}
    noop_count = max(1, int(args.noop_messages * args.scale))
    common = ("--coroutines", COROUTINES, "--repeat", str(args.repeat))
    results: dict[str, Any] = {"command": "python -m bench.canary_usage " + " ".join(
        argv if argv is not None else sys.argv[1:])}
    if args.baseline_done:
        results["baseline"] = json.loads((args.out / "baseline" / "results.json").read_text()
                                         )["runs"]
    elif args.baseline_root:
        results["baseline"] = bench(args.baseline_root.resolve(), args.out / "baseline",
                                    "--prefetch", "100,1000", "--handlers", "noop,stats-usage",
                                    "--messages", str(counts[1000]), "--latency-load", "0",
                                    *common)
    if results.get("baseline"):
        results["after"] = bench(ROOT, args.out / "after", "--prefetch", "100,1000",
                                 "--handlers", "noop,stats-usage", "--messages",
                                 str(counts[1000]), "--latency-load", "0", *common)
    results["usage"] = []
    for prefetch, count in sorted(counts.items()):
        results["usage"] += bench(ROOT, args.out / f"usage-{prefetch}", "--prefetch",
                                  str(prefetch), "--handlers", "stats-usage", "--messages",
                                  str(count), "--latency-seconds", args.latency_seconds,
                                  *common)
    results["noop"] = bench(ROOT, args.out / "noop-1000", "--prefetch", "1000", "--handlers",
                            "noop", "--messages", str(noop_count), "--latency-load", "0",
                            *common)
    results["soaks"] = [] if args.no_soaks else [
        soak(coroutines, seed) for seed, coroutines in enumerate((1, 2, 4), 1)]
    (args.out / "canary.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "README.md").write_text(report(results))
    print(f"wrote {args.out / 'README.md'}", file=sys.stderr)
    ok = all(s["passed"] for s in results["soaks"]) and all(
        row.get("totals_exact") is not False for row in results["usage"])
    return 0 if ok else 1


def _rows(rows: list[dict[str, Any]], handler: str) -> dict[tuple[int, int], dict[str, Any]]:
    return {(row["prefetch"], row.get("coroutines", 1)): row for row in rows
            if row.get("system") == "queue-supervisor" and row.get("handler") == handler
            and not row.get("error")}


def _f(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def report(results: dict[str, Any]) -> str:
    usage = _rows(results["usage"], "stats-usage")
    noop = _rows(results["noop"], "noop")
    lines = [
        "# stats-usage canary table", "",
        f"Command: `{results['command']}`", "",
        "Stats-usage on the embedded ClickHouse engine (Redis broker), each configuration "
        "the median of its runs by jobs/s (`runs`: every run's jobs/s); `usage totals` is "
        "checked after every run (the database against the totals of the messages "
        "published). Client CPU is the supervisor, fork server, handler processes and the "
        "chDB writer; memory is the peak RSS of the supervisor / the sum over its children "
        "(the writer included). `load` is the machine's 1-minute load average once the "
        f"configuration's runs ended; a wall time marked * is below {MIN_SECONDS:g} s, too "
        "short for its rate to be trusted.", "",
        "| prefetch | coroutines | jobs/s | runs | wall s | client µs/job | Redis µs/job | "
        "msgs per reserve | msgs per settle | requests/job | bytes in/job | peak RSS MiB "
        "(supervisor / children) | redelivered | latency ms p50 / p99 | load | usage totals |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---|",
    ]
    rows = sorted(usage.items()) + [((key[0], key[1]), {**row, "noop": True})
                                    for key, row in sorted(noop.items())]
    for (prefetch, coroutines), row in rows:
        lat = row.get("latency") or {}
        latency = (f"{lat['p50_ms']:.1f} / {lat['p99_ms']:.1f}" if lat.get("p50_ms") is not None
                   else "-")
        totals = {True: "exact", False: "WRONG", None: "-"}[row.get("totals_exact")]
        wall = _f(row["seconds"], 2) + ("*" if row["seconds"] < MIN_SECONDS else "")
        spread = " / ".join(_f(rate) for rate in row.get("repeats_jobs_per_s") or [])
        label = f"{prefetch:,} (no-op)" if row.get("noop") else f"{prefetch:,}"
        lines.append(
            f"| {label} | {coroutines} | {_f(row['jobs_per_s'])} | {spread or '-'} | {wall} "
            f"| {_f(row.get('client_us_per_job'), 1)} | {_f(row.get('server_us_per_job'), 1)} "
            f"| {_f(row.get('batch_fill'), 1)} | {_f(row.get('settle_fill'), 1)} "
            f"| {_f(row.get('requests_per_job'), 3)} | {_f(row.get('bytes_in_per_job'))} "
            f"| {_f(row.get('rss_supervisor_mib'), 1)} / {_f(row.get('rss_children_mib'), 1)} "
            f"| {_f(row.get('redeliveries'))} | {latency} | {_f(row.get('load_after'), 1)} "
            f"| {totals} |")
    lines += ["", "## Targets (same run)", "", "| target | measured | |", "|---|---|---|"]
    for prefetch in (1, 8, 32, 100, 1000):
        one = usage.get((prefetch, 1))
        for coroutines in (2, 4):
            other = usage.get((prefetch, coroutines))
            if one and other:
                ratio = other["jobs_per_s"] / one["jobs_per_s"]
                lines.append(f"| prefetch {prefetch:,}: coroutines {coroutines} ≥ coroutines 1 "
                             f"| {ratio:.2f}x ({_f(other['jobs_per_s'])} / "
                             f"{_f(one['jobs_per_s'])} jobs/s) | {_verdict(ratio >= 1)} |")
    for coroutines in (1, 2, 4):
        ours, base = usage.get((1000, coroutines)), noop.get((1000, coroutines))
        if ours and base:
            ratio = ours["jobs_per_s"] / base["jobs_per_s"]
            lines.append(f"| prefetch 1,000, coroutines {coroutines}: ≥ 50% of the no-op | "
                         f"{ratio * 100:.0f}% ({_f(ours['jobs_per_s'])} / "
                         f"{_f(base['jobs_per_s'])} jobs/s) | {_verdict(ratio >= 0.5)} |")
    if results["soaks"]:
        lines += ["", "## Forced failures (same run)", "",
                  "`python -m bench.chaos " + " ".join(SOAK) + " --coroutines N`: handler "
                  "processes and the chDB writer SIGKILLed at seeded moments while 1,500 "
                  "messages are published; then every message must be handled or failed for "
                  "good and the totals in the database exact.", "",
                  "| coroutines | handler kills | writer kills | nothing lost, totals exact |",
                  "|---:|---:|---:|---|"]
    for run in results["soaks"]:
        lines.append(f"| {run['coroutines']} | {run['faults'].get('handler_kill', 0)} | "
                     f"{run['faults'].get('writer_kill', 0)} | {_verdict(run['passed'])} |")
    if results.get("baseline"):
        lines += _comparison(results["baseline"], results["after"])
    return "\n".join(lines) + "\n"


def _comparison(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Before and after, back to back (prefetch 100 and 1,000)", "",
             "| handler | prefetch | coroutines | before jobs/s | after jobs/s | after / before "
             "| before / after client µs/job | before / after peak RSS children MiB |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for handler in ("stats-usage", "noop"):
        old, new = _rows(before, handler), _rows(after, handler)
        for key in sorted(new):
            if key in old:
                a, b = old[key], new[key]
                lines.append(
                    f"| {handler} | {key[0]:,} | {key[1]} | {_f(a['jobs_per_s'])} | "
                    f"{_f(b['jobs_per_s'])} | {b['jobs_per_s'] / a['jobs_per_s']:.2f}x | "
                    f"{_f(a.get('client_us_per_job'), 1)} / {_f(b.get('client_us_per_job'), 1)}"
                    f" | {_f(a.get('rss_children_mib'), 1)} / "
                    f"{_f(b.get('rss_children_mib'), 1)} |")
    return lines


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


if __name__ == "__main__":
    sys.exit(main())
