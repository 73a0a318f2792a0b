"""Every message fails; on_error records it."""

from tests.handlers._log import append


def handle(message) -> None:
    raise ValueError("boom")


def on_error(message, error: BaseException) -> None:
    append(message.payload["log"], f"on_error {message.pid} {type(error).__name__}")
