"""Handler processes forked from clean, single-threaded servers; a reload imports the handler
code afresh in a new one.

Three levels of processes::

    supervisor -> fork server (the root) -> handler server N -> handler processes

The supervisor forks the root at start, before it has threads, an event loop or broker
sockets, and without ever importing the handler itself. The root never imports it either: for
each generation of the code (one at start, one per reload) it forks a handler server, which
imports the handler (``load``) and then forks the handler processes of its generation, which
share the imported code copy-on-write. A reload is thus gunicorn's HUP without
``preload_app``: the new handler server imports the handler module, and whatever it imports
that the supervisor had not imported before forking the root, from the files as they are now.
The supervisor could not fork a clean server itself later: by then it has a metrics thread
and broker connections, which a fork would copy half-way. Nor could a server that keeps the
handler loaded import it anew by removing modules from ``sys.modules``: the handler's module
alone leaves the helpers it imports old, and everything its import brought in includes C
extensions, which do not survive a second import in one process. So the root stays clean,
and the supervisor learns what it needs of the handler from the report of its handler server
(worker.handler.Shape); its own memory holds none of the handler's.

The supervisor decides everything: the root forks a handler server when asked (``reload``),
passes each spawn request to the generation the supervisor adopted last, and tells a
generation to retire. A retired handler server forks nothing more and exits once its last
process has exited (each finishes its work first: the supervisor retires them), so the
handler module is held twice only while a reload replaces processes. A handler server whose
import failed reports why and exits; the supervisor keeps the generation it has.

Every server reports on one pipe to the supervisor: starts and exits of handler processes,
the outcome of an import (handler servers), the exit of a handler server (the root). Each
report is one write of at most PIPE_BUF bytes, so the reports of several writers never mix.

Lifetimes are chained: the kernel SIGKILLs the root when the supervisor dies, a handler
server when the root dies and a handler process when its handler server dies (PDEATHSIG;
each also checks that its parent did not die before it asked). When the request pipe
reaches EOF (the supervisor stopped or died) the root closes the request pipes of its
handler servers, which SIGKILL their children, reap them and exit, reporting nothing more;
the root reaps them and exits. Every server closes the pipe ends of the others it inherited
through fork: an old handler server must see its own pipe's EOF, and a new one must not hold
it open. The servers run in a process group of their own with their children and ignore
SIGINT, SIGTERM and SIGHUP: signals for the job go to the supervisor, which passes on what its
handlers should get.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, NoReturn, Protocol, runtime_checkable

import setproctitle

from broker.errors import describe
from worker.process import CHILD_BROKEN, CHILD_ORPHANED, reset_signals, set_parent_death_signal

#: Place of the events about the servers themselves (not about a handler process).
SERVER_PLACE = -1

_REQUEST = struct.Struct("=Bii")  # operation, generation, place: supervisor -> root
_LOAD, _SPAWN, _RETIRE = 0, 1, 2
_SERVER_REQUEST = struct.Struct("=i")  # place, or _RETIRE_PLACE: root -> handler server
_RETIRE_PLACE = -1
#: kind, generation, place, pid, status, length of the text that follows: servers -> supervisor
_EVENT = struct.Struct("=BiiiiH")
_STARTED, _EXITED, _LOADED, _LOAD_FAILED, _SERVER_EXITED = range(5)
#: The longest text of one event: the whole event is one atomic pipe write.
DETAIL_LIMIT = select.PIPE_BUF - _EVENT.size

# Parent-side pipe ends of every fork server of this process: a server forked later
# must not hold them, or the earlier server would never see EOF.
_PARENT_ENDS: set[int] = set()


@dataclass(slots=True, frozen=True)
class Event:
    """A handler process started, or exited with ``status`` (exit code, or -signal), in
    handler place ``place`` (the index its target was called with), forked by the handler
    server of ``generation``.

    With ``place == SERVER_PLACE``, news of the servers: the handler server of
    ``generation`` "loaded" the code (``detail``: its report) or could not ("load_failed",
    ``detail``: why), or "retired": it exited once the last of its processes was gone.
    "exited": a server died that the job needs (the root, whose ``generation`` is 0, or a
    handler server whose processes are needed): there will be no more handler processes.
    """

    kind: Literal["started", "exited", "loaded", "load_failed", "retired"]
    place: int
    pid: int
    status: int | None = None
    generation: int = 0
    detail: str = ""


@dataclass(slots=True, frozen=True)
class Loaded:
    """What ``load`` gives, in a handler server: the target each of its processes runs
    (``target(place)``), and a report for the supervisor (at most DETAIL_LIMIT bytes)."""

    target: Callable[[int], NoReturn]
    report: str = ""


class LoadError(Exception):
    """The first handler server could not load the code; the message says why."""


@runtime_checkable
class Spawner(Protocol):
    """What the arbiter needs of a fork server: a process for a place on request, news of
    starts and exits, and the code reloaded. ``ForkServer`` is the real one; tests of the
    core play one (tests/inprocess.py)."""

    @property
    def events_fd(self) -> int:
        """Readable when events wait (for the event loop's reader)."""
        ...

    def spawn(self, place: int) -> None:
        """Ask for a process in ``place``, running the adopted code; a "started" event
        follows."""
        ...

    def read_events(self) -> list[Event]:
        """The events that arrived since the last call (never blocks); "exited" with
        ``SERVER_PLACE``: there will be no more handler processes."""
        ...

    def reload(self) -> int:
        """Load the code anew; returns the generation whose "loaded" or "load_failed"
        event follows."""
        ...

    def adopt(self, generation: int) -> None:
        """Spawn from ``generation`` (loaded) from now on; the one before retires: it exits
        once its processes did (a "retired" event)."""
        ...

    def discard(self, generation: int) -> None:
        """A loaded generation is not wanted: it exits."""
        ...


class ForkServer:
    """The supervisor's handle on the fork server (the root) and its handler servers.

    ``load`` runs in each handler server and gives what its processes run; a fixed
    ``target`` instead runs the same code in every generation.
    """

    def __init__(
        self,
        target: Callable[[int], NoReturn] | None = None,
        *,
        load: Callable[[], Loaded] | None = None,
    ) -> None:
        if load is None:
            if target is None:
                raise TypeError("ForkServer needs a target or a load function")
            load = _fixed(target)
        self._load = load
        self.pid: int | None = None  # the root's
        self.generation = 0  # the adopted one: spawn requests go to it (0: none yet)
        self._last_generation = 0
        self._loading: set[int] = set()
        self._adopted: set[int] = set()
        self._done: set[int] = set()  # retired, discarded or failed: its server's exit is due
        self._children: dict[int, int] = {}  # pid -> generation, from start to exit
        self._requests = -1  # write end: requests
        self._events = -1  # read end: events
        self._partial = b""
        self._pending: list[Event] = []
        self._server_gone = False
        self._stopping = False

    @property
    def events_fd(self) -> int:
        """Readable when events wait; stays open until ``stop()``."""
        return self._events

    def start(self) -> str:
        """Fork the root now (while the process is still single-threaded) and wait until the
        first handler server loaded the code; returns its report. Raises LoadError (with
        everything stopped) when it could not."""
        if self.pid is not None:
            raise RuntimeError("fork server already started")
        request_read, request_write = os.pipe()
        event_read, event_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            _run_root(self._load, request_read, event_write, {request_write, event_read})
        os.close(request_read)
        os.close(event_write)
        os.set_blocking(event_read, False)
        self.pid, self._requests, self._events = pid, request_write, event_read
        self._server_gone = False
        _PARENT_ENDS.update((request_write, event_read))
        first = self.reload()
        while True:
            select.select([self._events], [], [])
            self._read_available()
            for event in self._pending:
                if event.generation == first and event.kind == "loaded":
                    self._pending.remove(event)
                    self.adopt(first)
                    return event.detail
                if event.kind == "load_failed" or event.place == SERVER_PLACE:
                    self.stop()
                    raise LoadError(event.detail or f"the fork server exited "
                                                    f"({status_text(event.status)})")

    def spawn(self, place: int) -> None:
        """Ask for a child running the adopted code's ``target(place)``; a "started" event
        follows."""
        if not self.generation:
            raise RuntimeError("no code is loaded")
        self._request(_SPAWN, self.generation, place)

    def reload(self) -> int:
        self._last_generation += 1
        generation = self._last_generation
        self._loading.add(generation)
        self._request(_LOAD, generation)
        return generation

    def adopt(self, generation: int) -> None:
        previous, self.generation = self.generation, generation
        self._adopted.add(generation)
        if previous:
            self._retire(previous)

    def discard(self, generation: int) -> None:
        self._retire(generation)

    def read_events(self) -> list[Event]:
        """The events that arrived since the last call (never blocks).

        If the root dies, the last event is ``exited`` with ``place == SERVER_PLACE`` and
        the root's pid; stop reading ``events_fd`` then (it stays readable at EOF until
        ``stop()``).
        """
        if not self._server_gone and self._events >= 0:
            self._read_available()
        events, self._pending = self._pending, []
        return events

    def stop(self, timeout: float = 5.0) -> None:
        """End the servers: each SIGKILLs its children (unreported), reaps them and exits.

        Waits up to ``timeout`` seconds, then SIGKILLs the root (the handler servers and
        their children follow it). Events that arrive meanwhile are kept for
        ``read_events``. Safe to call more than once.
        """
        if self.pid is None or self._events < 0:
            return
        self._stopping = True
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

    def _retire(self, generation: int) -> None:
        self._done.add(generation)
        self._request(_RETIRE, generation)

    def _request(self, operation: int, generation: int, place: int = 0) -> None:
        if self._requests < 0:
            raise RuntimeError("fork server is not running")
        try:
            os.write(self._requests, _REQUEST.pack(operation, generation, place))
        except BrokenPipeError:
            raise RuntimeError("fork server is gone") from None

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
        data, at = self._partial + chunk, 0
        while len(data) - at >= _EVENT.size:
            kind, generation, place, pid, status, length = _EVENT.unpack_from(data, at)
            end = at + _EVENT.size + length
            if end > len(data):
                break
            detail = data[at + _EVENT.size : end].decode(errors="replace")
            event = self._event(kind, generation, place, pid, status, detail)
            if event is not None:
                self._pending.append(event)
            at = end
        self._partial = data[at:]

    def _event(
        self, kind: int, generation: int, place: int, pid: int, status: int, detail: str
    ) -> Event | None:
        if kind == _STARTED:
            self._children[pid] = generation
            return Event("started", place, pid, generation=generation)
        if kind == _EXITED:
            self._children.pop(pid, None)
            return Event("exited", place, pid, status, generation)
        if kind in (_LOADED, _LOAD_FAILED):
            self._loading.discard(generation)
            if kind == _LOAD_FAILED:
                self._done.add(generation)
            name: Literal["loaded", "load_failed"] = "loaded" if kind == _LOADED else "load_failed"
            return Event(name, SERVER_PLACE, pid, None, generation, detail)
        return self._server_exited(generation, pid, status)

    def _server_exited(self, generation: int, pid: int, status: int) -> Event | None:
        """A handler server exited (the root reaped it): news only if the job needs to hear."""
        if generation in self._loading:  # died while importing
            self._loading.discard(generation)
            self._done.add(generation)
            return Event("load_failed", SERVER_PLACE, pid, status, generation,
                         f"the handler server (pid {pid}) exited ({status_text(status)}) "
                         "while it imported the handler")
        orphaned = generation in self._children.values()
        if self._stopping or (generation in self._done and not orphaned):
            if self._stopping or generation not in self._adopted:
                return None
            return Event("retired", SERVER_PLACE, pid, status, generation)
        return Event("exited", SERVER_PLACE, pid, status, generation)

    def _reap_server(self) -> None:
        """The root is gone or going: collect its exit status and report it."""
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


def _fixed(target: Callable[[int], NoReturn]) -> Callable[[], Loaded]:
    def load() -> Loaded:
        return Loaded(target)

    return load


def status_text(status: int | None) -> str:
    """``exit status 1``, ``killed by SIGKILL``."""
    if status is None:
        return "status unknown"
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


# -- the servers --------------------------------------------------------------------------


def _run_root(
    load: Callable[[], Loaded], requests: int, events: int, parent_ends: set[int]
) -> NoReturn:
    """The root's main function; never returns into the supervisor's code."""
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
        reset_signals()
        _Root(load, requests, events).serve()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


class _Server:
    """What both kinds of server do: take fixed-size requests from a pipe, be woken by
    SIGCHLD to reap children, report events."""

    request: struct.Struct

    def __init__(self, requests: int, events: int) -> None:
        self._requests = requests
        self._events = events
        self._partial = b""
        self._wake_read, self._wake_write = os.pipe()

    def serve(self) -> None:
        """Serve until the request pipe reaches EOF (or ``finished``), then ``close``."""
        # We follow the supervisor (request pipe EOF, parent-death signal), never a signal
        # meant for it; handlers get their signals from the supervisor by pid.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)
        # The C-level handler writes a byte to the pipe, so select() wakes on SIGCHLD.
        signal.set_wakeup_fd(self._wake_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        while self._serve_once():
            pass
        self.close()

    def _serve_once(self) -> bool:
        """One loop turn: False once the request pipe reached EOF or the server is done."""
        readable, _, _ = select.select([self._requests, self._wake_read], [], [])
        if self._wake_read in readable:
            _drain(self._wake_read)
        self.reap(os.WNOHANG)
        if self._requests in readable:
            chunk = os.read(self._requests, 4096)
            if not chunk:
                return False
            data = self._partial + chunk
            usable = len(data) - len(data) % self.request.size
            for fields in self.request.iter_unpack(data[:usable]):
                self.handle(*fields)
            self._partial = data[usable:]
        return not self.finished()

    def own_fds(self) -> tuple[int, ...]:
        """What a process forked from here must close."""
        return self._requests, self._events, self._wake_read, self._wake_write

    def exited(self, options: int) -> Iterator[tuple[int, int]]:
        """Children that exited, as (pid, exit code or -signal): all of them, with
        ``options == 0``."""
        while self.has_children():
            try:
                pid, status = os.waitpid(-1, options)
            except ChildProcessError:
                return
            if pid == 0:
                return
            yield pid, os.waitstatus_to_exitcode(status)

    def handle(self, *fields: int) -> None:
        raise NotImplementedError

    def has_children(self) -> bool:
        raise NotImplementedError

    def reap(self, options: int) -> None:
        raise NotImplementedError

    def finished(self) -> bool:
        return False

    def close(self) -> None:
        raise NotImplementedError

    def report(self, kind: int, generation: int, place: int, pid: int, status: int = 0,
               detail: str = "") -> None:
        text = detail.encode()[:DETAIL_LIMIT].decode(errors="ignore").encode()
        # A broken pipe means the supervisor is gone; EOF on the requests follows.
        with contextlib.suppress(BrokenPipeError):
            os.write(self._events,
                     _EVENT.pack(kind, generation, place, pid, status, len(text)) + text)


@dataclass(slots=True)
class _Generation:
    pid: int
    requests: int  # write end of its request pipe


class _Root(_Server):
    """Forks a handler server per generation, passes requests on, reports their exits."""

    request = _REQUEST

    def __init__(self, load: Callable[[], Loaded], requests: int, events: int) -> None:
        super().__init__(requests, events)
        self._load = load
        self._servers: dict[int, _Generation] = {}

    def serve(self) -> None:
        setproctitle.setproctitle("queue-supervisor: fork server")
        super().serve()

    def handle(self, *fields: int) -> None:
        operation, generation, place = fields
        if operation == _LOAD:
            self._fork(generation)
        elif operation == _SPAWN:
            self._send(generation, place)
        elif operation == _RETIRE:
            self._send(generation, _RETIRE_PLACE)

    def _fork(self, generation: int) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            others = (server.requests for server in self._servers.values())
            inherited = {*self.own_fds(), write, *others} - {self._events}
            _run_handler_server(self._load, generation, read, self._events, inherited)
        os.close(read)
        self._servers[generation] = _Generation(pid, write)

    def _send(self, generation: int, place: int) -> None:
        server = self._servers.get(generation)
        if server is None:  # it exited already, and that was reported
            return
        with contextlib.suppress(BrokenPipeError):  # exiting: that will be reported
            os.write(server.requests, _SERVER_REQUEST.pack(place))

    def has_children(self) -> bool:
        return bool(self._servers)

    def reap(self, options: int) -> None:
        for pid, status in self.exited(options):
            for generation, server in list(self._servers.items()):
                if server.pid == pid:
                    os.close(server.requests)
                    del self._servers[generation]
                    self.report(_SERVER_EXITED, generation, SERVER_PLACE, pid, status)

    def close(self) -> None:
        """The supervisor stopped: each handler server sees EOF, kills its children and
        exits; they are reaped here."""
        for server in self._servers.values():
            os.close(server.requests)
            server.requests = -1
        for pid, _ in self.exited(0):
            self._servers = {g: s for g, s in self._servers.items() if s.pid != pid}


def _run_handler_server(
    load: Callable[[], Loaded], generation: int, requests: int, events: int,
    inherited: set[int],
) -> NoReturn:
    """A handler server's main function: load the code, then fork its handler processes."""
    code = 1
    try:
        # First: the root's wake-up fd is among those closed below. The root's ignored
        # signals stay ignored (a Ctrl-C during the import must not end us).
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # for the import's own subprocesses
        root = os.getppid()
        for fd in inherited:
            os.close(fd)
        set_parent_death_signal()
        if os.getppid() != root:  # the root died before we asked to follow it
            os._exit(CHILD_ORPHANED)
        server = _HandlerServer(generation, requests, events)
        if server.load(load):
            server.serve()
            code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        _flush_streams()
        os._exit(code)


class _HandlerServer(_Server):
    """Loads the code, then forks children on request and reports their starts and exits."""

    request = _SERVER_REQUEST

    def __init__(self, generation: int, requests: int, events: int) -> None:
        super().__init__(requests, events)
        self._generation = generation
        self._target: Callable[[int], NoReturn] | None = None
        self._children: dict[int, int] = {}  # pid -> place
        self._retired = False
        setproctitle.setproctitle(f"queue-supervisor: handler server {generation}")

    def load(self, load: Callable[[], Loaded]) -> bool:
        """Run ``load``; report its outcome. False: it failed (and that was reported)."""
        try:
            loaded = load()
        except (Exception, SystemExit) as error:
            self.report(_LOAD_FAILED, self._generation, SERVER_PLACE, os.getpid(),
                        detail=_why(error))
            return False
        self._target = loaded.target
        self.report(_LOADED, self._generation, SERVER_PLACE, os.getpid(), detail=loaded.report)
        return True

    def handle(self, *fields: int) -> None:
        (place,) = fields
        if place == _RETIRE_PLACE:
            self._retired = True
            setproctitle.setproctitle(
                f"queue-supervisor: handler server {self._generation} (replaced)")
        else:
            self._spawn(place)

    def finished(self) -> bool:
        """Retired and its last process is gone."""
        return self._retired and not self._children

    def _spawn(self, place: int) -> None:
        assert self._target is not None
        server = os.getpid()
        # SIGTERM is ignored here; blocked across the fork, one sent to the new child before
        # it restored the default action stays pending (Linux queues blocked signals even
        # when ignored) and takes effect when the child unblocks it, instead of being lost.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid = os.fork()
        if pid == 0:
            _run_child(self._target, place, server, self.own_fds())
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self._children[pid] = place
        self.report(_STARTED, self._generation, place, pid)

    def has_children(self) -> bool:
        return bool(self._children)

    def reap(self, options: int) -> None:
        """Report every child that exited (all of them, with ``options == 0``)."""
        for pid, status in self.exited(options):
            place = self._children.pop(pid, None)
            if place is not None:
                self.report(_EXITED, self._generation, place, pid, status)

    def close(self) -> None:
        """EOF or retired and empty: no child may outlive us.

        EOF is the end of the job, or of the root. Their deaths are not reported: a root
        killed closes its pipes before the kernel kills us for it, and a process reported
        killed then would read as a worker lost (its job blamed) instead of one of all the
        processes the supervisor lost with the root (nothing blamed).
        """
        for pid in self._children:
            with contextlib.suppress(ProcessLookupError):  # exited already: reaped below
                os.kill(pid, signal.SIGKILL)
        for pid, _ in self.exited(0):
            self._children.pop(pid, None)


def _why(error: BaseException) -> str:
    """The reason a load failed, for the supervisor's log line: a ValueError's own message
    (the loader's word on the code, e.g. worker.handler.HandlerError), else the error with
    its type and a traceback on stderr (a bug in the loader)."""
    if isinstance(error, ValueError):
        return str(error)
    traceback.print_exc()
    return describe(error)


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
        _flush_streams()
        os._exit(code)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not stop the exit
            stream.flush()


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    return value if isinstance(value, int) else 1


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass
