"""Publishing PHP-compatible envelopes the way queue 5's producers do: LPUSH onto a Redis
queue's ready list, or a JetStream publish with the pid as Nats-Msg-Id."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import nats
import orjson

from broker import envelope
from support.supervision import NAMESPACE, QUEUE, keys


def fresh(queue: str, count: int, **fields: Any) -> list[tuple[str, bytes]]:
    """``count`` new (pid, envelope) pairs with payload ``{"index": n}``; ``fields``
    overwrite the envelope's own fields (a forged timestamp, pid, attempt count)."""
    built = []
    for index in range(count):
        pid, raw = envelope.build(queue, {"index": index})
        if fields:
            raw = envelope.encode({**orjson.loads(raw), **fields})
        built.append((pid, raw))
    return built


def of(queue: str, payloads: Iterable[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [envelope.build(queue, payload) for payload in payloads]


async def lpush_each(client: Any, ready: str, built: list[tuple[str, bytes]]) -> list[str]:
    """One LPUSH per envelope (the first is consumed first), as a PHP producer sends them;
    returns the pids in publish order. ``client`` is a redis.asyncio client or cluster."""
    for _, raw in built:
        await client.lpush(ready, raw)
    return [pid for pid, _ in built]


def lpush_batched(client: Any, ready: str, built: list[tuple[str, bytes]]) -> list[str]:
    """LPUSH in batches of 1000 with a blocking client (the first is consumed first)."""
    for start in range(0, len(built), 1000):
        client.lpush(ready, *(raw for _, raw in built[start : start + 1000]))
    return [pid for pid, _ in built]


async def publish_nats(url: str, subject: str, built: list[tuple[str, bytes]]) -> list[str]:
    """As a queue-5 producer publishes: the envelope, Nats-Msg-Id = pid, JSON content type."""
    client = await nats.connect(url)
    js = client.jetstream()
    for pid, raw in built:
        await js.publish(subject, raw,
                         headers={"Nats-Msg-Id": pid, "Content-Type": "application/json"})
    await client.close()
    return [pid for pid, _ in built]


def publish(client: Any, payloads: list[dict[str, Any]], namespace: str = NAMESPACE) -> list[str]:
    """LPUSH envelopes onto the queue ``python -m supervisor`` serves in the end-to-end tests
    (``support.supervision``'s QUEUE), the first payload consumed first."""
    return lpush_batched(client, keys(namespace).ready, of(QUEUE, payloads))
