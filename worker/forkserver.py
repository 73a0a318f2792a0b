"""Handler processes forked from a clean, single-threaded server process.

The supervisor starts the server before it has threads, an event loop or broker sockets
(after importing the handler module and creating the shared memory), so every child is
forked from that clean state. The supervisor asks for children over a pipe and learns
about starts and exits over another; it signals children directly by pid.

The server's lifetime is tied to the supervisor: when the request pipe reaches EOF (the
supervisor stopped or died) it SIGKILLs its children, reaps them and exits; the kernel
also SIGKILLs it when the supervisor dies (PDEATHSIG), and each child when the server dies.
It runs in a process group of its own with its children and ignores SIGINT and SIGTERM:
signals for the job go to the supervisor, which passes on what its handlers should get.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, Protocol, runtime_checkable

import setproctitle

from worker.process import CHILD_BROKEN, CHILD_ORPHANED, reset_signals, set_parent_death_signal

#: Place of the "exited" event that reports the death of the server itself.
SERVER_PLACE = -1

_REQUEST = struct.Struct("=i")  # place
_EVENT = struct.Struct("=Biii")  # kind, place, pid, status
_STARTED, _EXITED = 0, 1

# Parent-side pipe ends of every fork server of this process: a server forked later
# must not hold them, or the earlier server would never see EOF.
_PARENT_ENDS: set[int] = set()


@dataclass(slots=True, frozen=True)
class Event:
    """A child started, or exited with ``status`` (exit code, or -signal), in handler place
    ``place`` (the index its target was called with)."""

    kind: Literal["started", "exited"]
    place: int
    pid: int
    status: int | None = None


@runtime_checkable
class Spawner(Protocol):
    """What the arbiter needs of a fork server: a process for a place on request, and news
    of starts and exits. ``ForkServer`` is the real one; tests of the core play one
    (tests/inprocess.py)."""

    @property
    def events_fd(self) -> int:
        """Readable when events wait (for the event loop's reader)."""
        ...

    def spawn(self, place: int) -> None:
        """Ask for a process in ``place``; a "started" event follows."""
        ...

    def read_events(self) -> list[Event]:
        """The events that arrived since the last call (never blocks); ``SERVER_PLACE``
        in an "exited" event: the server itself is gone."""
        ...


class ForkServer:
    """The supervisor's handle on the fork server process."""

    def __init__(self, target: Callable[[int], NoReturn]) -> None:
        self._target = target
        self.pid: int | None = None
        self._requests = -1  # write end: spawn requests
        self._events = -1  # read end: events
        self._partial = b""
        self._pending: list[Event] = []
        self._server_gone = False

    @property
    def events_fd(self) -> int:
        """Readable when events wait; stays open until ``stop()``."""
        return self._events

    def start(self) -> None:
        """Fork the server now (while the process is still single-threaded)."""
        if self.pid is not None:
            raise RuntimeError("fork server already started")
        request_read, request_write = os.pipe()
        event_read, event_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            _run_server(self._target, request_read, event_write, {request_write, event_read})
        os.close(request_read)
        os.close(event_write)
        os.set_blocking(event_read, False)
        self.pid, self._requests, self._events = pid, request_write, event_read
        self._server_gone = False
        _PARENT_ENDS.update((request_write, event_read))

    def spawn(self, place: int) -> None:
        """Ask for a child running ``target(place)``; a "started" event follows."""
        if self._requests < 0:
            raise RuntimeError("fork server is not running")
        try:
            os.write(self._requests, _REQUEST.pack(place))
        except BrokenPipeError:
            raise RuntimeError("fork server is gone") from None

    def read_events(self) -> list[Event]:
        """The events that arrived since the last call (never blocks).

        If the server itself dies, the last event is ``exited`` with
        ``place == SERVER_PLACE`` and the server's pid; stop reading ``events_fd`` then
        (it stays readable at EOF until ``stop()``).
        """
        if not self._server_gone and self._events >= 0:
            self._read_available()
        events, self._pending = self._pending, []
        return events

    def stop(self, timeout: float = 5.0) -> None:
        """End the server: it SIGKILLs its children, reaps them and exits.

        Waits up to ``timeout`` seconds, then SIGKILLs the server. Events that arrive
        meanwhile are kept for ``read_events``. Safe to call more than once.
        """
        if self.pid is None or self._events < 0:
            return
        self._close_requests()
        deadline = time.monotonic() + timeout
        while not self._server_gone:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                os.kill(self.pid, signal.SIGKILL)
                self._reap_server()
                break
            select.select([self._events], [], [], remaining)
            self._read_available()
        _PARENT_ENDS.discard(self._events)
        os.close(self._events)
        self._events = -1

    def _read_available(self) -> None:
        while not self._server_gone:
            try:
                chunk = os.read(self._events, 65536)
            except BlockingIOError:
                return
            if not chunk:
                self._reap_server()
                return
            self._parse(chunk)

    def _parse(self, chunk: bytes) -> None:
        data = self._partial + chunk
        usable = len(data) - len(data) % _EVENT.size
        for kind, place, pid, status in _EVENT.iter_unpack(data[:usable]):
            if kind == _STARTED:
                self._pending.append(Event("started", place, pid))
            else:
                self._pending.append(Event("exited", place, pid, status))
        self._partial = data[usable:]

    def _reap_server(self) -> None:
        """The server is gone or going: collect its exit status and report it."""
        assert self.pid is not None
        _, status = os.waitpid(self.pid, 0)
        self._server_gone = True
        self._pending.append(
            Event("exited", SERVER_PLACE, self.pid, os.waitstatus_to_exitcode(status))
        )
        self._close_requests()

    def _close_requests(self) -> None:
        if self._requests >= 0:
            _PARENT_ENDS.discard(self._requests)
            os.close(self._requests)
            self._requests = -1


# -- the server process ------------------------------------------------------------


def _run_server(
    target: Callable[[int], NoReturn], requests: int, events: int, parent_ends: set[int]
) -> NoReturn:
    """The fork server's main function; never returns into the supervisor's code."""
    code = 0
    try:
        parent = os.getppid()
        for fd in parent_ends | _PARENT_ENDS:
            os.close(fd)
        _PARENT_ENDS.clear()
        set_parent_death_signal()
        if os.getppid() != parent:  # the supervisor died before we asked to follow it
            os._exit(CHILD_ORPHANED)
        # A process group of our own (the handlers inherit it): a signal sent to the
        # supervisor's group (`timeout`, a shell, Ctrl-C, some container runtimes) reaches
        # the supervisor alone, which then stops its handlers itself.
        os.setpgid(0, 0)
        _Server(target, requests, events).serve()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


class _Server:
    """Forks children on request, reports their starts and exits."""

    def __init__(self, target: Callable[[int], NoReturn], requests: int, events: int) -> None:
        self._target = target
        self._requests = requests
        self._events = events
        self._children: dict[int, int] = {}  # pid -> place
        self._partial = b""
        self._wake_read, self._wake_write = os.pipe()

    def serve(self) -> None:
        reset_signals()
        setproctitle.setproctitle("queue-supervisor: fork server")
        # We follow the supervisor (request pipe EOF, parent-death signal), never a signal
        # meant for it; handlers get their signals from the supervisor by pid.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)
        # The C-level handler writes a byte to the pipe, so select() wakes on SIGCHLD.
        signal.set_wakeup_fd(self._wake_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        while self._serve_once():
            pass
        self._kill_children()

    def _serve_once(self) -> bool:
        """One loop turn: False once the request pipe reached EOF."""
        readable, _, _ = select.select([self._requests, self._wake_read], [], [])
        if self._wake_read in readable:
            _drain(self._wake_read)
        self._reap(os.WNOHANG)
        if self._requests not in readable:
            return True
        chunk = os.read(self._requests, 4096)
        if not chunk:
            return False
        data = self._partial + chunk
        usable = len(data) - len(data) % _REQUEST.size
        for (place,) in _REQUEST.iter_unpack(data[:usable]):
            self._spawn(place)
        self._partial = data[usable:]
        return True

    def _spawn(self, place: int) -> None:
        server = os.getpid()
        # SIGTERM is ignored here; blocked across the fork, one sent to the new child before
        # it restored the default action stays pending (Linux queues blocked signals even
        # when ignored) and takes effect when the child unblocks it, instead of being lost.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid = os.fork()
        if pid == 0:
            inherited = (self._requests, self._events, self._wake_read, self._wake_write)
            _run_child(self._target, place, server, inherited)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self._children[pid] = place
        self._report(_STARTED, place, pid, 0)

    def _reap(self, options: int) -> None:
        """Report every child that exited (all of them, with ``options == 0``)."""
        while self._children:
            try:
                pid, status = os.waitpid(-1, options)
            except ChildProcessError:
                return
            if pid == 0:
                return
            place = self._children.pop(pid, None)
            if place is not None:
                self._report(_EXITED, place, pid, os.waitstatus_to_exitcode(status))

    def _kill_children(self) -> None:
        for pid in self._children:
            with contextlib.suppress(ProcessLookupError):  # exited already: reaped below
                os.kill(pid, signal.SIGKILL)
        self._reap(0)

    def _report(self, kind: int, place: int, pid: int, status: int) -> None:
        # A broken pipe means the supervisor is gone; EOF on the requests follows.
        with contextlib.suppress(BrokenPipeError):
            os.write(self._events, _EVENT.pack(kind, place, pid, status))


def _run_child(
    target: Callable[[int], NoReturn], place: int, server: int, inherited: tuple[int, ...]
) -> NoReturn:
    """A handler process: clean up what fork copied, then run ``target(place)``."""
    code = CHILD_BROKEN  # the target raised
    try:
        reset_signals()  # first: the server's wake-up fd is among those closed below
        for fd in inherited:
            os.close(fd)
        set_parent_death_signal()
        if os.getppid() != server:  # the server died before we asked to follow it
            os._exit(CHILD_ORPHANED)
        code = _exit_code(target(place))
    except SystemExit as exit_request:
        code = _exit_code(exit_request.code)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not stop the exit
                stream.flush()
        os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    return value if isinstance(value, int) else 1


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass
