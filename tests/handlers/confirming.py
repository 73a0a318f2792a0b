"""Succeeds; on_success records the messages whose commit was confirmed."""

from tests.handlers._log import append


def handle(message) -> None:
    pass


def on_success(message) -> None:
    append(message.payload["log"], f"success {message.pid}")
