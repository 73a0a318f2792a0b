"""The fork server with real processes: spawning, exit reports, no survivors, and the
generations of the code a reload brings."""

from __future__ import annotations

import importlib
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
from worker.forkserver import SERVER_PLACE, Event, ForkServer, Loaded, LoadError

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
    # Forked by the handler server of the first generation, itself forked by the root.
    [handler_server] = {psutil.Process(e.pid).ppid() for e in started}
    assert psutil.Process(handler_server).ppid() == server.pid
    assert "queue-supervisor: fork server" in " ".join(psutil.Process(server.pid).cmdline())
    assert "queue-supervisor: handler server 1" in " ".join(
        psutil.Process(handler_server).cmdline())

    victim = next(event for event in started if event.place == 1)
    os.kill(victim.pid, signal.SIGKILL)
    assert collect(server, 1) == [Event("exited", 1, victim.pid, -signal.SIGKILL, 1)]

    server.spawn(1)
    (replacement,) = collect(server, 1)
    assert (replacement.kind, replacement.place) == ("started", 1)
    assert alive(replacement.pid)

    children = [e.pid for e in started if e.place != 1] + [replacement.pid]
    server.stop()
    assert not alive(server.pid) and not alive(handler_server)
    assert not any(alive(pid) for pid in children)
    # The children killed at the end are not reported: a root killed ends its handler
    # server the same way (its pipe's EOF may come before the kernel's SIGKILL), and a
    # process reported killed would read as a worker lost, its job blamed.
    assert server.read_events() == [Event("exited", SERVER_PLACE, server.pid, 0)]


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


@pytest.mark.slow
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


# -- generations of the code (reloads) -------------------------------------------------------


def versioned(directory: Path) -> Callable[[], Loaded]:
    """A load function that imports ``versioned`` from ``directory`` (the test process never
    imports it: each handler server does, from the file as it is then) and reports its VERSION;
    its processes wait to be killed."""

    def load() -> Loaded:
        sys.path.insert(0, str(directory))
        module = importlib.import_module("versioned")
        return Loaded(wait_forever, module.VERSION)

    return load


def write_version(directory: Path, code: str) -> None:
    (directory / "versioned.py").write_text(code)


@pytest.fixture
def reloadable(tmp_path) -> Iterator[tuple[ForkServer, Path]]:
    write_version(tmp_path, "VERSION = 'one'\n")
    server = ForkServer(load=versioned(tmp_path))
    assert server.start() == "one"
    yield server, tmp_path
    server.stop()


@pytest.mark.slow
def test_a_reload_imports_the_edited_module_and_the_old_generation_exits_after_its_children(
    reloadable,
) -> None:
    server, directory = reloadable
    server.spawn(0)
    [old_child] = collect(server, 1)
    old_server = psutil.Process(old_child.pid).ppid()
    write_version(directory, "VERSION = 'two-two'\n")
    generation = server.reload()
    [loaded] = collect(server, 1)
    assert (loaded.kind, loaded.generation, loaded.detail) == ("loaded", 2, "two-two")
    server.adopt(generation)
    server.spawn(1)
    [new_child] = collect(server, 1)
    assert (new_child.kind, new_child.generation) == ("started", 2)
    assert psutil.Process(new_child.pid).ppid() == loaded.pid != old_server
    # Retired, the old handler server waits for its child; then it exits.
    time.sleep(1)
    assert alive(old_server) and alive(old_child.pid)
    assert "handler server 1 (replaced)" in " ".join(psutil.Process(old_server).cmdline())
    os.kill(old_child.pid, signal.SIGTERM)
    assert collect(server, 2) == [Event("exited", 0, old_child.pid, -signal.SIGTERM, 1),
                                  Event("retired", SERVER_PLACE, old_server, 0, 1)]
    assert alive(new_child.pid)


@pytest.mark.slow
def test_a_failed_import_is_reported_and_the_adopted_code_keeps_serving(reloadable) -> None:
    server, directory = reloadable
    write_version(directory, "VERSION = (\n")
    assert server.reload() == 2
    [failed] = collect(server, 1)
    assert (failed.kind, failed.generation) == ("load_failed", 2)
    assert "SyntaxError" in failed.detail  # not a ValueError: its type, and a traceback
    wait_until(lambda: not alive(failed.pid))
    server.spawn(0)
    [started] = collect(server, 1)
    assert (started.kind, started.generation) == ("started", 1)
    time.sleep(1)
    assert server.read_events() == []  # the failed server's exit is no news


def test_a_handler_server_killed_while_importing_is_a_failed_load(reloadable) -> None:
    server, directory = reloadable
    write_version(directory, "import time\ntime.sleep(30)\nVERSION = 'slow'\n")
    server.reload()
    root = psutil.Process(server.pid)
    wait_until(lambda: len(root.children()) == 2)
    [importing] = [p for p in root.children() if "handler server 2" in " ".join(p.cmdline())]
    importing.kill()
    [failed] = collect(server, 1)
    assert failed == Event("load_failed", SERVER_PLACE, importing.pid, -signal.SIGKILL, 2,
                           f"the handler server (pid {importing.pid}) exited (killed by "
                           "SIGKILL) while it imported the handler")


def test_the_adopted_handler_server_killed_is_the_end_of_its_processes(reloadable) -> None:
    server, _ = reloadable
    server.spawn(0)
    [child] = collect(server, 1)
    handler_server = psutil.Process(child.pid).ppid()
    os.kill(handler_server, signal.SIGKILL)
    [gone] = collect(server, 1)
    assert gone == Event("exited", SERVER_PLACE, handler_server, -signal.SIGKILL, 1)
    assert wait_until(lambda: not alive(child.pid))  # PDEATHSIG


def test_stop_ends_every_generation_at_once_whatever_it_holds(reloadable) -> None:
    """Each handler server must see its own pipe's EOF, and a server forked later must not
    hold the pipes of those before (each reload would leave one more open in it)."""
    server, directory = reloadable
    server.spawn(0)
    write_version(directory, "VERSION = 'two'\n")
    server.adopt(server.reload())
    server.spawn(1)
    events = collect(server, 3)
    children = [event.pid for event in events if event.kind == "started"]
    servers = [event.pid for event in events if event.kind == "loaded"]
    assert len(children) == 2 and len(servers) == 1
    # The second holds what the first does: not the first one's request pipe too.
    first = psutil.Process(children[0]).ppid()
    assert psutil.Process(servers[0]).num_fds() == psutil.Process(first).num_fds()
    began = time.monotonic()
    server.stop()
    assert time.monotonic() - began < 3  # not the 5 s timeout
    assert server.read_events()[-1] == Event("exited", SERVER_PLACE, server.pid, 0)
    assert not any(alive(pid) for pid in [*children, *servers])


def test_a_load_that_fails_at_start_raises_with_everything_stopped(tmp_path) -> None:
    write_version(tmp_path, "raise RuntimeError('no settings')\n")
    server = ForkServer(load=versioned(tmp_path))
    with pytest.raises(LoadError, match="RuntimeError: no settings"):
        server.start()
    assert server.pid is not None and not alive(server.pid)
