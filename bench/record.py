"""A handler for the failover benchmark: appends "<pid> <monotonic seconds>" per message to
the file named by BENCH_RECORD (one write per line on an O_APPEND file, so processes never
interleave), after sleeping ``payload["sleep"]`` seconds if given."""

from __future__ import annotations

import os
import time

PATH = os.environ.get("BENCH_RECORD", "handled.txt")


def handle(message) -> None:
    pause = message.payload.get("sleep") if isinstance(message.payload, dict) else None
    if pause:
        time.sleep(pause)
    fd = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{message.pid} {time.monotonic():.4f}\n".encode())
    finally:
        os.close(fd)
