"""The handler of the failover benchmarks (``bench.failover``, ``bench.failover_nats``):
appends "<pid> <monotonic seconds>" per message to the file named by BENCH_RECORD (one
write per line on an O_APPEND file, so processes never interleave), after sleeping
``payload["sleep"]`` seconds if given, else BENCH_WORK_MS milliseconds."""

from __future__ import annotations

import os
import time

PATH = os.environ.get("BENCH_RECORD", "handled.txt")
WORK = float(os.environ.get("BENCH_WORK_MS", "0")) / 1000


def handle(message) -> None:
    pause = message.payload.get("sleep") if isinstance(message.payload, dict) else None
    if pause or WORK:
        time.sleep(pause or WORK)
    fd = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{message.pid} {time.monotonic():.4f}\n".encode())
    finally:
        os.close(fd)
