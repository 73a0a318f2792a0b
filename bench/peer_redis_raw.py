"""The Redis raw ceiling: a plain redis-py loop, one Lua call to move 100 payloads to a
processing list and one to remove them (by value); no decoding, no handler, no ownership.

    python -m bench.peer_redis_raw redis://127.0.0.1:PORT/0 --batch 100

Prints "ready" once it waits on the empty queue; runs until SIGTERM.
"""

from __future__ import annotations

import argparse

import redis

from bench.common import NAMESPACE, QUEUE, ROOT
from broker.redis.keys import QueueKeys

KEYS = QueueKeys(NAMESPACE, QUEUE)
PROCESSING = f"{KEYS.processing}.raw"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--messages", type=int, default=0, help="(unused: runs until SIGTERM)")
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.url)
    move = client.register_script((ROOT / "bench" / "lua" / "raw_move.lua").read_text())
    remove = client.register_script((ROOT / "bench" / "lua" / "raw_remove.lua").read_text())
    client.script_load(move.script)
    client.script_load(remove.script)
    keys, batch = [KEYS.ready, PROCESSING], args.batch
    print("ready", flush=True)
    while True:
        payloads = move(keys=keys, args=[batch])
        if not payloads:  # idle: block for one, as a worker would
            payload = client.blmove(KEYS.ready, PROCESSING, 1, "RIGHT", "LEFT")
            if payload is None:
                continue
            payloads = [payload]
        remove(keys=[PROCESSING], args=payloads)


if __name__ == "__main__":
    main()
