"""Buffers messages; flush() always fails; on_error records each covered message."""

from tests.handlers._log import append

_buffered: list = []


def handle(message) -> None:
    _buffered.append(message)


def flush() -> None:
    _buffered.clear()
    raise RuntimeError("database down")


def on_error(message, error: BaseException) -> None:
    append(message.payload["log"], f"on_error {message.pid} {error}")
