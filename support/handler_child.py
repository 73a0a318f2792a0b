"""One handler process started for a test on its own fork server, as the supervisor starts
it, with the parent's side of its rings; and the handler logs the test handlers write
(``tests/handlers/_log.py``)."""

from __future__ import annotations

import mmap
import os
import select
import time
from pathlib import Path
from typing import Any

from broker import envelope
from worker import protocol, runner
from worker.forkserver import ForkServer
from worker.handler import Handler, load
from worker.ring import Ring


class Child:
    """One handler process under test, with the parent's side of its rings."""

    def __init__(
        self, handler: str | Handler, *, flush_every: int = 100, slots: int = 256,
        slot_size: int = 256, outcome_slots: int = 256, tasks: int = 1, timeout: float = 0.0,
        alone: bool = False,
    ) -> None:
        inbox_bytes = Ring.nbytes(slots, slot_size)
        memory = mmap.mmap(-1, inbox_bytes + Ring.nbytes(outcome_slots, 64))
        view = memoryview(memory)
        self.to_child = Ring(view[:inbox_bytes], slots, slot_size, _eventfd())
        self.to_parent = Ring(view[inbox_bytes:], outcome_slots, 64, _eventfd())
        # Loaded here, before the fork server starts, as the supervisor does: the handler
        # process inherits it.
        loaded = load(handler) if isinstance(handler, str) else handler
        self.server = ForkServer(
            lambda place: runner.run(
                place, self.to_child, self.to_parent, loaded, flush_every=flush_every,
                queue="tests", tasks=tasks, timeout=timeout, alone=alone,
            )
        )
        self.events: list = []
        self.server.start()
        self.server.spawn(0)
        self.pid = self._next_event().pid
        self.next_id = 1

    def deliver(self, *payloads: dict[str, Any]) -> list[tuple[int, str]]:
        """Send one DELIVER per payload (in one batch); returns (delivery id, pid) pairs.
        The ids count from 1 as the ring numbers its deliveries, so while only this sends
        DELIVER records a test may compare the process's mark with an id."""
        sent, records = [], []
        for payload in payloads:
            pid, raw = envelope.build("tests", payload)
            sent.append((self.next_id, pid))
            records.append(protocol.encode_deliver(self.next_id, raw))
            self.next_id += 1
        self.send(*records)
        return sent

    def send(self, *records: bytes) -> None:
        assert self.to_child.put_many(records) == len(records)

    def outcomes(self, count: int, timeout: float = 30.0) -> list[tuple[str, int, Any]]:
        """Wait for the next ``count`` outcome records: (kind name, delivery id, data)."""
        got: list[tuple[str, int, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            records = self.to_parent.get_many(count - len(got))
            for record in records:
                kind, delivery_id, data = protocol.decode(record)
                got.append((protocol.KIND_NAMES[kind], delivery_id, data))
            if not records:
                assert time.monotonic() < deadline, f"only {got} arrived"
                self.to_parent.wait(0.5)
        return got

    def nothing_more(self) -> bool:
        return self.to_parent.get() is None

    def exit_status(self, timeout: float = 30.0) -> int | None:
        event = self._next_event(timeout)
        assert event.kind == "exited"
        return event.status

    def _next_event(self, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while not self.events:
            assert time.monotonic() < deadline, "no event from the fork server"
            select.select([self.server.events_fd], [], [], 0.5)
            self.events += self.server.read_events()
        return self.events.pop(0)

    def close(self) -> None:
        self.server.stop()


def _eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK)


def lines(path: Path) -> list[str]:
    """Every line of a handler log, a last one still being written included."""
    return path.read_text().splitlines() if path.exists() else []
