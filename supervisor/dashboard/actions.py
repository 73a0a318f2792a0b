"""The dashboard's actions on a Redis queue: retry or delete one failed or dead job, and
drain (SIGTERM) a supervisor of this host. Each returns one line for the operator and the
action log. JetStream queues take no action here (their dead stream is read-only).

Both are the operator commands' own functions (``failed retry PID``, ``failed delete PID``):
the job moves or goes only if it is still where and what was read.
"""

from __future__ import annotations

import signal
from typing import Any

from broker.base import MAX_BATCH
from supervisor.ops import drain as processes
from supervisor.ops import failed, inspect
from supervisor.ops import retry as retrying

SOURCES = retrying.SOURCES  # "failed", "dead"


async def retry_job(broker: Any, source: str, pid: str) -> str:
    keys, queue = broker.keys, broker.keys.queue
    limit = getattr(broker, "max_envelope_bytes", 0) or retrying.RECORD_LIMIT
    report = await retrying.retry(broker.client, broker.scripts, keys, source=source,
                                  pids=[pid], max_record_bytes=limit)
    if report.moved:
        return f"job {pid} of {queue} moved from {source} back to the ready list"
    if report.expired:
        return f"job {pid} of {queue} had no job record left (job_ttl): removed from {source}"
    if report.malformed:
        return (f"job {pid} of {queue} was left in {source}: its record is undecodable, "
                f"not writable as PHP writes JSON, or over the job's envelope limit")
    return f"job {pid} of {queue} was not in {source} any more, or changed: nothing moved"


async def delete_job(broker: Any, source: str, pid: str) -> str:
    queue = broker.keys.queue
    report = await failed.delete(broker.client, broker.scripts, broker.keys, source, [pid])
    if not report.deleted:
        return f"job {pid} of {queue} was not in {source} any more: nothing deleted"
    return f"job {pid} of {queue} deleted from {source} with its job and failure records"


async def drain_supervisor(broker: Any, consumer: str) -> str:
    """SIGTERM the supervisor ``consumer`` if it runs on this host (it then stops taking
    work, finishes or releases what it holds, and exits: the supervisor's own drain)."""
    keys, queue = broker.keys, broker.keys.queue
    records = await inspect.supervisors(broker.client, keys, show=MAX_BATCH)
    record = next((r for r in records if r["id"] == consumer), None)
    if record is None:
        return f"supervisor {consumer} of {queue} has no record (stopped meanwhile?): no signal"
    found, elsewhere = processes.find_supervisors(queue, [record["where"]])
    if elsewhere:
        return (f"supervisor {consumer} of {queue} runs on another host ({record['where']}): "
                f"drain it there; no signal sent")
    if not found:
        return (f"supervisor {consumer} of {queue} ({record['where']}) is not a running "
                f"supervisor of this queue on this host: no signal sent")
    found[0].send_signal(signal.SIGTERM)
    return (f"supervisor {consumer} of {queue} (pid {found[0].pid}) sent SIGTERM: it "
            f"finishes or releases what it holds and exits")
