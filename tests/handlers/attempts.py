"""Appends "<pid> <attempts> <payload type>" to the file the payload names: its "log" key,
or its first item when the payload is a JSON array."""


def handle(message) -> None:
    payload = message.payload
    path = payload["log"] if isinstance(payload, dict) else payload[0]
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{message.pid} {message.attempts} {type(payload).__name__}\n")
