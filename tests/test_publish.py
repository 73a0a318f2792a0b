"""Publishing onto Redis queues, checked against a real redis-server."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis.asyncio as aioredis

from broker import envelope
from broker.redis.keys import QueueKeys
from broker.redis.publish import Publisher, PublishError, publish, publish_many

NS = "utopia-queue"


async def consume_all(client: aioredis.Redis, queue: str) -> list[bytes]:
    """Everything in the ready list, in the order consumers take it (from the right)."""
    return list(reversed(await client.lrange(QueueKeys(NS, queue).ready, 0, -1)))


async def test_publish_writes_a_php_compatible_envelope(redis_client):
    pid = await publish(redis_client, NS, "v1-mails", {"url": "https://a.example/x", "n": 1})
    [raw] = await consume_all(redis_client, "v1-mails")
    assert len(pid) == 23
    assert b'"url":"https:\\/\\/a.example\\/x"' in raw
    decoded = envelope.decode(raw)
    assert decoded["pid"] == pid
    assert decoded["queue"] == "v1-mails"
    assert decoded["payload"] == {"url": "https://a.example/x", "n": 1}
    assert isinstance(decoded["timestamp"], int)


async def test_empty_payload_is_written_as_a_json_array(redis_client):
    await publish(redis_client, NS, "q", {})
    [raw] = await consume_all(redis_client, "q")
    assert orjson.loads(raw)["payload"] == []
    assert b'"payload":[]' in raw


async def test_publish_keeps_order(redis_client):
    pids = [await publish(redis_client, NS, "q", {"i": i}) for i in range(5)]
    assert [envelope.decode(raw)["pid"] for raw in await consume_all(redis_client, "q")] == pids


async def test_publish_many_sends_2500_in_chunks_in_order(redis_client):
    lpush_sizes: list[int] = []
    original = redis_client.pipeline

    def recording_pipeline(*args, **kwargs):
        pipe = original(*args, **kwargs)
        lpush = pipe.lpush

        def recorded(key, *values):
            lpush_sizes.append(len(values))
            return lpush(key, *values)

        pipe.lpush = recorded
        return pipe

    redis_client.pipeline = recording_pipeline
    pids = await publish_many(redis_client, NS, "q", [{"i": i} for i in range(2500)])
    assert lpush_sizes == [1000, 1000, 500]
    taken = [envelope.decode(raw) for raw in await consume_all(redis_client, "q")]
    assert [message["pid"] for message in taken] == pids
    assert [message["payload"]["i"] for message in taken] == list(range(2500))
    assert len(set(pids)) == 2500


async def test_publish_many_of_nothing_sends_nothing(redis_client):
    assert await publish_many(redis_client, NS, "q", []) == []
    assert await redis_client.exists(QueueKeys(NS, "q").ready) == 0


async def test_publisher_delivers_10000_exactly_once_in_order(redis_client):
    publisher = Publisher(redis_client, NS)
    pids = [await publisher.enqueue("q", {"i": i}) for i in range(10_000)]
    await publisher.flush()
    assert publisher.pending == 0
    taken = [envelope.decode(raw)["pid"] for raw in await consume_all(redis_client, "q")]
    assert taken == pids
    await publisher.close()


async def test_publisher_spreads_over_queues(redis_client):
    publisher = Publisher(redis_client, NS)
    sent = {"a": [], "b": []}
    for i in range(300):
        queue = "a" if i % 3 else "b"
        sent[queue].append(await publisher.enqueue(queue, {"i": i}))
    await publisher.close()
    for queue, pids in sent.items():
        taken = [envelope.decode(raw)["pid"] for raw in await consume_all(redis_client, queue)]
        assert taken == pids


async def test_enqueue_waits_for_room_when_the_buffer_is_full(redis_client):
    publisher = Publisher(redis_client, NS, max_buffer=3)
    pids = []
    for i in range(50):
        pids.append(await publisher.enqueue("q", {"i": i}))
        assert publisher.pending <= 3
    await publisher.close()
    assert [envelope.decode(r)["pid"] for r in await consume_all(redis_client, "q")] == pids


async def test_enqueue_rejects_a_payload_that_is_not_a_dict(redis_client):
    publisher = Publisher(redis_client, NS)
    with pytest.raises(TypeError):
        await publisher.enqueue("q", ["not", "a", "dict"])  # type: ignore[arg-type]
    await publisher.close()


async def test_a_send_error_surfaces_from_flush_and_nothing_is_lost(own_redis_server):
    client = aioredis.from_url(own_redis_server.url, socket_connect_timeout=1, retry=None)
    publisher = Publisher(client, NS)
    try:
        first = await publisher.enqueue("q", {"i": 0})
        await publisher.flush()
        own_redis_server.stop()
        later = [await publisher.enqueue("q", {"i": i}) for i in range(1, 4)]
        with pytest.raises(PublishError) as raised:
            await publisher.flush()
        assert raised.value.unsent == 3
        assert raised.value.__cause__ is not None
        assert publisher.pending == 3

        own_redis_server.start()  # empty again: no persistence
        await publisher.flush()  # the next flush sends the kept messages
        taken = [envelope.decode(raw)["pid"] for raw in await consume_all(client, "q")]
        assert taken == later
        assert first not in taken
    finally:
        await publisher.close()
        await client.aclose()


async def test_close_raises_what_could_not_be_sent(own_redis_server):
    client = aioredis.from_url(own_redis_server.url, socket_connect_timeout=1, retry=None)
    publisher = Publisher(client, NS)
    try:
        own_redis_server.stop()
        await publisher.enqueue("q", {"i": 1})
        with pytest.raises(PublishError):
            await publisher.close()
        with pytest.raises(RuntimeError):
            await publisher.enqueue("q", {"i": 2})
    finally:
        await client.aclose()


async def test_a_full_buffer_reports_a_send_error_instead_of_waiting(own_redis_server):
    client = aioredis.from_url(own_redis_server.url, socket_connect_timeout=1, retry=None)
    publisher = Publisher(client, NS, max_buffer=2)
    try:
        own_redis_server.stop()
        await publisher.enqueue("q", {"i": 1})
        await publisher.enqueue("q", {"i": 2})
        with pytest.raises(PublishError):
            await asyncio.wait_for(publisher.enqueue("q", {"i": 3}), 30)
    finally:
        own_redis_server.start()
        await publisher.close()
        assert await client.llen(QueueKeys(NS, "q").ready) == 2
        await client.aclose()
