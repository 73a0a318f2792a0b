"""Publish stats-usage demo messages to the queue a job file names.

    python -m examples.demo conf/stats-usage.toml --messages 1000

Each message is a PHP-compatible envelope (as `utopia-php/queue` producers write them) with a
project id and a few usage metrics; the totals it published are printed so they can be
compared with what the stats-usage handler wrote to its database.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random

from examples.stats_usage import make_payload
from supervisor.brokers import make_broker
from supervisor.config import load


def demo_payloads(count: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [
        make_payload(f"project-{rng.randrange(10)}", {
            "executions": 1, "network.requests": rng.randrange(1, 20),
            "network.bandwidth": rng.randrange(100, 10_000),
        })
        for _ in range(count)
    ]


async def publish(config_path: str, count: int) -> collections.Counter:
    config = load(config_path, import_handler=False)
    broker = make_broker(config)
    await broker.connect()
    try:
        payloads = demo_payloads(count)
        for start in range(0, count, 1000):
            await broker.publish_many(config.job.queue, payloads[start : start + 1000])
    finally:
        await broker.close()
    totals: collections.Counter = collections.Counter()
    for payload in payloads:
        for metric in payload["metrics"]:
            totals[metric["key"]] += metric["value"]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--messages", type=int, default=1000)
    args = parser.parse_args()
    totals = asyncio.run(publish(args.config, args.messages))
    print(f"published {args.messages} stats-usage messages; totals: {dict(totals)}")


if __name__ == "__main__":
    main()
