"""init() fails: the process must report INIT_FAILED and exit with code 3."""


def init() -> None:
    raise RuntimeError("no database")


def handle(message) -> None:
    pass
