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

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from typing import Any, NamedTuple

import orjson

from examples.usage import wal, wire
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
#: The log is moved into the engine once it holds this many bytes of rows, ...
MOVE_BYTES = 8 << 20
#: ... or once its oldest rows waited this many seconds (``$STATS_USAGE_MOVE_AGE``).
MOVE_AGE = float(os.environ.get("STATS_USAGE_MOVE_AGE") or 1.0)
#: Bytes of rows in the log beyond which inserts go to the engine directly.
MAX_WAITING = 256 << 20


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
        _fewer_malloc_arenas()  # before the engine's threads start (on import)
        _without_dataframes()
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
        # Streamed in, not inlined in the INSERT's text: a query holding the rows costs
        # copies of them (str, query) and the engine's parse of that query, 60-70 MiB more
        # peak memory for a move of 6-8 MB. The same one part, fsynced alike, either way.
        with self.session.send_insert(f"INSERT INTO {table}", "JSONCompactEachRow") as stream:
            stream.append(rows)
            stream.finish()

    def select(self, sql: str) -> list[Any]:
        return orjson.loads(self.session.query(sql, "JSONCompact").bytes())["data"]

    def close(self) -> None:
        self.session.close()


#: Imported by chDB's Python layer when present, for DataFrame and Arrow results the writer
#: never asks for: 28 MiB of libraries and 11 MiB of heap in the writer, none of it the
#: engine's (chDB runs without them, and JSONCompact is all the writer reads).
DATAFRAME_MODULES = ("pyarrow", "pandas", "numpy")


def _without_dataframes() -> None:
    for name in DATAFRAME_MODULES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # import fails at once


#: glibc's malloc gives each thread that allocates an arena of its own, up to 8 per core,
#: and the engine runs 28 threads: with 2 arenas the writer's peak was 11 MiB lower (287
#: against 295-300 MiB, five pairs of 20 s at 8,000 messages/s), the engine's data the same.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter, as MALLOC_ARENA_MAX in the environment


def _fewer_malloc_arenas() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator's business
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


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


class Batch(NamedTuple):
    """Rows in the log and not yet in the engine: a closed segment (None: none, the rows
    of a failed round were never logged) and its rows by table."""

    segment: str | None
    rows: dict[str, list[bytes]]
    size: int


class Committer:
    """Inserts made durable in the log (``examples.usage.wal``) and answered at once; the
    log moved into the engine by a thread of its own in one INSERT per table once it holds
    ``MOVE_BYTES`` or its oldest rows waited ``MOVE_AGE``; reads and statements see every
    answered insert (the log is moved first).

    The first insert into a table after the writer starts or after any statement goes to
    the engine directly, so that the engine's own refusal (no such table) fails that
    flush as it always did; so do inserts while the log holds more than ``MAX_WAITING``
    (the engine refuses the moves: its errors then fail the flushes, and nothing grows).
    Only the thread that moves touches the engine while it runs; everything else that does
    waits for it first.
    """

    def __init__(self, engine: Engine, log_: wal.Log) -> None:
        self.engine = engine
        self.log = log_
        self.verified: set[str] = set()
        self.open: dict[str, list[bytes]] = defaultdict(list)  # rows of the open segment
        self.open_size = 0
        self.open_since = 0.0
        self.closed: list[Batch] = []  # in the log, not in the engine (moving, or refused)
        self._mover: threading.Thread | None = None
        self._moved: tuple[list[Batch], BaseException | None] | None = None
        self._retry_at = 0.0

    def recover(self) -> None:
        """Move what an earlier writer answered and did not move (it died, or was killed)."""
        batches = [Batch(segment, wal.read(segment), 0) for _, segment in self.log.segments()]
        if batches:
            rows = sum(len(part) for batch in batches for parts in batch.rows.values()
                       for part in parts)
            log.info("moving %d segment(s) of the log (%d bytes of rows) into the engine",
                     len(batches), rows)
            self._move(batches)
            self._forget(batches)

    def insert(self, tables: dict[str, bytes]) -> dict[str, BaseException | None]:
        """Make one round's rows durable; the error (None: done) per table."""
        errors: dict[str, BaseException | None] = {}
        logged: dict[str, bytes] = {}
        for table, rows in tables.items():
            if table in self.verified and self._waiting() < MAX_WAITING:
                logged[table] = rows
                continue
            self._join()
            try:
                self.engine.insert(table, rows)
                self.verified.add(table)
                errors[table] = None
            except Exception as error:
                errors[table] = error
        if logged:
            try:
                self.log.append(list(logged.items()))
            except OSError as error:  # not answered: redelivered (a replay counts once)
                log.error("the log of %s cannot be written (%s): the flushes of this round "
                          "fail and their messages come back", self.log.folder, error)
                self._close_open()
                return {**errors, **dict.fromkeys(logged, error)}
            if not self.open_size:
                self.open_since = time.monotonic()
            for table, rows in logged.items():
                self.open[table].append(rows)
                self.open_size += len(rows)
                errors[table] = None
        return errors

    def select(self, sql: str) -> list[Any]:
        self.settle()
        return self.engine.select(sql)

    def execute(self, sql: str) -> None:
        self.settle()
        self.verified.clear()  # the statement may drop or change a table
        self.engine.execute(sql)

    def tick(self) -> None:
        """Start a move when one is due (between rounds, and when idle)."""
        self._collect()
        if self._mover is not None:
            return
        now = time.monotonic()
        due = self.open_size and (self.open_size >= MOVE_BYTES
                                  or now - self.open_since >= MOVE_AGE)
        if not due and not (self.closed and now >= self._retry_at):
            return
        self._close_open()
        batches = list(self.closed)
        self._mover = threading.Thread(target=self._move_in_thread, args=(batches,),
                                       name="log mover", daemon=True)
        self._mover.start()

    def settle(self) -> None:
        """Every answered insert in the engine (an error if the engine refuses them)."""
        self._join()
        self._close_open()
        if self.closed:
            batches = list(self.closed)
            self._move(batches)
            self._forget(batches)

    def _waiting(self) -> int:
        return self.open_size + sum(batch.size for batch in self.closed)

    def _close_open(self) -> None:
        segment = self.log.rotate()
        if self.open_size or segment is not None:
            self.closed.append(Batch(segment, dict(self.open), self.open_size))
        self.open, self.open_size = defaultdict(list), 0

    def _move_in_thread(self, batches: list[Batch]) -> None:
        try:
            self._move(batches)
            self._moved = (batches, None)
        except BaseException as error:
            self._moved = (batches, error)

    def _move(self, batches: list[Batch]) -> None:
        rows: dict[str, list[bytes]] = defaultdict(list)
        for batch in batches:
            for table, parts in batch.rows.items():
                rows[table] += parts
        for table, parts in rows.items():
            self.engine.insert(table, b"".join(parts))
        for batch in batches:  # only now: in the engine, and fsynced
            if batch.segment is not None:
                self.log.remove(batch.segment)

    def _forget(self, batches: list[Batch]) -> None:
        """Drop moved batches from ``closed`` (in the main thread only)."""
        moved = {id(batch) for batch in batches}
        self.closed = [batch for batch in self.closed if id(batch) not in moved]

    def _join(self) -> None:
        if self._mover is not None:
            self._mover.join()
        self._collect()

    def _collect(self) -> None:
        if self._mover is None or self._mover.is_alive():
            return
        self._mover = None
        moved, self._moved = self._moved, None
        if moved is not None and moved[1] is None:
            self._forget(moved[0])
        elif moved is not None:
            self._retry_at = time.monotonic() + MOVE_AGE
            log.error("the engine refused the log's rows (%s): they stay in %s and are moved "
                      "again in %.0fs; nothing is lost", moved[1], self.log.folder, MOVE_AGE)


