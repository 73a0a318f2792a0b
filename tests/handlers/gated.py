"""Waits for the file payload["gate"] to exist before it returns (a slow handler)."""

from tests.handlers._log import wait_for


def handle(message) -> None:
    if "gate" in message.payload:
        wait_for(message.payload["gate"])
