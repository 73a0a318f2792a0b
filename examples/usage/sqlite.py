"""The SQLite store: totals in one file that every handler process of the host opens.

Tables: ``usage(project, metric, value)`` holds the totals, ``seen(pid)`` the messages
counted. A batch is one transaction: each pid goes into ``seen`` together with its
metrics, so a redelivered message never counts twice, whichever process receives it again.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from examples.usage.store import NoTotals, Usage

#: Seconds a writer waits for another handler process's transaction before failing.
BUSY_TIMEOUT = 30.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    project TEXT NOT NULL,
    metric TEXT NOT NULL,
    value INTEGER NOT NULL,
    PRIMARY KEY (project, metric)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS seen (pid TEXT PRIMARY KEY) WITHOUT ROWID;
"""

ADD_TO_TOTAL = """
INSERT INTO usage (project, metric, value) VALUES (?, ?, ?)
ON CONFLICT (project, metric) DO UPDATE SET value = value + excluded.value
"""


class SqliteStore:
    def __init__(self, path: str, *, create: bool = True) -> None:
        self.path = path
        self.db = connect(path) if create else _open_existing(path)

    def add(self, batch: list[Usage]) -> None:
        with transaction(self.db):
            self.db.executemany(ADD_TO_TOTAL, _new_totals(self.db, batch))

    def totals(self) -> dict[tuple[str, str], int]:
        rows = self.db.execute("SELECT project, metric, value FROM usage").fetchall()
        return {(project, metric): value for project, metric, value in rows}

    def seen(self) -> set[str]:
        return {pid for (pid,) in self.db.execute("SELECT pid FROM seen")}

    def close(self) -> None:
        self.db.close()


#: A new database file (and so its -wal and -shm files, which SQLite gives the database
#: file's mode) is readable by its owner only: the totals are nobody else's business.
FILE_MODE = 0o600


def create_private(path: str) -> None:
    """Create the database file ``path`` with ``FILE_MODE`` unless it exists (whatever the
    umask of a hand run: 0644 would let every local user read it)."""
    if path in ("", ":memory:"):  # no file at all
        return
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))


def connect(path: str) -> sqlite3.Connection:
    """Open (and create if needed) the database; several processes may share it."""
    create_private(path)
    # Autocommit mode: transactions are the explicit BEGIN IMMEDIATE of transaction().
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None)
    # WAL: readers never block the writer. Switching to it takes a lock without waiting on
    # the busy timeout, so it is done only when the mode is not WAL yet (the first process).
    _switch_to_wal(db)
    # FULL: a commit is on disk when flush() returns, before the messages are acknowledged.
    db.execute("PRAGMA synchronous = FULL")
    db.executescript(SCHEMA)
    return db


def _switch_to_wal(db: sqlite3.Connection) -> None:
    """Make the database WAL. Processes that open a new database at once (the handler
    processes of several supervisors) may all find it not WAL yet; the switch of all but
    one is refused at once ("database is locked", no busy wait), so each tries again until
    the mode reads WAL, for up to BUSY_TIMEOUT."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    while db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        try:
            db.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _open_existing(path: str) -> sqlite3.Connection:
    """Read-only, so that asking never creates an empty database."""
    if not os.path.exists(path):
        raise NoTotals(f"{path} does not exist")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT)
        db.execute("SELECT 1 FROM usage LIMIT 1")
    except sqlite3.Error as error:
        raise NoTotals(f"{path}: {error}") from error
    return db


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK if the block raises.

    IMMEDIATE takes the write lock at the start, so a busy database is waited for (busy
    timeout) instead of failing when a read transaction would later need to write.
    """
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _new_totals(db: sqlite3.Connection, batch: list[Usage]) -> list[tuple[str, str, int]]:
    """Mark each message seen; the summed metrics of those that were not seen before."""
    sums: Counter[tuple[str, str]] = Counter()
    for usage in batch:
        inserted = db.execute("INSERT OR IGNORE INTO seen (pid) VALUES (?)", (usage.pid,))
        if inserted.rowcount == 1:
            for metric, value in usage.metrics:
                sums[(usage.project, metric)] += value
    return [(project, metric, value) for (project, metric), value in sums.items()]
