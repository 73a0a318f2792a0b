"""Publish stats-usage envelopes at a fixed rate (the latency runs).

    python -m bench.publisher redis://127.0.0.1:PORT/0 --rate 5000 --messages 15000

Every tick (1 ms) it publishes the messages due by then, each with its float publish time
in the payload (``t``), so the latency handler can measure handler start minus publish.
Redis: one LPUSH per tick; NATS: plain publishes into the stream's subject, one flush (a
round trip) per tick. Prints the rate achieved at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import time

TICK = 0.001


def schedule(rate: float, messages: int):
    """Yield how many messages are due at each tick until ``messages`` were handed out."""
    began, sent = time.monotonic(), 0
    while sent < messages:
        due = min(messages, int((time.monotonic() - began) * rate) + 1)
        if due > sent:
            yield due - sent
            sent = due
        pause = began + sent / rate - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, TICK))


def publish_redis(url: str, rate: float, messages: int) -> None:
    import redis

    from bench.common import NAMESPACE, QUEUE, stats_usage_payload
    from broker import envelope
    from broker.redis.keys import QueueKeys

    client = redis.Redis.from_url(url)
    key = QueueKeys(NAMESPACE, QUEUE).ready
    n = 0
    for count in schedule(rate, messages):
        now = time.time()
        raws = [envelope.build(QUEUE, stats_usage_payload(n + i, now))[1] for i in range(count)]
        client.lpush(key, *raws)
        n += count


async def publish_nats(url: str, rate: float, messages: int) -> None:
    """Plain NATS publishes (JetStream stores them; no PubAck awaited, which would make the
    publisher the busiest process), one flush per tick, and one PubAck-confirmed check at
    the end that the stream has them all."""
    import nats

    from bench.common import QUEUE, stats_usage_payload
    from bench.nats_side import NAMES
    from broker import envelope

    nc = await nats.connect(url)
    n = 0
    began, sent = time.monotonic(), 0
    while sent < messages:
        due = min(messages, int((time.monotonic() - began) * rate) + 1)
        if due > sent:
            now = time.time()
            for _ in range(due - sent):
                pid, raw = envelope.build(QUEUE, stats_usage_payload(n, now))
                await nc.publish(NAMES.subject, raw, headers={"Nats-Msg-Id": pid})
                n += 1
            await nc.flush()
            sent = due
        pause = began + sent / rate - time.monotonic()
        if pause > 0:
            await asyncio.sleep(min(pause, TICK))
    await nc.flush()
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--rate", type=float, required=True, help="messages per second")
    parser.add_argument("--messages", type=int, required=True)
    args = parser.parse_args()
    began = time.monotonic()
    if args.url.startswith(("nats://", "tls://")):
        asyncio.run(publish_nats(args.url, args.rate, args.messages))
    else:
        publish_redis(args.url, args.rate, args.messages)
    print(f"published {args.messages} at {args.messages / (time.monotonic() - began):.0f}/s",
          flush=True)


if __name__ == "__main__":
    main()
