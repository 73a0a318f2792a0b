"""The stats-usage handler: usage metrics summed per project into an embedded SQLite database.

A message says how much of which metric one project used, as Appwrite's stats-usage queue
does::

    {"project": {"$id": "6570a1"}, "metrics": [{"key": "executions", "value": 1},
                                               {"key": "bandwidth", "value": 5120}]}

``"projectId": "6570a1"`` is accepted instead of ``"project"``. Values are integers and may
be negative (a deletion lowers a count); an empty ``metrics`` list is valid and adds nothing.

``handle()`` only validates and buffers; ``flush()`` writes the buffer in one transaction,
and the worker acknowledges the messages only after it returned (the durability barrier).
Each message's pid goes into ``seen`` in the same transaction as its metrics, so a
redelivered message never counts twice, whichever handler process receives it again.

Tables: ``usage(project, metric, value)`` holds the totals, ``seen(pid)`` the messages
counted. The database is ``$STATS_USAGE_DB`` (default ``stats-usage.sqlite`` in the working
directory), shared by every handler process of the job.
"""

from __future__ import annotations

import os
import sqlite3
from collections import Counter
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any, NamedTuple

ENV_DB = "STATS_USAGE_DB"
DEFAULT_DB = "stats-usage.sqlite"
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


class Usage(NamedTuple):
    """One validated message, waiting in the buffer for ``flush()``."""

    pid: str
    project: str
    metrics: list[tuple[str, int]]


_db: sqlite3.Connection | None = None
_buffer: list[Usage] = []


# --- the handler hooks -----------------------------------------------------------------------


def init(path: str | None = None) -> None:
    """Open the database of this handler process (once, after the fork)."""
    global _db
    if _db is not None:
        _db.close()
    _db = connect(path or os.environ.get(ENV_DB, DEFAULT_DB))


def handle(message: Any) -> None:
    """Validate one message and buffer its metrics; raises ValueError on a bad payload."""
    project, metrics = parse(message.payload)
    _buffer.append(Usage(message.pid, project, metrics))


def flush() -> None:
    """Add every buffered message not counted before to the totals, in one transaction.

    The buffer is emptied whether or not this succeeds: on failure the worker fails the
    messages it covered, and they come back as redeliveries.
    """
    pending = _buffer.copy()
    _buffer.clear()
    if not pending:
        return
    if _db is None:
        raise RuntimeError("stats_usage.flush() before init(): no database is open")
    with transaction(_db):
        _db.executemany(ADD_TO_TOTAL, _new_totals(_db, pending))


# --- the payload -----------------------------------------------------------------------------


def parse(payload: Any) -> tuple[str, list[tuple[str, int]]]:
    """``(project id, [(metric, value), ...])`` of a payload; raises ValueError if malformed."""
    if not isinstance(payload, dict):
        raise ValueError(f"payload is a {type(payload).__name__}, not an object")
    project = _project_id(payload)
    metrics = payload.get("metrics")
    if not isinstance(metrics, list):
        raise ValueError('payload has no "metrics" list')
    return project, [_metric(index, metric) for index, metric in enumerate(metrics)]


def _project_id(payload: dict[str, Any]) -> str:
    project = payload.get("project")
    if isinstance(project, dict):
        project = project.get("$id")
    elif project is None:
        project = payload.get("projectId")
    if not isinstance(project, str) or not project:
        raise ValueError('payload names no project ("project": {"$id": ...} or "projectId")')
    return project


def _metric(index: int, metric: Any) -> tuple[str, int]:
    if not isinstance(metric, dict):
        raise ValueError(f"metrics[{index}] is a {type(metric).__name__}, not an object")
    key, value = metric.get("key"), metric.get("value")
    if not isinstance(key, str) or not key:
        raise ValueError(f'metrics[{index}] has no "key" string')
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'metrics[{index}] ("{key}") has a value that is not an integer')
    return key, value


def make_payload(project: str, metrics: dict[str, int]) -> dict[str, Any]:
    """A stats-usage payload for ``project``: what producers publish and tests send."""
    return {
        "project": {"$id": project},
        "metrics": [{"key": key, "value": value} for key, value in metrics.items()],
    }


# --- the database ----------------------------------------------------------------------------


def connect(path: str) -> sqlite3.Connection:
    """Open (and create if needed) the database; several processes may share it."""
    # Autocommit mode: transactions are the explicit BEGIN IMMEDIATE of transaction().
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None)
    # WAL: readers never block the writer. Switching to it takes a lock without waiting on
    # the busy timeout, so it is done only when the mode is not WAL yet (the first process).
    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        db.execute("PRAGMA journal_mode = WAL")
    # FULL: a commit is on disk when flush() returns, before the messages are acknowledged.
    db.execute("PRAGMA synchronous = FULL")
    db.executescript(SCHEMA)
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


def _new_totals(db: sqlite3.Connection, pending: list[Usage]) -> list[tuple[str, str, int]]:
    """Mark each message seen; the summed metrics of those that were not seen before."""
    sums: Counter[tuple[str, str]] = Counter()
    for usage in pending:
        inserted = db.execute("INSERT OR IGNORE INTO seen (pid) VALUES (?)", (usage.pid,))
        if inserted.rowcount == 1:
            for metric, value in usage.metrics:
                sums[(usage.project, metric)] += value
    return [(project, metric, value) for (project, metric), value in sums.items()]


def totals(db_path: str) -> dict[tuple[str, str], int]:
    """Every total in the database: ``{(project, metric): value}``."""
    with closing(sqlite3.connect(db_path, timeout=BUSY_TIMEOUT)) as db:
        rows = db.execute("SELECT project, metric, value FROM usage").fetchall()
    return {(project, metric): value for project, metric, value in rows}


def main() -> int:
    """``python -m examples.stats_usage [DB]``: print the usage totals a run produced."""
    import sys

    path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(ENV_DB, DEFAULT_DB)
    try:  # read-only: asking must not create an empty database
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            db.execute("SELECT 1 FROM usage LIMIT 1")
    except sqlite3.Error:
        print(f"error: {path} holds no usage totals yet (run the stats-usage job first, "
              f"e.g. python -m supervisor conf/stats-usage.toml)", file=sys.stderr)
        return 1
    for (project, metric), value in sorted(totals(path).items()):
        print(f"{project}\t{metric}\t{value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
