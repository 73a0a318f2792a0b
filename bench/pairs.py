"""Two commits compared in alternated pairs: the only comparison this kind of machine allows.

    python -m bench.pairs BEFORE [AFTER] --pairs 4 --out bench/results/<name> [-- BENCH ARGS]

A shared 2-core VM drifts by a third within minutes, so two runs far apart in time compare
the machine, not the code. Here each pair runs ``python -m bench`` once on each commit, back
to back, BEFORE first; the ratio of a pair is AFTER's jobs/s over BEFORE's, and the report
gives every pair and their median (the figure to quote). AFTER defaults to HEAD.

Each commit runs from its own tree (``git archive`` into a temporary folder, the harness
included), with this interpreter and its installed libraries. BENCH ARGS default to the
no-op at prefetch 100 on Redis and on NATS; every row the two runs share (broker, handler,
prefetch, coroutines) gets a ratio. Writes ``pairs.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT

DEFAULT_BENCH = ("--broker", "both", "--prefetch", "100", "--handlers", "noop",
                 "--messages", "200000", "--latency-load", "0", "--repeat", "1")
#: What names a row, so that the two runs' rows can be matched.
ROW_KEY = ("broker", "handler", "prefetch", "coroutines")
#: The figures kept per row and side besides jobs/s (CPU per job tells code from machine).
FIGURES = ("jobs_per_s", "supervisor_us_per_job", "client_us_per_job", "server_us_per_job",
           "load_after")


def tree(commit: str, into: Path) -> Path:
    """The commit's files, unpacked (not a worktree: nothing of the checkout is shared)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit],
                             check=True, capture_output=True).stdout
    into.mkdir(parents=True)
    with tempfile.TemporaryFile() as raw:
        raw.write(archive)
        raw.seek(0)
        with tarfile.open(fileobj=raw) as unpacked:
            unpacked.extractall(into, filter="data")
    return into


def run(root: Path, out: Path, bench_args: list[str]) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "bench", *bench_args, "--out", str(out)]
    print(f"$ ({root.name}) " + " ".join(command[1:]), file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run(command, cwd=root, env=env, check=True)
    rows: list[dict[str, Any]] = json.loads((out / "results.json").read_text())["runs"]
    return [row for row in rows if row.get("system") == "queue-supervisor"]


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(name) for name in ROW_KEY)


def pair(number: int, before: list[dict[str, Any]], after: list[dict[str, Any]],
         names: tuple[str, str]) -> list[dict[str, Any]]:
    found = {key(row): row for row in after}
    out = []
    for old in before:
        new = found.get(key(old))
        if new is None or not old.get("jobs_per_s"):
            continue
        entry: dict[str, Any] = {"pair": number, "before": names[0], "after": names[1]}
        entry.update(zip(ROW_KEY, key(old), strict=True))
        for figure in FIGURES:
            entry[f"before_{figure}"] = old.get(figure)
            entry[f"after_{figure}"] = new.get(figure)
        entry["ratio"] = new["jobs_per_s"] / old["jobs_per_s"]
        out.append(entry)
    return out


def summary(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[Any, ...], list[float]] = {}
    for entry in pairs:
        rows.setdefault(key(entry), []).append(entry["ratio"])
    return [{**dict(zip(ROW_KEY, row, strict=True)), "ratios": ratios,
             "median": statistics.median(ratios)} for row, ratios in rows.items()]


def short(commit: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit],
                          check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = list(DEFAULT_BENCH)
    if "--" in argv:
        bench_args = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(prog="python -m bench.pairs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the older commit (runs first in every pair)")
    parser.add_argument("after", nargs="?", default="HEAD", help="the newer commit (HEAD)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # each run's working folder is its commit's tree
    names = (short(args.before), short(args.after))
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-pairs-") as scratch:
        roots = [tree(commit, Path(scratch) / name) for commit, name in
                 zip((args.before, args.after), names, strict=True)]
        for number in range(1, args.pairs + 1):
            runs = [run(root, args.out / f"pair{number}-{name}", bench_args)
                    for root, name in zip(roots, names, strict=True)]
            pairs += pair(number, runs[0], runs[1], names)
            for entry in pairs[-len(runs[0]):]:
                print(f"pair {number} {entry['broker']} {entry['handler']} prefetch "
                      f"{entry['prefetch']}: {entry['before_jobs_per_s']:,.0f} -> "
                      f"{entry['after_jobs_per_s']:,.0f} jobs/s, ratio {entry['ratio']:.3f}",
                      flush=True)
    method = (f"python -m bench {' '.join(bench_args)}, one run per commit per pair, "
              f"{names[0]} first; each commit from its own tree")
    result: dict[str, Any] = {"method": method, "before": names[0], "after": names[1],
                              "pairs": pairs, "summary": summary(pairs)}
    (args.out / "pairs.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in result["summary"]:
        ratios = ", ".join(f"{ratio:.3f}" for ratio in row["ratios"])
        print(f"{row['broker']} {row['handler']} prefetch {row['prefetch']} coroutines "
              f"{row['coroutines']}: {ratios}; median {row['median']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
