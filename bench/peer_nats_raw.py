"""The NATS raw ceiling: a plain nats-py loop that fetches 100 messages from the durable
pull consumer and acknowledges each with ``ack_sync`` (a server-confirmed ack), the acks of
one batch overlapped (``asyncio.gather``); no decoding, no handler.

    python -m bench.peer_nats_raw nats://127.0.0.1:PORT --batch 100

Prints "ready" once its first pull is waiting; runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio

import nats
from nats.errors import TimeoutError as NatsTimeout

from bench.nats_side import NAMES


async def run(url: str, batch: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    subscription = await js.pull_subscribe_bind(NAMES.consumer, NAMES.stream)
    first = asyncio.ensure_future(subscription.fetch(batch, timeout=600))
    await asyncio.sleep(0.2)  # the pull request is at the server
    print("ready", flush=True)
    msgs = await first
    while True:
        await asyncio.gather(*(msg.ack_sync() for msg in msgs))
        try:
            msgs = await subscription.fetch(batch, timeout=5)
        except (TimeoutError, NatsTimeout):
            msgs = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--messages", type=int, default=0, help="(unused: runs until SIGTERM)")
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(run(args.url, args.batch))


if __name__ == "__main__":
    main()
