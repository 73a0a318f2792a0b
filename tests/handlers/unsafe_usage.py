"""UNSAFE ON PURPOSE, for the soak test only: the stats-usage handler without its barrier.

``handle()`` buffers the row and returns, so the worker acknowledges the message at once;
a background thread inserts the buffer every ``INTERVAL`` seconds without anyone waiting
for it (what a buffered or ``async_insert`` client does when nobody awaits its flush).
A handler or supervisor killed in between takes the buffered rows with it, and their
messages are already acknowledged: lost. ``tests/test_soak.py`` measures how much.

Everything else is the soak's handler (``bench.chaos.handler``): the same validation,
seeded failures, ledger and store.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.chaos import handler as chaos

INTERVAL = 1.0
_lock = threading.Lock()  # the buffer is shared with the inserting thread


def init() -> None:
    chaos.init()
    threading.Thread(target=_insert_forever, name="unsafe-inserts", daemon=True).start()


def handle(message: Any) -> None:
    with _lock:
        chaos.handle(message)
    # No flush(): the worker reports success as soon as this returns.


def _insert_forever() -> None:
    while True:
        time.sleep(INTERVAL)
        try:
            with _lock:
                chaos.flush()  # inserts the buffer, then writes the ledger's "C" line
        except Exception:  # a failed insert is simply lost, as in the pattern
            pass
