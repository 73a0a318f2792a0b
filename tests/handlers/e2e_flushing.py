"""A buffering handler for end-to-end tests of the durability barrier (SPEC §3).

handle() buffers pids; flush() writes them to E2E_DIR/flushed, or raises when E2E_FLUSH_FAIL
is set. on_success() records the pid to E2E_DIR/succeeded. A payload with "fail" raises in
handle(): its FAILED goes out at once, ahead of the DONE of the earlier ones still held.
"""

from __future__ import annotations

import os

DIR = os.environ.get("E2E_DIR", ".")
_pending: list[str] = []


def handle(message) -> None:
    if message.payload.get("fail"):
        raise ValueError(f"{message.pid} fails on purpose")
    _pending.append(message.pid)


def flush() -> None:
    pids = list(_pending)
    _pending.clear()
    if os.environ.get("E2E_FLUSH_FAIL"):
        raise OSError("flush failed on purpose")
    with open(os.path.join(DIR, "flushed"), "a") as out:
        out.write("".join(f"{pid}\n" for pid in pids))


def on_success(message) -> None:
    with open(os.path.join(DIR, "succeeded"), "a") as out:
        out.write(f"{message.pid}\n")
