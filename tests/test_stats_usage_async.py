"""The async stats-usage example (aiosqlite), called in-process on one event loop, as its
handler process would: exact totals, each pid counted once, flushes beside running handlers."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from examples import stats_usage, stats_usage_async
from examples.stats_usage_async import flush, handle, init, totals
from support.usage_messages import Message, message


@pytest.fixture
async def db_path(tmp_path, monkeypatch):
    path = str(tmp_path / "usage.sqlite")
    monkeypatch.setenv(stats_usage.ENV_DB, path)
    await init()
    yield path
    stats_usage_async._buffer.clear()
    if stats_usage_async._db is not None:
        await stats_usage_async._db.close()
        stats_usage_async._db = None


async def test_totals_are_exact_and_written_only_by_flush(db_path):
    await handle(message("a", executions=1, bandwidth=100))
    await handle(message("b", executions=2))
    await handle(message("c", project="p2", executions=5, bandwidth=-40))
    await handle(Message("d", {"projectId": "p2", "metrics": [{"key": "bandwidth", "value": 50}]}))
    assert totals(db_path) == {}
    await flush()
    assert totals(db_path) == {
        ("p1", "executions"): 3, ("p1", "bandwidth"): 100,
        ("p2", "executions"): 5, ("p2", "bandwidth"): 10,
    }


async def test_a_pid_counts_once_in_one_flush_across_flushes_and_connections(db_path):
    await handle(message("a", executions=1))
    await handle(message("a", executions=1))  # twice in one flush
    await flush()
    await handle(message("a", executions=1))  # redelivered later
    await flush()
    await init()  # another handler process's connection
    await handle(message("a", executions=1))
    await handle(message("b", executions=1))
    await flush()
    assert totals(db_path) == {("p1", "executions"): 2}


async def test_the_sync_and_async_handlers_share_a_database_and_the_seen_table(db_path):
    await handle(message("a", executions=3))
    await flush()
    stats_usage.init(db_path)
    try:
        stats_usage.handle(message("a", executions=3))
        stats_usage.handle(message("b", executions=1))
        stats_usage.flush()
    finally:
        assert stats_usage._store is not None
        stats_usage._store.close()
        stats_usage._store = None
    assert totals(db_path) == {("p1", "executions"): 4}


async def test_what_returns_during_a_flush_waits_for_the_next_one(db_path):
    await handle(message("a", executions=1))
    flushing = asyncio.create_task(flush())
    await asyncio.sleep(0)  # the flush took its buffer and awaits the database
    await handle(message("b", executions=10))
    await flushing
    assert totals(db_path) == {("p1", "executions"): 1}
    await flush()
    assert totals(db_path) == {("p1", "executions"): 11}


async def test_a_failed_flush_raises_clears_the_buffer_and_changes_nothing(db_path):
    await handle(message("a", executions=1))
    await flush()
    with sqlite3.connect(db_path) as other:
        other.execute("DROP TABLE usage")
    await handle(message("b", executions=1))
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        await flush()
    assert stats_usage_async._buffer == []
    await init()  # recreates the table; "b" comes back and still counts
    await handle(message("b", executions=1))
    await flush()
    assert totals(db_path) == {("p1", "executions"): 1}


async def test_a_bad_payload_raises_value_error(db_path):
    with pytest.raises(ValueError, match="metrics"):
        await handle(Message("a", {"projectId": "p"}))


async def test_flush_before_init_raises(db_path):
    await stats_usage_async._db.close()
    stats_usage_async._db = None
    await handle(message("a", executions=1))
    with pytest.raises(RuntimeError, match="before init"):
        await flush()
