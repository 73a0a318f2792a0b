"""The queue page's supervisors side by side: one row each with its shape and its rates.

Several supervisors of one queue that differ in prefetch or handler processes (the
stats-usage canary runs 1, 8, 32 and 100 under the same load) are told apart here: per
supervisor its prefetch and coroutines, jobs/s, CPU per job, messages per reserve and per
settle call, queue wait p50/p99 and retries, so the canary's gates (progress, CPU
efficiency, latency, accounting) are read off one page.

Each supervisor's copy carries monotonic totals (``supervisor.figures``); the dashboard's
sampler and each queue page reading feed them to a ``RateBook`` per queue, which gives the
rates over up to the last minute of that supervisor's own clock. A supervisor seen once
has its shape but no rates yet ("—"). Redis only: JetStream keeps no records of ours, and
there the Grafana dashboard's per-instance panels compare them (from the metrics).
"""

from __future__ import annotations

from typing import Any

from supervisor import figures
from supervisor.figures import RateBook


def readings(records: list[dict[str, Any]]) -> dict[str, figures.Figures]:
    """The figures in the supervisor records of a queue page reading, by consumer id."""
    found = {}
    for record in records:
        copy = record.get("running") or {}
        read = figures.decode(copy.get("figures"))
        if read is not None:
            found[str(record["id"])] = read
    return found


def rows(records: list[dict[str, Any]], book: RateBook) -> list[dict[str, Any]]:
    """One row per supervisor whose copy has figures, by prefetch then consumer id."""
    table = []
    for ident, read in readings(records).items():
        where = next((str(record.get("where", "")) for record in records
                      if str(record["id"]) == ident), "")
        rate = book.rates(ident)
        table.append({
            "id": ident, "where": where, "prefetch": read.prefetch,
            "coroutines": read.coroutines, "tasks": read.tasks, "done": read.done,
            "wait_p50": read.wait_p50, "wait_p99": read.wait_p99,
            "span": rate.seconds if rate else None,
            "jobs_per_s": rate.jobs_per_s if rate else None,
            "cpu_us_per_job": rate.cpu_us_per_job if rate else None,
            "per_reserve": rate.per_reserve if rate else None,
            "per_settle": rate.per_settle if rate else None,
            "retried": rate.retried if rate else None,
        })
    table.sort(key=lambda row: (row["prefetch"], row["coroutines"], row["id"]))
    return table
