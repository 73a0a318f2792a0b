"""The stats-usage handler written async, on aiosqlite: the same tables, the same totals.

Name it as ``handler = "examples.stats_usage_async:handle"`` with ``[job] tasks_per_process``
above 1 (``conf/stats-usage-async.toml``). Messages, validation, tables and the database
path are ``examples.stats_usage``'s; the two handlers can even share one database.

``handle()`` validates and buffers; ``flush()`` writes the buffer in one transaction
through aiosqlite (SQLite in a thread of its own, so the event loop, and every other
delivery of the process, runs on while the disk works). The worker acknowledges a message
only after a ``flush()`` that began after its ``handle()`` returned has returned. A
``flush()`` may run while other ``handle()`` calls are in flight: it takes the buffer before
its first ``await``, and what is buffered later waits for the next one. Each pid goes into
``seen`` in the same transaction as its metrics, so a redelivered message never counts twice.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import aiosqlite
import orjson

from examples.stats_usage import ENV_DB, make_payload, parse, period_of, totals
from examples.usage import Usage
from examples.usage.sqlite import ADD_TO_TOTAL, BUSY_TIMEOUT, SCHEMA, create_private

#: This handler writes SQLite only (the plain one defaults to the embedded ClickHouse engine).
DEFAULT_DB = "stats-usage.sqlite"

__all__ = ["flush", "handle", "init", "make_payload", "totals"]

#: The pids of a flush that were not counted before: one statement, one thread hop.
MARK_SEEN = "INSERT OR IGNORE INTO seen (pid) SELECT value FROM json_each(?) RETURNING pid"

_db: aiosqlite.Connection | None = None
_buffer: list[Usage] = []


async def init(path: str | None = None) -> None:
    """Open the database of this handler process, on its event loop (once, after the fork)."""
    global _db
    if _db is not None:
        await _db.close()
    _db = await connect(path or os.environ.get(ENV_DB, DEFAULT_DB))


async def handle(message: Any) -> None:
    """Validate one message and buffer its metrics; raises ValueError on a bad payload."""
    project, metrics = parse(message.payload)
    _buffer.append(Usage(message.pid, project, period_of(message.timestamp), metrics))


async def flush() -> None:
    """Add every buffered message not counted before to the totals, in one transaction.

    The buffer is taken (and emptied) before the first ``await``, whether or not this
    succeeds: on failure the worker fails the messages it covered, and they come back.
    """
    pending = _buffer.copy()
    _buffer.clear()
    if not pending:
        return
    db = _db
    if db is None:
        raise RuntimeError("stats_usage_async.flush() before init(): no database is open")
    # IMMEDIATE: the write lock is taken (waiting on the busy timeout) before any read.
    await db.execute("BEGIN IMMEDIATE")
    try:
        await db.executemany(ADD_TO_TOTAL, await _new_totals(db, pending))
        await db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            await db.execute("ROLLBACK")
        raise


async def connect(path: str) -> aiosqlite.Connection:
    """Open (and create if needed) the database, as ``stats_usage.connect`` does."""
    create_private(path)
    db = await aiosqlite.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None)
    async with db.execute("PRAGMA journal_mode") as cursor:
        mode = (await cursor.fetchone())[0]  # type: ignore[index]
    if mode != "wal":  # switching takes a lock without the busy timeout: only the first time
        await db.execute("PRAGMA journal_mode = WAL")
    # FULL: a commit is on disk when flush() returns, before the messages are acknowledged.
    await db.execute("PRAGMA synchronous = FULL")
    await db.executescript(SCHEMA)
    return db


async def _new_totals(
    db: aiosqlite.Connection, pending: list[Usage]
) -> list[tuple[str, str, int]]:
    """Mark each message seen; the summed metrics of those that were not seen before."""
    async with db.execute(MARK_SEEN, (orjson.dumps([u.pid for u in pending]).decode(),)) as rows:
        new = {pid for (pid,) in await rows.fetchall()}
    sums: Counter[tuple[str, str]] = Counter()
    for usage in pending:
        if usage.pid in new:
            new.discard(usage.pid)  # a pid twice in one flush counts once
            for metric, value in usage.metrics:
                sums[(usage.project, metric)] += value
    return [(project, metric, value) for (project, metric), value in sums.items()]
