"""The running jobs as ``status`` and the dashboard show them (``supervisor.running``).

- Redis: each supervisor's copy, ``supervisor-running.{q}.<consumer id>``, read beside its
  record (``broker.redis.admin.status.supervisors``): the jobs of every host, each with its
  run time as of now (the copy's own plus the time since it was written, from its expiry).
  A copy is written within a second of a change; a job that starts and ends within one may
  not show.
- NATS: JetStream keeps no records of ours. The supervisors of the queue on this host are
  found by their process titles, and their handler processes' titles (``worker.titles``)
  name the job each runs (an async one: how many, and the oldest), with its start to the
  second. Another host's jobs are seen by running ``status`` (or the dashboard) there; a
  supervisor of a queue of the same name on another broker would be listed too.

Every value is the broker's or a title's, which anyone able to write the key or start a
process may have crafted: the callers escape what they print (``logs.clean``, the
dashboard's ``show``), and a copy that is not ours reads as none.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import psutil

from broker.redis.keys import QueueKeys
from supervisor import logs
from supervisor.figures import Figures
from supervisor.ops import drain as processes
from supervisor.running import Copy, Job, decode
from worker import titles


def job_dict(job: Job, **extra: Any) -> dict[str, Any]:
    """One running job, JSON-ready (``--json``, the dashboard)."""
    return {"handler": job.handler, "process": job.process, "pid": job.pid,
            "attempt": job.attempt, "started": job.started, "elapsed": round(job.elapsed, 1),
            "slow": job.slow, **extra}


def copy_dict(copy: Copy) -> dict[str, Any]:
    return {"running": copy.running, "slow_job_after": copy.slow_job_after,
            "age": round(copy.age, 1), "jobs": [job_dict(job) for job in copy.jobs],
            "figures": copy.figures.encode() if copy.figures is not None else None}


async def add_redis_copies(client: Any, keys: QueueKeys, records: list[dict[str, Any]]) -> None:
    """Each supervisor record (``broker.redis.admin.status.supervisors``) gets ``running``:
    its copy, or None when it has none (nothing runs, or a version before copies)."""
    if not records:
        return
    pipe = client.pipeline(transaction=False)
    for record in records:
        pipe.get(keys.running(record["id"]))
        pipe.pttl(keys.running(record["id"]))
    replies = await pipe.execute()
    for index, record in enumerate(records):
        copy = decode(replies[2 * index], replies[2 * index + 1])
        record["running"] = copy_dict(copy) if copy is not None else None


async def redis_figures(client: Any, keys: QueueKeys, ids: list[str]) -> dict[str, Figures]:
    """The figures in the copies of the supervisors ``ids`` (``supervisor.figures``), by id;
    one without a copy, or of a version before figures, is left out."""
    if not ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for ident in ids:
        pipe.get(keys.running(ident))
    replies = await pipe.execute()
    found = {}
    for ident, raw in zip(ids, replies, strict=True):
        copy = decode(raw, -1)
        if copy is not None and copy.figures is not None:
            found[ident] = copy.figures
    return found


def on_this_host(queue: str, slow_after: float, now: float | None = None
                 ) -> list[dict[str, Any]]:
    """The supervisors of ``queue`` on this host (never this process), by their titles,
    each with the jobs its handler processes' titles name (NATS: see the docstring)."""
    now = time.time() if now is None else now
    found = []
    for process in psutil.process_iter():
        title = processes.title(process)
        if process.pid == os.getpid() or not processes.is_supervisor_of(title, queue):
            continue
        try:
            children = process.children(recursive=True)
        except psutil.Error:
            continue
        prefix = processes.TITLE.format(queue=queue)
        jobs = [job for child in children
                if (job := _titled_job(child, processes.title(child), prefix, slow_after, now))]
        found.append({"host": socket.gethostname(), "pid": process.pid,
                      "title": title[len(prefix):], "jobs": sorted(
                          jobs, key=lambda job: -job["elapsed"])})
    return sorted(found, key=lambda supervisor: supervisor["pid"])


def _titled_job(child: psutil.Process, title: str, prefix: str, slow_after: float,
                now: float) -> dict[str, Any] | None:
    if not title.startswith(prefix + "handler "):
        return None
    read = titles.parse(title[len(prefix + "handler "):])
    if read is None or read.since is None:
        return None
    elapsed = max(0.0, now - read.since)
    job = Job(read.handler, child.pid, read.pid, read.attempt, read.since, elapsed,
              bool(slow_after) and elapsed >= slow_after)
    return job_dict(job, in_process=read.running)


# -- status's lines ------------------------------------------------------------------------------


def summary(jobs: list[dict[str, Any]], total: int) -> str:
    """``3 jobs, the oldest 12m05s, 1 past slow_job_after``."""
    if not total:
        return "none"
    oldest = max(job["elapsed"] for job in jobs) if jobs else 0.0
    slow = sum(job["slow"] for job in jobs)
    return (f"{total} job{'s' if total != 1 else ''}, the oldest {duration(oldest)}"
            + (f", {slow} past slow_job_after" if slow else ""))


def job_line(job: dict[str, Any], slow_after: float) -> str:
    """One job, as a line of ``status`` (escaped: pids are the producers')."""
    started = time.strftime("%H:%M:%S UTC", time.gmtime(job["started"]))
    several = job.get("in_process", 1)
    of = f" (the oldest of {several} in its process)" if several > 1 else ""
    slow = f"  past slow_job_after ({slow_after:g}s)" if job["slow"] else ""
    return (f"job {logs.clean(job['pid'], 100)}  attempt {job['attempt']}  "
            f"{duration(job['elapsed'])} (since {started}){of}  handler {job['handler']}, "
            f"process {job['process'] or '?'}{slow}")


def copy_lines(copy: dict[str, Any] | None) -> list[str]:
    """A supervisor's running jobs, below its record's line."""
    if not copy or not copy["running"]:
        return []
    more = copy["running"] - len(copy["jobs"])
    return ([job_line(job, copy["slow_job_after"]) for job in copy["jobs"]]
            + ([f"... and {more} more running (the {len(copy['jobs'])} oldest are shown)"]
               if more > 0 else []))


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h02m``, ``2d03h``."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
