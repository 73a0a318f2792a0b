"""Fails (ValueError) while ``message.attempts`` is below the payload's "succeed_at"; then
appends "<pid> <attempts>" to the file the payload's "log" names."""

from tests.handlers._log import append


def handle(message) -> None:
    if message.attempts < message.payload["succeed_at"]:
        raise ValueError(f"attempt {message.attempts} fails on purpose")
    append(message.payload["log"], f"{message.pid} {message.attempts}")
