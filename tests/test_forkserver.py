"""The fork server with real processes: spawning, exit reports, and no survivors."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import psutil
import pytest

from tests.handlers.forkserver_owner import wait_forever
from worker.forkserver import SERVER_PLACE, Event, ForkServer

ROOT = Path(__file__).resolve().parent.parent


def exit_with_place_plus_ten(place: int) -> NoReturn:
    return place + 10  # type: ignore[return-value]  # the server turns it into the exit code


def raise_error(place: int) -> NoReturn:
    raise RuntimeError(f"target of place {place} failed")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (a guard against hangs, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def collect(server: ForkServer, count: int, timeout: float = 20.0) -> list[Event]:
    """Read events until ``count`` have arrived."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(events) < count:
        assert time.monotonic() < deadline, f"only {events} arrived"
        select.select([server.events_fd], [], [], 1.0)
        events += server.read_events()
    return events


@pytest.fixture
def make_server() -> Iterator[Callable[[Callable[[int], NoReturn]], ForkServer]]:
    servers: list[ForkServer] = []

    def make(target: Callable[[int], NoReturn]) -> ForkServer:
        server = ForkServer(target)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def test_children_start_exit_and_are_replaced(make_server) -> None:
    server = make_server(wait_forever)
    for place in range(3):
        server.spawn(place)
    started = collect(server, 3)
    assert sorted(event.place for event in started) == [0, 1, 2]
    assert {event.kind for event in started} == {"started"}
    assert all(psutil.Process(e.pid).ppid() == server.pid for e in started)
    assert "queue-supervisor: fork server" in " ".join(psutil.Process(server.pid).cmdline())

    victim = next(event for event in started if event.place == 1)
    os.kill(victim.pid, signal.SIGKILL)
    assert collect(server, 1) == [Event("exited", 1, victim.pid, -signal.SIGKILL)]

    server.spawn(1)
    (replacement,) = collect(server, 1)
    assert (replacement.kind, replacement.place) == ("started", 1)
    assert alive(replacement.pid)

    children = [e.pid for e in started if e.place != 1] + [replacement.pid]
    server.stop()
    assert not alive(server.pid)
    assert not any(alive(pid) for pid in children)
    exits = server.read_events()
    assert sorted(e.pid for e in exits if e.place != SERVER_PLACE) == sorted(children)
    assert exits[-1] == Event("exited", SERVER_PLACE, server.pid, 0)


def test_exit_codes_of_returning_and_raising_targets(make_server) -> None:
    returning = make_server(exit_with_place_plus_ten)
    returning.spawn(5)
    events = collect(returning, 2)
    assert [(e.kind, e.place, e.status) for e in events] == [
        ("started", 5, None), ("exited", 5, 15),
    ]
    raising = make_server(raise_error)
    raising.spawn(0)
    assert collect(raising, 2)[-1].status == 70


def test_sigterm_to_a_child_is_reported_as_minus_fifteen(make_server) -> None:
    server = make_server(wait_forever)
    server.spawn(0)
    (started,) = collect(server, 1)
    os.kill(started.pid, signal.SIGTERM)  # default action: the server reset the handlers
    assert collect(server, 1)[0].status == -signal.SIGTERM


def test_sigterm_right_after_the_fork_is_never_lost(make_server) -> None:
    """The server ignores SIGTERM (it is meant for the supervisor); a child that gets one
    before it restored the default action must still die of it."""
    server = make_server(wait_forever)
    for _ in range(30):
        server.spawn(0)
        (started,) = collect(server, 1)
        os.kill(started.pid, signal.SIGTERM)
        assert collect(server, 1)[0].status == -signal.SIGTERM


def test_killing_the_owner_leaves_no_process_behind() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.handlers.forkserver_owner"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        started = json.loads(owner.stdout.readline())  # type: ignore[union-attr]
        pids = [started["server"], *started["children"]]
        assert all(alive(pid) for pid in pids)
        owner.kill()
        owner.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in pids)), [
            pid for pid in pids if alive(pid)
        ]
    finally:
        owner.kill()
        owner.wait()
