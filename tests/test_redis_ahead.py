"""Reserving ahead: a settle call's write carries the reserve for the room it frees
(``RedisBroker.reserve_ahead``), and the receive after it claims that reservation at once.

What must hold: nothing is claimed beyond what a receive asks for (prefetch), a reservation
that does not fit or whose reply was lost goes back to the ready list (in its order) before
anything else is reserved, and none is left registered at exit.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from broker.base import APPLIED, Outcome
from broker.redis import RedisBroker
from support import envelopes
from support.brokers import count_script_calls

QUEUE = "ahead"
NS = "utopia-queue"
READY = f"{NS}.queue.{QUEUE}"
RESERVATIONS = f"{NS}.reservations.{QUEUE}"


async def new_broker(url: str, client, **options: Any) -> RedisBroker:
    """A broker whose scripts' connection ran settle.lua once (what reserving ahead needs)."""
    broker = RedisBroker(url, QUEUE, consumer_id="tester", **options)
    await broker.connect()
    await publish(client, 1)
    assert await broker.commit((await broker.receive(1, 0)).deliveries) == [APPLIED]
    return broker


async def publish(client, count: int) -> list[str]:
    return await envelopes.lpush_each(client, READY, envelopes.fresh(QUEUE, count))


async def test_the_receive_after_a_settle_claims_what_it_reserved_ahead(redis_url, redis_client):
    broker = await new_broker(redis_url, redis_client)
    try:
        pids = await publish(redis_client, 6)
        first = (await broker.receive(3, 0)).deliveries
        broker.reserve_ahead(3)
        assert await broker.commit(first) == [APPLIED] * 3
        assert await redis_client.zcard(RESERVATIONS) == 1  # reserved in the settle's write
        calls = count_script_calls(broker)
        then = (await broker.receive(3, 0)).deliveries
        assert [d.pid for d in then] == pids[3:]
        assert [name for name, _ in calls] == ["claim"]  # no reserve of its own
        assert await redis_client.zcard(RESERVATIONS) == 0
        # Taken once: the next settle reserves nothing unless asked again.
        assert await broker.commit(then) == [APPLIED] * 3
        assert await redis_client.zcard(RESERVATIONS) == 0
    finally:
        await broker.close()


async def test_a_reservation_ahead_larger_than_the_receive_goes_back_first(
    redis_url, redis_client,
):
    broker = await new_broker(redis_url, redis_client)
    try:
        pids = await publish(redis_client, 6)
        first = (await broker.receive(3, 0)).deliveries
        broker.reserve_ahead(3)
        await broker.commit(first)
        # Less room than reserved (a settlement not applied): only what was asked is claimed.
        then = (await broker.receive(2, 0)).deliveries
        assert [d.pid for d in then] == pids[3:5]  # the given-back ones, in their order
        assert await redis_client.zcard(RESERVATIONS) == 0
        assert await redis_client.llen(READY) == 1
    finally:
        await broker.close()


async def test_a_lost_reply_loses_the_reserve_ahead_too_and_it_goes_back_before_more(
    redis_url, redis_client,
):
    broker = await new_broker(redis_url, redis_client)
    try:
        pids = await publish(redis_client, 6)
        first = (await broker.receive(3, 0)).deliveries
        replies = broker._wire._replies  # type: ignore[union-attr]
        # Redis runs both scripts; their replies are lost on the way back.
        replies.data_received = lambda data: replies.abort("reply lost (test)")
        broker.reserve_ahead(3)
        results = await broker.commit(first)
        assert [r.outcome for r in results] == [Outcome.UNCERTAIN] * 3
        assert await redis_client.zcard(RESERVATIONS) == 1  # it ran: 3 reserved, unknown to us
        # It ran after the settlements it was sized for: those took effect.
        assert await redis_client.llen(f"{NS}.processing.{QUEUE}") == 0
        # Nothing more is reserved ahead while that one is unresolved.
        broker.reserve_ahead(3)
        replayed = await broker.commit(first)
        assert {r.outcome for r in replayed} <= {Outcome.OK, Outcome.STALE}
        assert await redis_client.zcard(RESERVATIONS) == 1
        # The receive gives it back before it reserves: never more claimed than asked.
        calls = count_script_calls(broker)
        then = (await broker.receive(2, 0)).deliveries
        assert [d.pid for d in then] == pids[3:5]
        assert [name for name, _ in calls] == ["recover", "reserve", "claim"]
        assert await redis_client.zcard(RESERVATIONS) == 0
        assert await redis_client.llen(READY) == 1
    finally:
        await broker.close()


async def test_a_reserve_ahead_the_server_did_not_know_reserved_nothing(redis_url, redis_client):
    broker = await new_broker(redis_url, redis_client)
    try:
        pids = await publish(redis_client, 4)
        first = (await broker.receive(2, 0)).deliveries
        await redis_client.script_flush()  # both answered NOSCRIPT: neither ran
        broker.reserve_ahead(2)
        assert await broker.commit(first) == [APPLIED] * 2  # loaded and run again, once
        assert await redis_client.zcard(RESERVATIONS) == 0
        calls = count_script_calls(broker)
        then = (await broker.receive(2, 0)).deliveries
        assert [d.pid for d in then] == pids[2:]
        assert [name for name, _ in calls] == ["reserve", "claim"]
    finally:
        await broker.close()


async def test_no_reserve_ahead_before_settle_ran_on_the_connection(redis_url, redis_client):
    """A new connection may be to a restarted server, its script cache empty: settle.lua
    would answer NOSCRIPT (not run) while the reserve behind it ran, reserving room that
    was not freed. Its first settle call goes alone."""
    broker = RedisBroker(redis_url, QUEUE, consumer_id="tester")
    await broker.connect()
    try:
        await publish(redis_client, 4)
        first = (await broker.receive(2, 0)).deliveries
        assert not broker.reserve_ahead(2)
        assert await broker.commit(first[:1]) == [APPLIED]
        assert await redis_client.zcard(RESERVATIONS) == 0
        assert broker.reserve_ahead(2)  # settle.lua ran on this connection
        assert await broker.commit(first[1:]) == [APPLIED]
        assert await redis_client.zcard(RESERVATIONS) == 1
        broker._wire.close()  # type: ignore[union-attr]  # the next call: a new connection
        then = (await broker.receive(2, 0)).deliveries
        assert len(then) == 2 and not broker.reserve_ahead(2)
        await broker.commit(then)
    finally:
        await broker.close()


@pytest.mark.parametrize("lost", [False, True], ids=["kept", "reply-lost"])
async def test_a_reservation_ahead_never_claimed_goes_back_at_exit(
    redis_url, redis_client, lost,
):
    broker = await new_broker(redis_url, redis_client)
    try:
        pids = await publish(redis_client, 4)
        first = (await broker.receive(2, 0)).deliveries
        if lost:
            replies = broker._wire._replies  # type: ignore[union-attr]
            replies.data_received = lambda data: replies.abort("reply lost (test)")
        broker.reserve_ahead(2)
        await broker.commit(first)
        assert await redis_client.zcard(RESERVATIONS) == 1
        await broker.abandon([])
        assert await redis_client.zcard(RESERVATIONS) == 0
        ready = await redis_client.lrange(READY, 0, -1)
        assert [orjson.loads(raw)["pid"] for raw in reversed(ready)] == pids[2:]
    finally:
        await broker.close()
