"""A process that owns a fork server with two waiting children, for the test that kills
the owner: prints {"server": pid, "children": [pid, pid]} and waits to be killed."""

from __future__ import annotations

import json
import select
import signal
from typing import NoReturn

from worker.forkserver import ForkServer


def wait_forever(slot: int) -> NoReturn:
    while True:
        signal.pause()


def main() -> None:
    server = ForkServer(wait_forever)
    server.start()
    for slot in range(2):
        server.spawn(slot)
    children: list[int] = []
    while len(children) < 2:
        select.select([server.events_fd], [], [])
        children += [event.pid for event in server.read_events() if event.kind == "started"]
    print(json.dumps({"server": server.pid, "children": children}), flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
