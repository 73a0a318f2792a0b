"""Does nothing: every message succeeds."""


def handle(message) -> None:
    pass