def serve(listener: socket.socket, committer: Committer, stop: Stop, parent: int) -> None:
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
        for conn, reply in answer(committer, requests):
            try:
                conn.sendall(reply)
            except OSError:
                if conn in readers:
                    drop(conn)
        committer.tick()


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


def answer(committer: Committer, requests: list[tuple[socket.socket, bytes, bytes]]
           ) -> list[tuple[socket.socket, bytes]]:
    """The replies to one round of requests; the round's inserts are one log append (one
    fsync), or one INSERT per table where they go to the engine directly."""
    replies: list[tuple[socket.socket, bytes]] = []
    inserts: dict[str, list[tuple[socket.socket, bytes]]] = defaultdict(list)
    for conn, kind, payload in requests:
        if kind == wire.INSERT:
            name, _, rows = payload.partition(b"\n")
            inserts[name.decode()].append((conn, rows))
            continue
        try:
            if kind == wire.SELECT:
                result = orjson.dumps(committer.select(payload.decode()))
            elif kind == wire.EXECUTE:
                committer.execute(payload.decode())
                result = b""
            else:
                raise ValueError(f"unknown request {kind!r}")
            replies.append((conn, wire.frame(wire.OK, result)))
        except Exception as error:
            replies.append((conn, wire.frame(wire.ERROR, str(error).encode())))
    if inserts:
        errors = committer.insert(
            {table: b"".join(rows for _, rows in parts) for table, parts in inserts.items()})
        for table, failed in errors.items():
            reply = wire.frame(wire.OK, b"") if failed is None else wire.frame(
                wire.ERROR, str(failed).encode())
            replies += [(conn, reply) for conn, _ in inserts[table]]
    return replies


def _stop(committer: Committer) -> None:
    """Move the log into the engine before it closes (what is left is the next writer's)."""
    try:
        committer.settle()
    except Exception as error:
        log.warning("the log's rows stay in %s for the next writer (%s)",
                    committer.log.folder, error)
    committer.log.close()


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
        try:
            committer = Committer(engine, wal.Log(path))
            committer.recover()  # before any answer: a read sees what was answered before
            log.info("serving %s", os.path.realpath(path))
            try:
                serve(listener, committer, stop, int(parent))
            finally:
                _stop(committer)
        finally:
            engine.close()  # before the name is free: the next writer waits for the folder
    finally:
        listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
