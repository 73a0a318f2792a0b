"""``status``, ``check`` and ``drain`` of a NATS JetStream queue: what they print of it.

The reading is ``broker.nats.admin``'s (read-only: a stream or consumer that does not exist
is reported as absent); the whole command is bounded by its ``STATUS_TIMEOUT``, and an
unreachable or silent server ends in a ``BrokerError`` naming it (the CLI prints it and
exits 1).
"""

from __future__ import annotations

import asyncio
from typing import Any

from broker.nats import admin, presence
from supervisor import logs
from supervisor.config import Config
from supervisor.logs import clean
from supervisor.ops import running


async def queue_status(config: Config) -> dict[str, Any]:
    url, job = config.broker.url, config.job
    async with admin.answering_within(url, admin.STATUS_TIMEOUT):
        async with admin.connected(url, config.broker.tls,
                                   f"queue-supervisor status {job.queue}") as client:
            state = await admin.queue_status(client, url, job.queue, config.broker.namespace,
                                             job.max_attempts)
        return {
            **state,
            # JetStream keeps no supervisor records: this host's, by their process titles.
            "this_host": await asyncio.to_thread(running.on_this_host, job.queue,
                                                 job.slow_job_after),
            "slow_job_after": job.slow_job_after,
        }


async def alive(config: Config, wait: float = presence.WAIT) -> tuple[list[str], dict[str, Any]]:
    """For ``check`` and ``drain``: ``broker.nats.admin.alive`` of the job's queue."""
    return await admin.alive(config.broker.url, config.broker.tls, config.job.queue,
                             config.job.max_attempts, wait)


def describe(state: dict[str, Any]) -> list[str]:
    consumer = state["consumer"]
    return [
        f"queue {state['queue']} (NATS stream {state['stream'] or 'absent'})",
        f"  ready         {state['ready']} (messages in the stream: {state['messages']})",
        f"  processing    {state['processing']} (delivered, not yet acknowledged)",
        f"  redelivered   {state['redelivered']}",
        f"  dead          {state['dead']}",
        f"  consumer      {consumer['name']}: ack_wait {consumer['ack_wait']}s, "
        f"max_deliver {consumer['max_deliver']} ({consumer['attempts']} attempts"
        f"{', then a spare delivery' if consumer['spare_delivery'] else ''}), "
        f"{state['waiting_pulls']} waiting pulls"
        if consumer else "  consumer      absent",
        *_earlier_lines(state.get("earlier_stream")),
        *_this_host_lines(state["queue"], state.get("this_host", []),
                          state.get("slow_job_after", 0.0)),
    ]


def _this_host_lines(queue: str, found: list[dict[str, Any]], slow_after: float) -> list[str]:
    """This host's supervisors of the queue and the jobs their handlers' titles name."""
    jobs = [job for supervisor in found for job in supervisor["jobs"]]
    lines = [f"  this host     {len(found)} supervisor{'s' if len(found) != 1 else ''} of "
             f"{queue} (by their process titles: "
             "run status on each host for its own), running "
             f"{running.summary(jobs, sum(job['in_process'] for job in jobs))}"]
    for supervisor in found:
        lines.append(f"    pid {supervisor['pid']}  {logs.clean(supervisor['title'])}")
        lines += [f"      {running.job_line(job, slow_after)}" for job in supervisor["jobs"]]
    return lines


def _earlier_lines(earlier: dict[str, Any] | None) -> list[str]:
    if earlier is None:
        return []
    return [f"  earlier name  stream {earlier['name']} still exists ({earlier['messages']} "
            f"messages): supervisors refuse to start until it is drained and deleted "
            f"(docs/nats.md)"]


def describe_alive(queue: str, answered: list[str], figures: dict[str, Any]) -> list[str]:
    """``check``'s (and ``drain``'s) verdict on a NATS queue."""
    theirs = (f"  (the consumer has {figures['processing']} unacknowledged deliveries and "
              f"{figures['waiting_pulls']} waiting pulls, {figures['ready']} ready and "
              f"{figures['dead']} dead letters: the workers still consuming, such as "
              "queue-5 workers, hold them; a supervisor that cannot answer would count "
              "there too)")
    if not answered:
        return [f"ok: no supervisor of ours answers on {queue} (NATS): JetStream keeps "
                "every delivery, retry and dead letter for the workers left", theirs]
    lines = [f"not empty: {queue} (NATS) still has, of this project's supervisors",
             f"  {len(answered)} alive (stop them: `drain` on their host)"]
    for where in answered:
        host, _, pid = where.rpartition(" ")
        lines.append(f"    host {clean(host)} pid {clean(pid)}" if host else
                     f"    {clean(where)}")
    return [*lines, theirs]
