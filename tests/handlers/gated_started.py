"""Writes its pid to E2E_DIR/started, then waits for the file payload["gate"] to exist
(a job that is surely running when a test acts, and ends when the test says)."""

import os

from tests.handlers._log import append, wait_for


def handle(message) -> None:
    append(os.path.join(os.environ["E2E_DIR"], "started"), message.pid)
    wait_for(message.payload["gate"])
