"""The results of one ``python -m bench`` run: JSON, a markdown report and a PNG chart."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _latency(row: dict[str, Any]) -> str:
    lat = row.get("latency") or {}
    if lat.get("p50_ms") is None:
        return "-"
    return f"{lat['p50_ms']:.1f} / {lat['p99_ms']:.1f} / {lat['max_ms']:.1f}"


COLUMNS = (
    ("system", "system", lambda r: r["system"]),
    ("broker", "broker", lambda r: r["broker"]),
    ("handler", "handler", lambda r: r["handler"] + (" +history" if r.get("history") else "")),
    ("prefetch", "prefetch", lambda r: _num(r.get("prefetch"))),
    ("coroutines", "coroutines", lambda r: _num(r.get("coroutines"))),
    ("jobs/s", "jobs_per_s", lambda r: _num(r.get("jobs_per_s"))),
    ("wall s", "seconds", lambda r: _num(r.get("seconds"), 2)),
    ("client µs/job", "client_us_per_job", lambda r: _num(r.get("client_us_per_job"), 1)),
    ("of which supervisor", "supervisor_us_per_job",
     lambda r: _num(r.get("supervisor_us_per_job"), 1)),
    ("server µs/job", "server_us_per_job", lambda r: _num(r.get("server_us_per_job"), 1)),
    ("msgs per reserve / pull request", "batch_fill", lambda r: _num(r.get("batch_fill"), 1)),
    ("msgs per settle call", "settle_fill", lambda r: _num(r.get("settle_fill"), 1)),
    ("requests/job", "requests_per_job", lambda r: _num(r.get("requests_per_job"), 3)),
    ("bytes in/job", "bytes_in_per_job", lambda r: _num(r.get("bytes_in_per_job"))),
    ("bytes out/job", "bytes_out_per_job", lambda r: _num(r.get("bytes_out_per_job"))),
    ("script µs/call", "script_usec_per_call", lambda r: _num(r.get("script_usec_per_call"), 1)),
    ("peak RSS MiB (worker / children)", "rss",
     lambda r: f"{_num(r.get('rss_supervisor_mib'), 1)} / {_num(r.get('rss_children_mib'), 1)}"),
    ("redelivered", "redeliveries", lambda r: _num(r.get("redeliveries"))),
    ("usage totals", "totals_exact", lambda r: {True: "exact", False: "WRONG", None: "-"}[
        r.get("totals_exact")]),
    ("latency ms p50 / p99 / max", "latency", _latency),
    ("load after", "load_after", lambda r: _num(r.get("load_after"), 2)),
)


OWN = ("msgs per receive() (own counters)", "own_receive_fill",
       lambda r: _num(r.get("own_receive_fill"), 1))


def table(rows: list[dict[str, Any]]) -> str:
    columns = list(COLUMNS)
    if any(row.get("own_receive_fill") for row in rows):
        columns.insert(9, OWN)
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |",
             "|" + "|".join("---" if i < 3 else "---:" for i in range(len(columns))) + "|"]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['system']} | {row['broker']} | {row.get('handler', '')} | "
                         f"{_num(row.get('prefetch'))} | {_num(row.get('coroutines'))} | "
                         f"not run: {row['error']} |" + " |" * (len(columns) - 6))
            continue
        lines.append("| " + " | ".join(cell(row) for _, _, cell in columns) + " |")
    return "\n".join(lines)


def find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if not row.get("error") and all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _ratio(a: dict | None, b: dict | None, key: str = "jobs_per_s") -> float | None:
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for every target that this run has figures for."""
    rows = results["runs"]
    out: list[tuple[str, str, str]] = []

    def add(name: str, value: float | None, ok: bool | None, text: str) -> None:
        if value is None:
            return
        out.append((name, text, "met" if ok else "NOT met"))

    ours = {p: ours_at(rows, "redis", p) for p in results["prefetch"]}
    top, one = max(results["prefetch"]), min(results["prefetch"])
    dramatiq100 = find(rows, system="dramatiq", prefetch=100)
    dramatiq1 = find(rows, system="dramatiq", prefetch=1)
    raw = find(rows, system="raw redis-py + Lua")
    r = _ratio(ours.get(100), dramatiq100)
    add("Redis no-op prefetch 100 ≥ 10x Dramatiq (prefetch 100)", r, r and r >= 10,
        f"{r or 0:.2f}x")
    r = _ratio(ours.get(100), raw)
    add("Redis no-op prefetch 100 ≥ 35% of the raw Lua loop", r, r and r >= 0.35,
        f"{(r or 0) * 100:.0f}%")
    r = _ratio(ours.get(100), raw, "server_us_per_job")
    add("Redis CPU per job ≤ 2.5x the raw Lua loop's (no-op, prefetch 100)", r, r and r <= 2.5,
        f"{r or 0:.2f}x ({(ours.get(100) or {}).get('server_us_per_job') or 0:.1f} vs "
        f"{(raw or {}).get('server_us_per_job') or 0:.1f} µs)")
    out.extend(_handler_targets(rows))
    out.extend(_baseline_targets(results))
    best = ours.get(100)
    if best:
        value = best.get("client_us_per_job")
        add("client CPU ≤ 60 µs/job (Redis no-op, prefetch 100)", value,
            value is not None and value <= 60, f"{value or 0:.1f} µs")
        value = best.get("server_us_per_job")
        add("Redis CPU ≤ 15 µs/job (no-op, prefetch 100)", value,
            value is not None and value <= 15, f"{value or 0:.1f} µs")
    r = _ratio(ours.get(1), dramatiq1)
    add("prefetch 1 no slower than Dramatiq at prefetch 1", r, r and r >= 1, f"{r or 0:.2f}x")
    for broker in ("redis", "nats"):
        series = [ours_at(rows, broker, p) for p in sorted(results["prefetch"])]
        if len(series) > 1 and all(series):
            speeds = [row["jobs_per_s"] for row in series]
            rising = all(b >= a for a, b in itertools.pairwise(speeds))
            add(f"{broker}: throughput rising monotonically {one} → {top}", 1.0, rising,
                " → ".join(f"{s:,.0f}" for s in speeds))
    nats100, nats1 = ours_at(rows, "nats", 100), ours_at(rows, "nats", 1)
    r = _ratio(nats100, find(rows, system="raw nats-py"))
    add("NATS no-op prefetch 100 ≥ 1.2x the raw nats-py loop", r, r and r >= 1.2,
        f"{r or 0:.2f}x")
    r = _ratio(nats100, nats1)
    add("NATS no-op prefetch 100 ≥ 2x our prefetch 1", r, r and r >= 2, f"{r or 0:.2f}x")
    for p in results["prefetch"]:
        hist = find(rows, system="queue-supervisor", broker="redis", handler="noop",
                    prefetch=p, history=True)
        if hist and ours.get(p):
            r = _ratio(hist, ours[p])
            add(f"large history within 10% of empty (prefetch {p}, jobs/s)", r,
                r and r >= 0.9, f"{(r or 0) * 100:.0f}% of empty")
            slow = hist.get("slow_calls") or {}
            add(f"large history: no script call above 5 ms (prefetch {p})", 1.0,
                slow.get("count", 0) == 0,
                f"{slow.get('count', 0)} calls > 5 ms "
                f"(max {slow.get('max_usec', 0) / 1000:.1f} ms)")
    maint = results.get("maintenance")
    young = [case for case in (maint or {}).get("cases", []) if not case.get("old_pids")]
    if maint and len(young) >= 3:
        small, large = young[-2], young[-1]

        def mean(case: dict[str, Any]) -> float:
            return sum(c["server_cpu_ms"] for c in case["calls"]) / len(case["calls"])

        ratio = mean(large) / mean(small) if mean(small) else None
        add(f"maintain() bounded per call: server CPU with {large['stale_pids']:,} stale pids "
            f"within 1.5x of {small['stale_pids']:,}", ratio, ratio is not None and ratio <= 1.5,
            f"{mean(large):.2f} vs {mean(small):.2f} ms per call")
        longest = max(c["longest_script_ms"] for case in maint["cases"] for c in case["calls"])
        add("maintain(): no script call above 5 ms", longest, longest <= 5,
            f"longest {longest:.2f} ms")
    for broker in ("redis", "nats"):
        row = ours_at(rows, broker, 100)
        lat = (row or {}).get("latency") or {}
        if lat.get("p99_ms") is not None:
            add(f"{broker}: queue latency p99 < 50 ms at prefetch 100", lat["p99_ms"],
                lat["p99_ms"] < 50, f"{lat['p99_ms']:.1f} ms at {lat['rate']:,.0f} msgs/s")
    return out


