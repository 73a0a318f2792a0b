"""A plain handler with an async flush(): refused, as its flush would never run."""


def handle(message) -> None:
    pass


async def flush() -> None:
    pass
