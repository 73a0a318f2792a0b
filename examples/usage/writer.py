"""The one process that opens an embedded ClickHouse (chDB) database, serving every other.

Why a process of its own: the embedded engine locks its data folder for the process that
opened it (``status``, flock), readers included; a second process fails with "Another
server instance in same directory is already running"; a session opened before a fork is
no better (a child's insert never shows in the parent). Yet several processes need the
database at once: ``coroutines`` handler processes, several supervisors on one host, and
``python -m examples.stats_usage`` while the job runs. Opening the engine per flush under
a lock would be correct but costs ~150 ms per flush, and every process that loads the
engine takes ~500 MB. So one writer per database folder holds the engine, and the others
send it their rows (``examples.usage.local``) and wait for its answer, which comes after
the INSERT returned: the flush barrier still covers the insert.

It is started by the first process that needs it, as that process's child, and gets
SIGTERM when that parent dies (PR_SET_PDEATHSIG), so it never outlives the job; the next
process that needs it starts another. Who serves is decided by the abstract socket name:
only one process can bind it. Requests that arrive together are answered together, and
their inserts go into one INSERT (one part, one fsync): group commit.

    python -m examples.usage.writer PATH PARENT_PID
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections import defaultdict
from typing import Any

import orjson

from examples.usage import wire
from supervisor import logs
from worker.process import set_parent_death_signal

log = logging.getLogger("stats-usage writer")

#: Seconds to wait for the previous writer to let go of the data folder.
OPEN_TIMEOUT = 30.0
#: Seconds between checks of the stop flag and the parent while idle.
POLL = 0.25
#: Seconds a reply may take to leave before its reader is dropped.
SEND_TIMEOUT = 10.0
EXIT_NO_ENGINE = 2
#: The socket name is held by a process of another user (or one that is no writer).
EXIT_NAME_TAKEN = 3
#: Seconds a name in use may refuse connections before it counts as taken by a stranger
#: (a writer of ours between its bind and its listen refuses them for a moment).
PROBE_TIMEOUT = 3.0


class Stop:
    """Set by SIGTERM (the parent died, or someone asked); checked between requests."""

    def __init__(self) -> None:
        self.requested = False

    def set(self, *_: Any) -> None:
        self.requested = True


class Engine:
    """The embedded engine, opened on one folder."""

    def __init__(self, session: Any) -> None:
        self.session = session

    @classmethod
    def open(cls, path: str, stop: Stop) -> Engine:
        try:
            from chdb import session as chdb_session
        except ImportError as error:
            log.error("the embedded ClickHouse engine is not installed (%s): pip install "
                      "'queue-supervisor[clickhouse]', or set STATS_USAGE_DB to a path "
                      "ending in .sqlite", error)
            raise SystemExit(EXIT_NO_ENGINE) from error
        os.makedirs(path, mode=0o700, exist_ok=True)
        _wait_for_folder(path, stop, time.monotonic() + OPEN_TIMEOUT)
        return cls(chdb_session.Session(path))

    def execute(self, sql: str) -> None:
        self.session.query(sql)

    def insert(self, table: str, rows: bytes) -> None:
        self.session.query(f"INSERT INTO {table} FORMAT JSONEachRow\n{rows.decode()}")

    def select(self, sql: str) -> list[Any]:
        return orjson.loads(self.session.query(sql, "JSONCompact").bytes())["data"]

    def close(self) -> None:
        self.session.close()


def _wait_for_folder(path: str, stop: Stop, deadline: float) -> None:
    """Until no other process holds the engine's lock on ``path`` (a writer that is still
    closing), so that opening does not fail on it; the engine takes the lock itself."""
    status = os.path.join(path, "status")
    if not os.path.exists(status):
        return
    fd = os.open(status, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if stop.requested or time.monotonic() > deadline:
                    raise RuntimeError(f"{path} stays locked by another process") from None
                time.sleep(0.05)
    finally:
        os.close(fd)


def serve(listener: socket.socket, engine: Engine, stop: Stop, parent: int) -> None:
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    readers: dict[socket.socket, wire.FrameReader] = {}

    def drop(conn: socket.socket) -> None:
        selector.unregister(conn)
        readers.pop(conn, None)
        conn.close()

    while not stop.requested and os.getppid() == parent:
        requests: list[tuple[socket.socket, bytes, bytes]] = []
        for key, _ in selector.select(POLL):
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            if conn is listener:
                _accept(listener, selector, readers)
                continue
            try:
                data = conn.recv(1 << 20)
                frames = readers[conn].feed(data) if data else None
            except OSError:  # ConnectionError too: a frame larger than allowed
                frames = None
            if frames is None:
                drop(conn)
                continue
            requests += [(conn, kind, payload) for kind, payload in frames]
        for conn, reply in answer(engine, requests):
            try:
                conn.sendall(reply)
            except OSError:
                if conn in readers:
                    drop(conn)


def _accept(listener: socket.socket, selector: selectors.BaseSelector,
            readers: dict[socket.socket, wire.FrameReader]) -> None:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return
    # The abstract namespace has no file permissions: only this user's processes may talk.
    client = wire.peer(conn)
    if client.uid != os.geteuid():
        log.warning("refused a connection of uid %d (pid %d)", client.uid, client.pid)
        conn.close()
        return
    conn.settimeout(SEND_TIMEOUT)  # recv only after select said readable
    selector.register(conn, selectors.EVENT_READ)
    readers[conn] = wire.FrameReader()


def answer(engine: Engine, requests: list[tuple[socket.socket, bytes, bytes]]
           ) -> list[tuple[socket.socket, bytes]]:
    """The replies to one round of requests; the round's inserts are one INSERT per table."""
    replies: list[tuple[socket.socket, bytes]] = []
    inserts: dict[str, list[tuple[socket.socket, bytes]]] = defaultdict(list)
    for conn, kind, payload in requests:
        if kind == wire.INSERT:
            table, _, rows = payload.partition(b"\n")
            inserts[table.decode()].append((conn, rows))
            continue
        try:
            if kind == wire.SELECT:
                result = orjson.dumps(engine.select(payload.decode()))
            elif kind == wire.EXECUTE:
                engine.execute(payload.decode())
                result = b""
            else:
                raise ValueError(f"unknown request {kind!r}")
            replies.append((conn, wire.frame(wire.OK, result)))
        except Exception as error:
            replies.append((conn, wire.frame(wire.ERROR, str(error).encode())))
    for table, parts in inserts.items():
        try:
            engine.insert(table, b"".join(rows for _, rows in parts))
            reply = wire.frame(wire.OK, b"")
        except Exception as error:
            reply = wire.frame(wire.ERROR, str(error).encode())
        replies += [(conn, reply) for conn, _ in parts]
    return replies


