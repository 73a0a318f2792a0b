"""The dashboard's actions: on a Redis queue, retry or delete one failed or dead job, drop
the oldest poison entries, and drain (SIGTERM) a supervisor of this host; on a JetStream
queue, retry or delete one dead letter. Each returns one line for the operator and the
action log.

Each is the operator commands' own function (``failed retry PID``, ``failed delete PID``,
``poison delete --count N``, ``dead retry PID`` and ``dead delete PID`` on NATS), from
``broker.redis.admin`` and ``broker.nats.admin``: the job moves or goes only if it is still
where and what was read.

None of them may run twice for one form: the app spends the form's one-time action token
(``auth.Guard.check``) before it calls one, so a double click or a replayed POST acts once.
"""

from __future__ import annotations

import signal
from typing import Any

from broker.base import EnvelopeLimited
from broker.nats import admin as nats_admin
from broker.redis.admin import lists as redis_lists
from broker.redis.admin import retry as retrying
from broker.redis.admin import status as redis_status
from broker.redis.recovery import RECORD_LIMIT
from supervisor.ops import drain as processes

SOURCES = retrying.SOURCES  # "failed", "dead"


async def retry_job(broker: Any, source: str, pid: str) -> str:
    keys, queue = broker.keys, broker.keys.queue
    own = broker.max_envelope_bytes if isinstance(broker, EnvelopeLimited) else 0
    limit = own or RECORD_LIMIT
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
    report = await redis_lists.delete(broker.client, broker.scripts, broker.keys, source, [pid])
    if not report.deleted:
        return f"job {pid} of {queue} was not in {source} any more: nothing deleted"
    return f"job {pid} of {queue} deleted from {source} with its job and failure records"


async def delete_poison(broker: Any, count: int) -> str:
    """Drop the ``count`` oldest poison entries (those the page showed: entries pushed since
    are at the head, and LTRIM keeps them)."""
    queue = broker.keys.queue
    dropped = await redis_lists.delete_poison(broker.client, broker.keys, count)
    return (f"{dropped} oldest poison entries of {queue} deleted (asked for {count}; entries "
            f"pushed since the page was read are kept)")


async def nats_dead_letter(stream: nats_admin.DeadStream, queue: str, action: str,
                           selector: str, depth: int) -> str:
    """Retry (publish to the work subject, acknowledged, then delete) or delete the dead
    letter ``selector`` names (``seq:N``, or a pid: every copy among the oldest ``depth``)."""
    dead = stream.names.dead_stream
    letters, _ = await stream.find([selector], depth=depth)
    if not letters:
        return f"dead letter {selector} of {queue} is not in {dead} any more: nothing done"
    report = nats_admin.Moved()
    for letter in letters:
        step = nats_admin.retry if action == "retry" else nats_admin.remove
        await step(stream, letter, report)
    lines = []
    if report.done and action == "retry":
        lines.append(f"dead letter {', '.join(report.done)} of {queue} published again to "
                     f"{stream.names.subject} (JetStream counts its attempts afresh) and "
                     f"deleted from {dead}")
        if report.duplicates:
            lines.append(f"{report.duplicates} of them had been re-driven within the last "
                         f"2 minutes already: the server dropped the second copy")
    elif report.done:
        lines.append(f"dead letter {', '.join(report.done)} of {queue} deleted from {dead}")
    if report.malformed:
        lines.append(f"dead letter {', '.join(report.malformed)} of {queue} was left in "
                     f"{dead}: it is not an envelope a handler could take (delete it instead)")
    if report.missing:
        lines.append(f"dead letter {', '.join(report.missing)} of {queue} was gone meanwhile "
                     f"(retried or deleted by someone else): nothing done to it")
    return "; ".join(lines)


async def drain_supervisor(broker: Any, consumer: str) -> str:
    """SIGTERM the supervisor ``consumer`` if it runs on this host (it then stops taking
    work, finishes or releases what it holds, and exits: the supervisor's own drain)."""
    keys, queue = broker.keys, broker.keys.queue
    records = await redis_status.named_supervisors(broker.client, keys, [consumer])
    record = records[0] if records else None
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