def ours_at(rows: list[dict[str, Any]], broker: str, prefetch: int, handler: str = "noop",
            coroutines: int = 1) -> dict[str, Any] | None:
    """Our run of a configuration (rows of runs without a coroutines figure had one)."""
    for row in rows:
        if (not row.get("error") and row["system"] == "queue-supervisor"
                and row["broker"] == broker and row.get("handler") == handler
                and row.get("prefetch") == prefetch and not row.get("history")
                and row.get("coroutines", 1) == coroutines):
            return row
    return None


def _handler_targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Handlers and handler processes: stats-usage against the no-op, coroutines 2 and 4
    against 1 (no-op), and a 1 ms handler spread over processes."""
    out = []
    for broker in ("redis", "nats"):
        noop = ours_at(rows, broker, 100)
        usage = ours_at(rows, broker, 100, "stats-usage") or ours_at(rows, broker, 100,
                                                                    "stats-usage-sqlite")
        r = _ratio(usage, noop)
        if r is not None:
            out.append((f"{broker}: stats-usage at prefetch 100 ≥ 75% of the no-op",
                        f"{r * 100:.0f}%", "met" if r >= 0.75 else "NOT met"))
        for count in (2, 4):
            r = _ratio(ours_at(rows, broker, 100, coroutines=count), noop)
            if r is not None:  # "no worse": within this machine's run-to-run noise (5%)
                out.append((f"{broker}: no-op coroutines {count} no worse than 1 (prefetch "
                            "100, within 5%)", f"{r * 100:.0f}% of coroutines 1",
                            "met" if r >= 0.95 else "NOT met"))
        slow = ours_at(rows, broker, 100, "sleep-1ms")
        for count, least in ((2, 1.8), (4, 3.2)):
            r = _ratio(ours_at(rows, broker, 100, "sleep-1ms", count), slow)
            if r is not None:
                out.append((f"{broker}: 1 ms handler, coroutines {count} ≥ {least}x coroutines 1",
                            f"{r:.2f}x", "met" if r >= least else "NOT met"))
    return out


def _baseline_targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Against an earlier run on the same machine (``--baseline``)."""
    base = results.get("baseline")
    if not base:
        return []
    out, rows, old = [], results["runs"], base["runs"]
    now, then = ours_at(rows, "redis", 100), ours_at(old, "redis", 100)
    r = _ratio(now, then, "supervisor_us_per_job")
    if now and then and r is not None:
        out.append(("supervisor's own CPU per job ≤ half of the baseline's (Redis no-op, "
                    "prefetch 100)", f"{now['supervisor_us_per_job']:.1f} vs "
                    f"{then['supervisor_us_per_job']:.1f} µs ({r * 100:.0f}%)",
                    "met" if r <= 0.5 else "NOT met"))
    for broker in ("redis", "nats"):
        for prefetch in (1, 8):
            r = _ratio(ours_at(rows, broker, prefetch), ours_at(old, broker, prefetch))
            if r is not None:
                out.append((f"{broker} prefetch {prefetch}: no more than 5% slower than the "
                            "baseline", f"{r * 100:.0f}% of its jobs/s",
                            "met" if r >= 0.95 else "NOT met"))
    return out


