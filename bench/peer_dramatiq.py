"""The Dramatiq peer: one worker process with one thread, its Redis broker, a no-op actor.

    dramatiq_queue_prefetch=100 python -m bench.peer_dramatiq redis://127.0.0.1:PORT/0

The harness fills the queue with Dramatiq's own enqueue (``fill``) under a staging
namespace and RENAMEs the two keys into place, as for the supervisor. The worker runs
Dramatiq's default middleware, as ``dramatiq -p 1 -t 1`` would. Prints "ready", then runs
until SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

QUEUE_NAME = "bench"
STAGING = "bench-staging"
#: Milliseconds the idle consumer backs off at most (Dramatiq's default is 1,000): a short
#: one so the run does not start with the worker asleep; it costs nothing once busy.
IDLE_TIMEOUT_MS = 10


def declare(url: str, namespace: str = "dramatiq") -> Any:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=url, namespace=namespace)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=QUEUE_NAME, actor_name="noop", broker=broker)
    def noop(payload: dict) -> None:
        """Succeed at once."""

    return broker, noop


def fill(url: str, messages: int) -> list[tuple[str, str]]:
    """Enqueue with Dramatiq itself under the staging namespace; the RENAMEs that make the
    messages available (message hash first, then the id list)."""
    from bench.common import stats_usage_payload

    broker, noop = declare(url, STAGING)
    for n in range(messages):
        noop.send(stats_usage_payload(n))
    broker.close()
    return [(f"{STAGING}:{QUEUE_NAME}.msgs", f"dramatiq:{QUEUE_NAME}.msgs"),
            (f"{STAGING}:{QUEUE_NAME}", f"dramatiq:{QUEUE_NAME}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--messages", type=int, default=0, help="(unused: runs until SIGTERM)")
    args = parser.parse_args()
    from dramatiq import Worker

    broker, _ = declare(args.url)
    worker = Worker(broker, worker_threads=1, worker_timeout=IDLE_TIMEOUT_MS)
    worker.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    print("ready", flush=True)
    stopped.wait()
    worker.stop()
    broker.close()
    os._exit(0)


if __name__ == "__main__":
    main()
