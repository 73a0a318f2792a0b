"""Helpers for the test handlers: append a line to a file, wait for a file to exist."""

from __future__ import annotations

import os
import time


def append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as log:
        log.write(line + "\n")


def wait_for(path: str) -> None:
    """Block until the test creates ``path`` (the test's way to release a handler)."""
    while not os.path.exists(path):
        time.sleep(0.005)