def ratios(results: dict[str, Any]) -> list[str]:
    rows = results["runs"]
    peers = [row for row in rows if row["system"] != "queue-supervisor" and not row.get("error")]
    lines = []
    for peer in peers:
        ours = [row for row in rows if row["system"] == "queue-supervisor"
                and row["broker"] == peer["broker"] and row["handler"] == "noop"
                and not row.get("history") and not row.get("error")
                and row.get("coroutines", 1) == 1]
        if not ours:
            continue
        parts = ", ".join(
            f"prefetch {row['prefetch']}: {row['jobs_per_s'] / peer['jobs_per_s']:.2f}x"
            for row in ours)
        lines.append(f"- against {peer['system']} ({peer['broker']}, prefetch "
                     f"{peer['prefetch']}, {peer['jobs_per_s']:,.0f} jobs/s): {parts}")
    return lines


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    out = [
        f"# Benchmark: {results['name']}", "",
        f"Command: `{results['command']}`", "",
        f"Machine: {m['cpu']}, {m['cores_logical']} logical cores, {m['memory_gib']} GiB, "
        f"{m['kernel']}, Python {m['python']}; "
        + ", ".join(m["servers"].values())
        + f". Load average at start {m['load_at_start']}, at end {results['load_at_end']}"
        + (f"; busy processes at start: {', '.join(results['busy_at_start'])}"
           if results.get("busy_at_start") else "") + ".", "",
        f"Settings: {results['settings']}", "",
        "## Runs", "",
        table(results["runs"]), "",
        "![jobs/s and CPU per job against prefetch](chart.png)", "",
        "Per job: CPU is the worker's process family (client) and the broker server; "
        "requests are commands/messages a client sent; bytes are the server's network in/out. "
        "\"load after\" is the 1-minute load average once the configuration ran: a run "
        "alone keeps it near 1-2 on this machine; more means other work shared the cores.",
        "",
    ]
    lines = ratios(results)
    if lines:
        out += ["## Ratios (our no-op jobs/s ÷ the peer's)", "", *lines, ""]
    goals = targets(results)
    if goals:
        out += ["## Targets", "", "| target | measured | |", "|---|---|---|"]
        out += [f"| {name} | {value} | {verdict} |" for name, value, verdict in goals]
        out.append("")
    settle = results.get("settlement")
    if settle:
        out += ["## Grouped vs per-message settlement (Redis, prefetch 100, no handler)", "",
                "| variant | jobs/s | client µs/job | of which commit | Redis µs/job | "
                "scripts/job | script µs/call | bytes in/job |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in settle:
            out.append(f"| {row['variant']} | {row['jobs_per_s']:,.0f} | "
                       f"{row['client_us_per_job']:.1f} | {row['commit_client_us_per_job']:.1f} | "
                       f"{row['server_us_per_job']:.1f} | {row['script_calls_per_job']:.2f} | "
                       f"{row['script_usec_per_call']:.1f} | {row['bytes_in_per_job']:.0f} |")
        out.append("")
    maint = results.get("maintenance")
    if maint:
        out += ["## maintain() calls (Redis)", "",
                f"{maint['calls']} consecutive `RedisBroker.maintain()` calls per case, "
                "nothing else running; young legacy entries stay, old ones (past "
                "recovery_age, at the tail) are recovered a window per call.", "",
                "| young pids in processing (+ as many other keys) | old pids at the tail | "
                "recovered per call | wall ms per call | server CPU ms per call | "
                "longest script ms | longest command ms |",
                "|---:|---:|---|---|---|---|---|"]
        for case in maint["cases"]:
            calls = case["calls"]
            out.append(f"| {case['stale_pids']:,} | {case.get('old_pids', 0):,} | "
                       + ", ".join(str(c.get("recovered", 0)) for c in calls) + " | "
                       + ", ".join(f"{c['wall_ms']:.1f}" for c in calls) + " | "
                       + ", ".join(f"{c['server_cpu_ms']:.2f}" for c in calls) + " | "
                       + ", ".join(f"{c['longest_script_ms']:.2f}" for c in calls) + " | "
                       + ", ".join(f"{c['longest_command_ms']:.2f}" for c in calls) + " |")
        out.append("")
    out += ["## How it is measured", "", results["method"], ""]
    return "\n".join(out)


def chart(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for row in results["runs"] if not row.get("error")]
    fig, (speed, cpu) = plt.subplots(1, 2, figsize=(12, 4.8))
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:  # one handler process: other counts are in the table
        if row["system"] == "queue-supervisor" and row.get("coroutines", 1) == 1:
            label = f"{row['broker']} {row['handler']}" + (" +history" if row["history"] else "")
            series.setdefault((label, row["broker"]), []).append(row)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, ((label, _), points) in enumerate(series.items()):
        colour = colours[index % len(colours)]
        points.sort(key=lambda row: row["prefetch"])
        xs = [row["prefetch"] for row in points]
        speed.plot(xs, [row["jobs_per_s"] for row in points], marker="o", label=label,
                   color=colour)
        cpu.plot(xs, [row["client_us_per_job"] or 0 for row in points], marker="o",
                 color=colour, label=f"{label}: client")
        cpu.plot(xs, [row["server_us_per_job"] or 0 for row in points], marker="x",
                 linestyle="--", color=colour, label=f"{label}: server")
    for row in rows:
        if row["system"] != "queue-supervisor":
            speed.axhline(row["jobs_per_s"], linestyle=":", color="grey")
            speed.annotate(f"{row['system']} ({row['broker']}, prefetch {row['prefetch']})",
                           (min(results["prefetch"]), row["jobs_per_s"]), fontsize=7,
                           color="dimgrey", va="bottom")
    for axis, title in ((speed, "jobs/s, one handler process (log)"),
                        (cpu, "CPU µs per job (log): client solid, server dashed")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(results["prefetch"], [str(p) for p in results["prefetch"]])
        axis.set_xlabel("prefetch")
        axis.set_title(title, fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
    speed.legend(fontsize=7)
    cpu.legend(fontsize=6)
    fig.suptitle(f"{results['name']}: {results['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(results: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "results.json", folder / "README.md"]
    written[0].write_text(json.dumps(results, indent=1, default=str) + "\n")
    written[1].write_text(markdown(results))
    if chart(results, folder / "chart.png"):
        written.append(folder / "chart.png")
    return written


def main() -> None:
    """``python -m bench.report FOLDER``: write README.md and chart.png again from the
    folder's results.json (after a change to the report, without measuring again)."""
    import sys

    folder = Path(sys.argv[1])
    for path in write(json.loads((folder / "results.json").read_text()), folder):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
