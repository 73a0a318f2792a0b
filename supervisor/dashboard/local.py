"""What this host can tell of a supervisor beyond its record ("host pid"): its uptime and
process titles, the supervisor's ("running [buffer 40/50, 1/2 busy]") and each handler
process's ("handler 0 busy"). Read with psutil, only for records of this host whose pid
still carries the queue's supervisor title (``ops.drain.find_supervisors``)."""

from __future__ import annotations

import time
from typing import Any

import psutil

from supervisor.ops import drain as processes


def describe(queue: str, where: str) -> dict[str, Any] | None:
    """{"uptime": s, "title": ..., "handlers": [titles]} or None (another host, or gone)."""
    found, _ = processes.find_supervisors(queue, [where])
    if not found:
        return None
    process = found[0]
    try:  # a child that ends after it is listed reads as "" (processes.title): skipped
        uptime = time.time() - process.create_time()
        children = process.children(recursive=True)
    except (psutil.Error, OSError):
        return None
    prefix = processes.TITLE.format(queue=queue)
    handlers = [title[len(prefix):] for title in map(processes.title, children)
                if title.startswith(prefix + "handler ")]
    return {"uptime": uptime, "title": processes.title(process)[len(prefix):],
            "handlers": sorted(handlers)}
