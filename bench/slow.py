"""A slow handler for the bench: each message waits 1 ms (a sleep, as a handler blocked on
I/O would), so its throughput shows how work spreads over handler processes."""

from __future__ import annotations

import time

WAIT = 0.001


def handle(message) -> None:
    time.sleep(WAIT)
