"""The peers of ``python -m bench.mixed``: N worker processes that each run one job at a
time, with the same handler as the supervisor (``bench.mixed_jobs.run``).

    python -m bench.mixed_peers take-when-free redis://127.0.0.1:PORT/0 --processes 2
    python -m bench.mixed_peers dramatiq redis://127.0.0.1:PORT/0 --processes 2

- ``take-when-free``: a raw redis-py loop per process that takes a job only when it is free
  to run it: BLMOVE one envelope from the queue's list (the supervisor's, same envelopes) to
  a processing list, run its payload, LREM it. Nothing waits in a process behind a running
  job, so a slow or hung job holds up nothing but itself: the reference for queue latency.
- ``dramatiq``: one Dramatiq worker per process, one worker thread, its Redis broker and
  default middleware, with Dramatiq's default prefetch (twice the threads: one job may
  wait in a process behind the one it runs) and the bench's short idle back-off
  (``peer_dramatiq.IDLE_TIMEOUT_MS``).

The parent forks the processes, prints "ready" once every one is connected, and on SIGTERM
or SIGINT kills them (a run is over: nothing of theirs needs to finish, and a hung job would
never let a graceful stop end). Each process follows its parent by PDEATHSIG.

Also here: filling Dramatiq's queue for a backlog run (``fill_dramatiq``) and publishing to
it at a pace (``bench.mixed_publisher``), through Dramatiq's own enqueue.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from bench import mixed_jobs
from bench.common import NAMESPACE, QUEUE
from broker.redis.keys import QueueKeys
from worker.process import set_parent_death_signal

KEYS = QueueKeys(NAMESPACE, QUEUE)
PROCESSING = f"{KEYS.processing}.take-when-free"
DRAMATIQ_QUEUE = "bench"
DRAMATIQ_STAGING = "bench-staging"
BLOCK_SECONDS = 1  # a BLMOVE's wait; it returns at once when a job arrives


def take_when_free(url: str, ready: Any) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.ping()
    ready.release()
    while True:
        raw: Any = client.blmove(KEYS.ready, PROCESSING, BLOCK_SECONDS, "RIGHT", "LEFT")
        if raw is None:
            continue
        mixed_jobs.run(json.loads(raw)["payload"])
        client.lrem(PROCESSING, 1, raw)


def declare_dramatiq(url: str, namespace: str = "dramatiq") -> tuple[Any, Any]:
    """Dramatiq's Redis broker and the bench's actor (``mixed_jobs.run``) on it."""
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=url, namespace=namespace)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=DRAMATIQ_QUEUE, actor_name="mixed", broker=broker)
    def mixed(job: dict) -> None:
        mixed_jobs.run(job)

    return broker, mixed


def dramatiq_worker(url: str, ready: Any) -> None:
    from dramatiq import Worker

    from bench.peer_dramatiq import IDLE_TIMEOUT_MS

    broker, _ = declare_dramatiq(url)
    Worker(broker, worker_threads=1, worker_timeout=IDLE_TIMEOUT_MS).start()
    ready.release()
    threading.Event().wait()  # until killed


def fill_dramatiq(url: str, messages: int, workload: str) -> list[tuple[str, str]]:
    """Enqueue with Dramatiq itself under a staging namespace; the RENAMEs that make the
    jobs available (message hash first, then the id list), as ``peer_dramatiq.fill``."""
    broker, mixed = declare_dramatiq(url, DRAMATIQ_STAGING)
    for n in range(messages):
        mixed.send(mixed_jobs.payload(n, workload))
    broker.close()
    return [(f"{DRAMATIQ_STAGING}:{DRAMATIQ_QUEUE}.msgs", f"dramatiq:{DRAMATIQ_QUEUE}.msgs"),
            (f"{DRAMATIQ_STAGING}:{DRAMATIQ_QUEUE}", f"dramatiq:{DRAMATIQ_QUEUE}")]


PEERS: dict[str, Callable[[str, Any], None]] = {
    "take-when-free": take_when_free, "dramatiq": dramatiq_worker}


def _child(work: Callable[[str, Any], None], url: str, ready: Any, parent: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent decides
    set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    work(url, ready)


def serve(work: Callable[[str, Any], None], url: str, processes: int) -> int:
    """Fork ``processes`` running ``work``; "ready" once all are; kill them on a stop."""
    context = multiprocessing.get_context("fork")
    ready = context.Semaphore(0)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    children = [context.Process(target=_child, args=(work, url, ready, os.getpid()))
                for _ in range(processes)]
    for child in children:
        child.start()
    try:
        for _ in range(processes):
            while not ready.acquire(timeout=0.5):
                if stopping.is_set() or not all(child.is_alive() for child in children):
                    return 1
        print("ready", flush=True)
        while not stopping.wait(0.5):
            if not all(child.is_alive() for child in children):
                print("a worker process ended", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.join(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mixed_peers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("peer", choices=sorted(PEERS))
    parser.add_argument("url")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    set_parent_death_signal(signal.SIGTERM)  # the harness's: a killed harness ends us too
    return serve(PEERS[args.peer], args.url, args.processes)


if __name__ == "__main__":
    sys.exit(main())
