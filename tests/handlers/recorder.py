"""Writes payload["data"] to the file payload["out"] (to check large payloads arrive intact)."""


def handle(message) -> None:
    with open(message.payload["out"], "w", encoding="utf-8") as out:
        out.write(message.payload["data"])
