"""The handler of ``bench.failover_nats``: one line per call, ``<pid> <unix time>``, appended
to the file ``FAILOVER_LOG`` (one write() on an O_APPEND file: handler processes never
interleave), after ``FAILOVER_WORK_MS`` milliseconds of sleep."""

from __future__ import annotations

import os
import time

LOG = os.environ.get("FAILOVER_LOG", "failover.log")
WORK = float(os.environ.get("FAILOVER_WORK_MS", "0")) / 1000


def handle(message) -> None:
    if WORK:
        time.sleep(WORK)
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{message.pid} {time.time():.4f}\n".encode())
    finally:
        os.close(fd)
