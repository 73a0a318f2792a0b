"""A PHP worker frozen inside a blocking receive loses nothing (issue 23.3).

Queue 5's receive registers an empty reservation, then sends BRPOPLPUSH into it. A worker
frozen in between (SIGSTOP, a VM pause) past the deadline used to lose the next message:
a sweep unregistered the empty reservation, the late move landed in it, the claim refused
it ("reservation expired"), and nothing named that list again. Our sweep now keeps an
expired empty reservation registered for ``RESERVATION_GRACE`` seconds past its deadline.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from broker import envelope
from broker.redis import RedisBroker
from broker.redis.keys import QueueKeys
from tests.queue5 import Queue5Consumer

NS = "utopia-queue"
QUEUE = "frozen"
KEYS = QueueKeys(NS, QUEUE)


def past_deadline(client: redis.Redis, reservation: bytes) -> bool:
    deadline = client.zscore(KEYS.reservations, reservation)
    return deadline is not None and client.time()[0] >= deadline


async def sweep(broker: RedisBroker, client: redis.Redis) -> int:
    """One supervisor maintenance pass, as its timer runs it (not an operator's)."""
    client.delete(KEYS.reap_lock)
    return (await broker.maintain()).expired_reservations


@pytest.mark.slow
async def test_a_late_blocking_move_of_a_frozen_php_worker_is_recovered(redis_url, client):
    php = Queue5Consumer(client, QUEUE, namespace=NS, claim_ttl=1)
    thaw = php.receive_frozen(1, timeout=1)  # deadline: now + 1 + 1 s
    [reservation] = client.zrange(KEYS.reservations, 0, -1)
    broker = RedisBroker(redis_url, QUEUE, namespace=NS, lease=30)
    await broker.connect()
    try:
        for _ in range(500):  # whole seconds of the server clock: at most about 3 s
            if past_deadline(client, reservation):
                break
            await asyncio.sleep(0.02)
        assert past_deadline(client, reservation)
        assert await sweep(broker, client) == 0
        # Still registered: the frozen worker may yet send its move.
        assert client.zscore(KEYS.reservations, reservation) is not None

        pid, raw = envelope.build(QUEUE, {"n": 1})
        client.lpush(KEYS.ready, raw)
        with pytest.raises(redis.ResponseError, match="Queue reservation expired"):
            thaw()  # the move lands in the expired reservation; the claim refuses it
        assert client.lrange(reservation, 0, -1) == [raw]

        assert await sweep(broker, client) == 1  # back to the ready list
        assert client.zcard(KEYS.reservations) == 0
        received = await broker.receive(10, 0)
        assert [d.pid for d in received.deliveries] == [pid]
        await broker.commit(received.deliveries)
    finally:
        await broker.close()


async def test_reservations_in_their_grace_do_not_hide_the_others(redis_url, client):
    """Idle PHP workers leave an empty registration after every blocking timeout; more than
    one call's worth of them in their grace must not keep a sweep from the expired
    reservations behind them (later deadlines)."""
    now = client.time()[0]
    pipe = client.pipeline(transaction=False)
    for i in range(1500):
        pipe.zadd(KEYS.reservations, {KEYS.reservation(f"idle{i:04}"): now - 100})
    pipe.execute()
    held = KEYS.reservation("held")
    client.lpush(held, b"payload")
    client.zadd(KEYS.reservations, {held: now - 10})
    broker = RedisBroker(redis_url, QUEUE, namespace=NS)
    await broker.connect()
    try:
        assert await sweep(broker, client) == 1
        assert client.lrange(KEYS.ready, 0, -1) == [b"payload"]
        assert client.zcard(KEYS.reservations) == 1500  # still in their grace
    finally:
        await broker.close()
