"""Publish the mixed workload's jobs at a fixed rate (the latency runs of ``bench.mixed``).

    python -m bench.mixed_publisher redis://127.0.0.1:PORT/0 --envelopes queue5 \\
        --workload mixed --rate 150 --messages 3000

Jobs 0, 1, 2, ... in order, each with its float publish time (``bench.mixed_jobs.payload``),
on the schedule of ``bench.publisher`` (every 1 ms tick, the jobs due by then). ``queue5``:
queue-5 envelopes LPUSHed onto the queue's list (the supervisor and the take-when-free
loop); ``dramatiq``: Dramatiq's own enqueue (each message stamped just before its send).
Prints the rate achieved at the end.
"""

from __future__ import annotations

import argparse
import time

from bench import mixed_jobs
from bench.publisher import schedule


def publish_queue5(url: str, workload: str, rate: float, messages: int) -> None:
    import redis

    from bench.common import QUEUE
    from bench.mixed_peers import KEYS
    from broker import envelope

    client = redis.Redis.from_url(url)
    n = 0
    for count in schedule(rate, messages):
        now = time.time()
        client.lpush(KEYS.ready, *(envelope.build(QUEUE, mixed_jobs.payload(i, workload, now))[1]
                                   for i in range(n, n + count)))
        n += count


def publish_dramatiq(url: str, workload: str, rate: float, messages: int) -> None:
    from bench.mixed_peers import declare_dramatiq

    broker, mixed = declare_dramatiq(url)
    n = 0
    for count in schedule(rate, messages):
        for i in range(n, n + count):
            mixed.send(mixed_jobs.payload(i, workload))
        n += count
    broker.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mixed_publisher",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--envelopes", choices=("queue5", "dramatiq"), required=True)
    parser.add_argument("--workload", choices=mixed_jobs.WORKLOADS, required=True)
    parser.add_argument("--rate", type=float, required=True, help="jobs per second")
    parser.add_argument("--messages", type=int, required=True)
    args = parser.parse_args(argv)
    publish = publish_queue5 if args.envelopes == "queue5" else publish_dramatiq
    began = time.monotonic()
    publish(args.url, args.workload, args.rate, args.messages)
    print(f"published {args.messages} at {args.messages / (time.monotonic() - began):.1f}/s",
          flush=True)


if __name__ == "__main__":
    main()
