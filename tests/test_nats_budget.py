"""The attempt budget of a shared NATS consumer, as queue 5 reads it, kept current.

The consumer is shared with queue-5 PHP workers, whose ensure mode rewrites it (e.g.
MaxDeliver 4 -> 6 when their max_deliver is 5): every dead-letter verdict this broker makes
from the budget reads the consumer again first, as PHP re-reads it before parking a
delivery at the spare. An unlimited consumer (MaxDeliver -1) spares no delivery, as PHP's
spareOf() reads it. Max-deliveries advisories are drained on every receive, as PHP drains
them, not only by the next maintenance pass.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from broker.base import Action, Outcome, Settlement
from broker.nats import NatsBroker
from broker.nats import broker as nats_broker
from broker.nats.setup import QueueNames
from support.brokers import receive_all
from support.servers import NatsServer
from tests.queue5_nats import Queue5NatsWorker, php_queue

QUEUE = "stats-usage"
NAMES = QueueNames.of(QUEUE)


@pytest.fixture
async def php(nats_server: NatsServer):
    workers: list[Queue5NatsWorker] = []

    async def start(**options) -> Queue5NatsWorker:
        worker = await Queue5NatsWorker(nats_server.url, QUEUE, **options).connect()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        await worker.close()


async def dead_count(js) -> int:
    return (await js.stream_info(NAMES.dead_stream)).state.messages


async def reject_until_dead(broker: NatsBroker, js) -> list[int]:
    """Reject every delivery of the one message until it is dead: the attempts it ran."""
    ran: list[int] = []
    deadline = time.monotonic() + 30
    while not await dead_count(js):
        assert time.monotonic() < deadline, f"not dead after attempts {ran}"
        for delivery in (await broker.receive(10, 1.0)).deliveries:
            ran.append(delivery.attempts)
            [result] = await broker.settle([Settlement(Action.REJECT, delivery, "failed")])
            assert result.outcome is Outcome.OK
    return ran


async def test_a_budget_php_raised_since_adoption_is_honoured_before_dead_lettering(
    nats_brokers, php, js
):
    """We made the consumer (3 attempts: MaxDeliver 4 with the spare); a queue-5 worker
    with max_deliver 5 rewrites it to MaxDeliver 6. The failing job runs 5 times, as
    under PHP, not 3."""
    broker = await nats_brokers(QUEUE, max_attempts=3, retry_backoff=0)
    assert (broker.policy.budget, broker.policy.spare) == (3, 4)
    await php(max_deliver=5)  # ensure mode: MaxDeliver 6, spare mark
    assert (await js.consumer_info(NAMES.stream, "worker")).config.max_deliver == 6
    await broker.publish(QUEUE, {"fails": "always"})
    assert await reject_until_dead(broker, js) == [0, 1, 2, 3, 4]
    dead = await js.get_msg(NAMES.dead_stream, 1)
    assert dead.headers["Queue-Attempts"] == "5"
    assert (broker.policy.budget, broker.policy.spare) == (5, 6)


async def test_a_budget_lowered_since_adoption_is_read_by_maintenance(
    nats_brokers, js, monkeypatch, caplog
):
    monkeypatch.setattr(nats_broker, "POLICY_MAX_AGE", 0.0, raising=False)  # every pass
    broker = await nats_brokers(QUEUE, max_attempts=5)
    assert broker.policy.budget == 5
    config = (await js.consumer_info(NAMES.stream, "worker")).config
    config.max_deliver = 3
    await js.add_consumer(NAMES.stream, config)  # an update of the durable
    with caplog.at_level(logging.INFO, logger="broker.nats"):
        await broker.maintain()
    assert (broker.policy.budget, broker.policy.spare) == (2, 3)
    assert "2 attempts (MaxDeliver 3" in caplog.text


@pytest.mark.slow
async def test_an_unlimited_consumer_spares_no_delivery(nats_brokers, js):
    """MaxDeliver -1: queue 5's spareOf() is null, so a delivery whose earlier runs all
    died unsettled is run again, never parked on arrival."""
    await php_queue(js, max_deliver=-1, spare=False, ack_wait=1)
    broker = await nats_brokers(QUEUE, max_attempts=2)
    assert (broker.policy.budget, broker.policy.spare) == (2, None)
    pid = await broker.publish(QUEUE, {"x": 1})
    for attempt in range(4):  # each one lost (never settled), redelivered after ack_wait
        [held] = await receive_all(broker, 1, timeout=10)
        assert (held.pid, held.attempts) == (pid, attempt)
    assert await dead_count(js) == 0


@pytest.mark.slow
async def test_advisories_are_drained_by_receive_without_a_maintenance_pass(nats_brokers, js):
    """A consumer without a spare (queue 5's N1): the server announces the exhausted
    message; the next receive buries it, as queue 5's receive() drains the advisories."""
    await php_queue(js, max_deliver=2, spare=False, ack_wait=1)
    broker = await nats_brokers(QUEUE, max_attempts=2)
    pid = await broker.publish(QUEUE, {"x": 1})
    for attempt in range(2):
        [held] = await receive_all(broker, 1, timeout=10)
        assert (held.pid, held.attempts) == (pid, attempt)  # then lost: never settled
    deadline = time.monotonic() + 20
    while not await dead_count(js):  # no maintain() here
        assert time.monotonic() < deadline, "the advisory was not drained by receive"
        assert (await broker.receive(10, 0.25)).deliveries == []
        await asyncio.sleep(0.05)
    assert (await js.get_msg(NAMES.dead_stream, 1)).data == held.raw
    assert (await js.stream_info(NAMES.stream)).state.messages == 0
