"""``status`` of a NATS JetStream queue, read-only: stream, dead stream and consumer info.

Nothing is created here (unlike the broker's connect, which creates what is missing): a
stream or consumer that does not exist is reported as absent.
"""

from __future__ import annotations

from typing import Any

from nats.js.errors import NotFoundError

from broker.base import BrokerError
from broker.nats import tls as nats_tls
from broker.nats.conn import quiet_error, refusal
from broker.nats.setup import QueueNames, read_consumer_policy
from broker.nats.tls import tls_options
from broker.urls import redact
from supervisor.config import Config

CONNECT_TIMEOUT = 5.0


async def queue_status(config: Config) -> dict[str, Any]:
    names = QueueNames.of(config.job.queue)
    tls = config.broker.tls
    options = tls_options(config.broker.url, tls)
    try:
        client = await nats_tls.connect(
            config.broker.url, connect_timeout=CONNECT_TIMEOUT, allow_reconnect=False,
            name=f"queue-supervisor status {config.job.queue}", error_cb=quiet_error, **options,
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
        js = client.jetstream()
        work = await _stream(js, names.stream)
        dead = await _stream(js, names.dead_stream)
        consumer = await _consumer(js, names)
    finally:
        await client.close()
    return {
        "queue": config.job.queue,
        "broker": "nats",
        "stream": names.stream if work else None,
        "messages": work.state.messages if work else 0,
        "ready": consumer.num_pending if consumer else 0,
        "processing": consumer.num_ack_pending if consumer else 0,
        "redelivered": consumer.num_redelivered if consumer else 0,
        "waiting_pulls": consumer.num_waiting if consumer else 0,
        "dead": dead.state.messages if dead else 0,
        "consumer": _consumer_settings(consumer, config.job.max_attempts),
    }


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
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


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
    ]
