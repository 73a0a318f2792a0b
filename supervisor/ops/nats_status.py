"""``status`` of a NATS JetStream queue, read-only: stream, dead stream and consumer info.

Nothing is created here (unlike the broker's connect, which creates what is missing): a
stream or consumer that does not exist is reported as absent.

Bounded: an unreachable server is one quick try (nats-py alone would try 60 times, 2 s
apart), a silent one (a port that accepts and never speaks) ``CONNECT_TIMEOUT``, and the
whole command ``STATUS_TIMEOUT``; either ends in a ``BrokerError`` naming the server (the
CLI prints it and exits 1).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from nats.js.errors import NotFoundError

from broker import errors
from broker.base import BrokerError
from broker.nats import presence
from broker.nats import tls as nats_tls
from broker.nats.conn import quiet_error, refusal
from broker.nats.setup import IDENTITY, QueueNames, identity, read_consumer_policy
from broker.nats.tls import tls_options
from broker.urls import redact
from supervisor import logs
from supervisor.config import Config
from supervisor.logs import clean
from supervisor.ops import running

#: Seconds for one server to accept the connection and say INFO.
CONNECT_TIMEOUT = 3.0
#: Seconds for the whole command: connecting (each server of a list) and three API calls.
STATUS_TIMEOUT = 10.0


async def queue_status(config: Config) -> dict[str, Any]:
    try:
        async with asyncio.timeout(STATUS_TIMEOUT):
            return await _queue_status(config)
    except TimeoutError:
        raise BrokerError(f"NATS at {redact(config.broker.url)} did not answer within "
                          f"{STATUS_TIMEOUT:g}s") from None


async def _queue_status(config: Config) -> dict[str, Any]:
    names = QueueNames.of(config.job.queue)
    async with connected(config, "status") as client:
        try:
            js = client.jetstream(timeout=CONNECT_TIMEOUT)
            work = await _stream(js, names.stream)
            dead = await _stream(js, names.dead_stream)
            consumer = await _consumer(js, names)
            earlier = await _earlier_stream(js, config)
        except TimeoutError:
            raise silent_jetstream(config) from None
    return {
        "queue": config.job.queue,
        "broker": "nats",
        **counts(names, work, dead, consumer, config.job.max_attempts),
        "earlier_stream": earlier,
        # JetStream keeps no supervisor records: this host's, by their process titles.
        "this_host": await asyncio.to_thread(running.on_this_host, config.job.queue,
                                             config.job.slow_job_after),
        "slow_job_after": config.job.slow_job_after,
    }


async def alive(config: Config, wait: float = presence.WAIT) -> tuple[list[str], dict[str, Any]]:
    """For ``check`` and ``drain``: the supervisors of ours that answered (``"host pid"``,
    ``broker.nats.presence``) and the consumer's figures, which count every worker."""
    try:
        async with asyncio.timeout(STATUS_TIMEOUT + wait):
            return await _alive(config, wait)
    except TimeoutError:
        raise BrokerError(f"NATS at {redact(config.broker.url)} did not answer within "
                          f"{STATUS_TIMEOUT + wait:g}s") from None


async def _alive(config: Config, wait: float) -> tuple[list[str], dict[str, Any]]:
    names = QueueNames.of(config.job.queue)
    async with connected(config, "check") as client:
        answered = await presence.ask(client, names.stream, wait)
        try:
            js = client.jetstream(timeout=CONNECT_TIMEOUT)
            figures = counts(names, await _stream(js, names.stream),
                             await _stream(js, names.dead_stream), await _consumer(js, names),
                             config.job.max_attempts)
        except TimeoutError:
            raise silent_jetstream(config) from None
    return answered, figures


def counts(
    names: QueueNames, work: Any, dead: Any, consumer: Any, max_attempts: int
) -> dict[str, Any]:
    """What ``status`` and the dashboard show of a queue, from its stream, dead stream and
    consumer info (each None when absent)."""
    return {
        "stream": names.stream if work else None,
        "messages": work.state.messages if work else 0,
        "ready": consumer.num_pending if consumer else 0,
        "processing": consumer.num_ack_pending if consumer else 0,
        "redelivered": consumer.num_redelivered if consumer else 0,
        "waiting_pulls": consumer.num_waiting if consumer else 0,
        "dead": dead.state.messages if dead else 0,
        "consumer": _consumer_settings(consumer, max_attempts),
    }


@contextlib.asynccontextmanager
async def connected(config: Config, command: str) -> AsyncIterator[Any]:
    """A nats-py client of the job's NATS, closed afterwards: one quick try per server."""
    tls = config.broker.tls
    options = tls_options(config.broker.url, tls)
    try:
        client = await nats_tls.connect(
            config.broker.url, connect_timeout=CONNECT_TIMEOUT, allow_reconnect=False,
            # nats-py retries a refused server 60 times 2 s apart, reconnects or not.
            max_reconnect_attempts=1, reconnect_time_wait=0.1,
            name=f"queue-supervisor {command} {config.job.queue}", error_cb=quiet_error,
            **options,
        )
    except Exception as error:  # whatever nats-py raises: say where, and why if we know
        refused = refusal(config.broker.url, error)
        if refused is not None:
            raise refused from error
        hint = tls.hint(error) if options else ""
        raise BrokerError(
            f"cannot reach NATS at {redact(config.broker.url)}: {_describe(error)}{hint}"
        ) from error
    try:
        yield client
    finally:
        await client.close()


def silent_jetstream(config: Config) -> BrokerError:
    return BrokerError(f"NATS at {redact(config.broker.url)} took the connection, but its "
                       f"JetStream API did not answer within {CONNECT_TIMEOUT:g}s (no "
                       f"JetStream on that server, or a cluster without a leader)")


async def _earlier_stream(js: Any, config: Config) -> dict[str, Any] | None:
    """This queue's stream under the name an earlier release gave a non-ASCII queue (a
    start refuses while it exists): its name and message count, else None."""
    old = QueueNames.legacy(config.job.queue)
    info = await _stream(js, old.stream) if old else None
    if old is None or info is None:
        return None
    if (info.config.metadata or {}).get(IDENTITY) != identity(config.broker.namespace,
                                                               config.job.queue):
        return None  # another queue's own stream ("caf_" has Q_CAF_)
    return {"name": old.stream, "messages": info.state.messages}


async def _stream(js: Any, name: str) -> Any:
    try:
        return await js.stream_info(name)
    except NotFoundError:
        return None


async def _consumer(js: Any, names: QueueNames) -> Any:
    try:
        return await js.consumer_info(names.stream, names.consumer)
    except NotFoundError:
        return None


def _describe(error: BaseException) -> str:
    """As everywhere (``broker.errors.describe``), but a connect timeout says how long."""
    if isinstance(error, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT:g}s"
    return errors.describe(error)


def _consumer_settings(consumer: Any, max_attempts: int) -> dict[str, Any] | None:
    if consumer is None:
        return None
    budget, spare = read_consumer_policy(
        {"max_deliver": consumer.config.max_deliver, "metadata": consumer.config.metadata},
        max_attempts)
    return {
        "name": consumer.name,
        "ack_wait": consumer.config.ack_wait,
        "max_deliver": consumer.config.max_deliver,
        "attempts": budget,  # as the supervisor reads the consumer (queue 5's rules)
        "spare_delivery": spare,
    }


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
            f"(README, NATS JetStream)"]


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
