"""A NATS job for end-to-end tests: its config, and messages published as the job would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
from nats.js.errors import NotFoundError

from broker.nats import NatsBroker
from broker.nats.setup import QueueNames
from support.servers import NatsServer
from support.supervision import QUEUE, write_config


def nats_config(directory: Path, server: NatsServer, **sections) -> Path:
    # 3 s: renewals every lease/3 = 1 s land 2 s before it runs out (2 s left 1 s).
    sections.setdefault("nats", {}).setdefault("ack_wait", 3.0)
    return write_config(directory, server.url, **sections)


def publish(
    server: NatsServer, payloads: list[dict], ack_wait: float = 3.0, max_attempts: int = 3
) -> list[str]:
    """Publish through a broker set up as the job will be (it creates the stream/consumer,
    and with it the attempt budget every worker of the queue adopts)."""

    async def send() -> list[str]:
        broker = NatsBroker(server.url, QUEUE, ack_wait=ack_wait, max_attempts=max_attempts)
        await broker.connect()
        try:
            return await broker.publish_many(QUEUE, payloads)
        finally:
            await broker.close()

    return asyncio.run(send())


async def queue_exists(server: NatsServer, queue: str = QUEUE) -> bool:
    """The queue's stream and its durable consumer (``worker``) exist on ``server``."""
    client = await nats.connect(server.url)
    try:
        await client.jetstream().consumer_info(QueueNames.of(queue).stream, "worker")
        return True
    except NotFoundError:
        return False
    finally:
        await client.close()