def _name_in_use(path: str) -> int:
    """0 when a writer of this user serves ``path`` already; else say who holds the name
    (anyone may bind an abstract name first, to read the rows or forge the answers)."""
    holder = _name_holder(wire.address(path), time.monotonic() + PROBE_TIMEOUT)
    if holder is not None and holder.uid == os.geteuid():
        return 0
    who = ("a process that accepts no connection" if holder is None
           else f"pid {holder.pid} of uid {holder.uid}")
    log.error("cannot serve %s: its socket name is held by %s, not by a writer of this user "
              "(uid %d); no usage is sent there. Stop that process, or set STATS_USAGE_DB to "
              "another path", os.path.realpath(path), who, os.geteuid())
    return EXIT_NAME_TAKEN


def _name_holder(address: str, deadline: float) -> wire.Peer | None:
    """The credentials of the process listening on ``address``; None if it refuses, or
    never accepts (a writer of ours accepts at once)."""
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(max(POLL, deadline - time.monotonic()))
            try:
                probe.connect(address)
                return wire.peer(probe)
            except TimeoutError:
                return None
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    return None
        time.sleep(POLL)


def main(argv: list[str] | None = None) -> int:
    path, parent = (argv if argv is not None else sys.argv[1:])[:2]
    # Among the job's lines, in the job's format: one JSON object per line under systemd.
    logs.setup_inherited()
    # The engine creates the folder's files and folders itself: none may be readable by
    # other local users, whatever the umask of the hand run that started this writer.
    os.umask(0o077)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the supervisor to handle
    stop = Stop()
    signal.signal(signal.SIGTERM, stop.set)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # whatever the parent had
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before the line above
        return 0
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(wire.address(path))
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            return _name_in_use(path)
        raise
    try:
        listener.listen(128)
        engine = Engine.open(path, stop)
        log.info("serving %s", os.path.realpath(path))
        try:
            serve(listener, engine, stop, int(parent))
        finally:
            engine.close()  # before the name is free: the next writer waits for the folder
    finally:
        listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
