"""Waits for the file payload["gate"] to exist, then appends its pid to E2E_DIR/handled: a
test holds every delivery in its handlers, takes the broker away, then lets them finish."""

import os

from tests.handlers._log import append, wait_for


def handle(message) -> None:
    wait_for(message.payload["gate"])
    append(os.path.join(os.environ["E2E_DIR"], "handled"), message.pid)
