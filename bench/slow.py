"""A handler that sleeps 1 ms: a job that waits on something, to show scaling with coroutines
(one handler process runs one at a time; N processes overlap N waits)."""

from __future__ import annotations

import time
from typing import Any

SECONDS = 0.001


def handle(message: Any) -> None:
    time.sleep(SECONDS)
