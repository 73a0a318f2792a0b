"""Many consumers on one queue: the Redis work per message must not grow with their number.

The consumers' deliveries interleave in the one processing list, so a consumer's oldest
deliveries lie among everyone's, up to all outstanding ones from the tail. A settlement
that removed each of its pids with an LREM would scan further per message the more
consumers there are (bench.scaling measured 0.49 LREM per job with 8 supervisors, none with
one). Counted with INFO commandstats on a private Redis: no timing involved.
"""

from __future__ import annotations

import redis

QUEUE = "stats-usage"


def commandstats(url: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        return {name.removeprefix("cmdstat_"): int(value["calls"])
                for name, value in client.info("commandstats").items()}
    finally:
        client.close()


async def test_interleaved_consumers_settle_without_a_scan_per_message(redis_url, redis_brokers):
    consumers = [await redis_brokers(QUEUE, consumer_id=f"c{n}") for n in range(8)]
    await consumers[0].publish_many(QUEUE, [{"n": n} for n in range(800)])
    held: list[list] = [[] for _ in consumers]
    for _ in range(4):  # 4 rounds of 25 each: every consumer's batches interleave
        for mine, consumer in zip(held, consumers, strict=True):
            mine += (await consumer.receive(25, 0)).deliveries
    assert [len(mine) for mine in held] == [100] * 8
    before = commandstats(redis_url)
    for mine, consumer in zip(held, consumers, strict=True):
        for start in range(0, 100, 50):  # oldest first, 50 per settlement
            results = await consumer.commit(mine[start:start + 50])
            assert all(result.ok for result in results)
    after = commandstats(redis_url)
    assert after.get("lrem", 0) - before.get("lrem", 0) == 0
    assert await consumers[0].client.llen(consumers[0].keys.processing) == 0
