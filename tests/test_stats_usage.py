"""The stats-usage example handler, called in-process on each store: exact totals, counted
once per pid (ClickHouse-specific behaviour: tests/test_usage_clickhouse.py)."""

from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import sys
from typing import Any

import pytest

from examples import noop, stats_usage
from examples.stats_usage import flush, handle, init, make_payload, period_of, totals
from support.supervision import ROOT
from support.usage_messages import Message, message

STORES = {"sqlite": "usage.sqlite", "clickhouse": "usage.chdb"}


def close_store() -> None:
    stats_usage._buffer.clear()
    if stats_usage._store is not None:
        stats_usage._store.close()
        stats_usage._store = None


@pytest.fixture(params=list(STORES))
def where(request, tmp_path, monkeypatch):
    """A fresh database of each kind for each test (the default, ClickHouse, and SQLite),
    and a handler module state that does not leak."""
    path = str(tmp_path / STORES[request.param])
    monkeypatch.setenv(stats_usage.ENV_DB, path)
    init()
    yield path
    close_store()


@pytest.fixture
def sqlite_path(tmp_path, monkeypatch):
    path = str(tmp_path / "usage.sqlite")
    monkeypatch.setenv(stats_usage.ENV_DB, path)
    init()
    yield path
    close_store()


def test_make_payload_has_the_documented_shape():
    assert make_payload("p1", {"executions": 2}) == {
        "project": {"$id": "p1"},
        "metrics": [{"key": "executions", "value": 2}],
    }


def test_the_default_is_the_embedded_clickhouse_engine(monkeypatch):
    monkeypatch.delenv(stats_usage.ENV_DB, raising=False)
    assert stats_usage.target() == "stats-usage.chdb"


def test_totals_are_exact(where):
    handle(message("a", executions=1, bandwidth=100))
    handle(message("b", executions=2))
    handle(message("c", project="p2", executions=5, bandwidth=-40))
    handle(Message("d", {"projectId": "p2", "metrics": [{"key": "bandwidth", "value": 50}]}))
    assert totals(where) == {}  # nothing is written before flush()
    flush()
    assert totals(where) == {
        ("p1", "executions"): 3,
        ("p1", "bandwidth"): 100,
        ("p2", "executions"): 5,
        ("p2", "bandwidth"): 10,
    }
    assert stats_usage.seen_pids(where) == {"a", "b", "c", "d"}


@pytest.mark.slow
def test_a_metric_repeated_in_one_message_is_summed(where):
    handle(Message("a", {"projectId": "p", "metrics": [{"key": "k", "value": 1}] * 3}))
    flush()
    assert totals(where) == {("p", "k"): 3}


def test_a_redelivered_pid_counts_once_across_flushes(where):
    handle(message("a", executions=1))
    flush()
    handle(message("a", executions=1))  # the same message, redelivered
    handle(message("b", executions=1))
    flush()
    assert totals(where) == {("p1", "executions"): 2}


def test_a_pid_twice_in_one_flush_counts_once(where):
    handle(message("a", executions=1))
    handle(message("a", executions=1))
    flush()
    assert totals(where) == {("p1", "executions"): 1}


@pytest.mark.slow
def test_a_redelivered_pid_counts_once_across_connections(where):
    handle(message("a", executions=4))
    flush()
    init()  # another handler process: a connection of its own to the same database
    handle(message("a", executions=4))
    flush()
    assert totals(where) == {("p1", "executions"): 4}


def test_extreme_values_and_odd_names_come_back_exactly(where):
    odd = 'project "quoted"\n\\ \u00e9\u4e2d'
    handle(Message("a", {"projectId": odd, "metrics": [
        {"key": "big", "value": 2**63 - 1}, {"key": "small", "value": -(2**63)}]}))
    flush()
    assert totals(where) == {(odd, "big"): 2**63 - 1, (odd, "small"): -(2**63)}


def _handle_all_and_flush(where: str, pids: list[str], barrier: Any) -> None:
    init(where)
    barrier.wait()  # both processes write at the same time
    for index, pid in enumerate(pids):
        handle(message(pid, executions=1))
        if index % 10 == 9:
            flush()
    flush()
    stats_usage._store.close()  # a writer this process started stops with it


@pytest.mark.slow
def test_processes_sharing_the_database_count_each_pid_once(where):
    pids = [f"pid-{index}" for index in range(200)]
    close_store()  # a connection must not cross a fork: each child opens its own
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    processes = [
        context.Process(target=_handle_all_and_flush, args=(where, order, barrier))
        for order in (pids, pids[::-1])
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(90)
    assert [process.exitcode for process in processes] == [0, 0]
    assert totals(where) == {("p1", "executions"): 200}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({}, "names no project"),
        ({"project": {}, "metrics": []}, "names no project"),
        ({"project": {"$id": ""}, "metrics": []}, "names no project"),
        ({"projectId": 7, "metrics": []}, "names no project"),
        ({"projectId": "p"}, 'no "metrics" list'),
        ({"projectId": "p", "metrics": {"k": 1}}, 'no "metrics" list'),
        ({"projectId": "p", "metrics": [1]}, "metrics[0] is a int"),
        ({"projectId": "p", "metrics": [{"value": 1}]}, 'metrics[0] has no "key"'),
        ({"projectId": "p", "metrics": [{"key": "k", "value": "1"}]}, "not an integer"),
        ({"projectId": "p", "metrics": [{"key": "k", "value": 1.5}]}, "not an integer"),
        ({"projectId": "p", "metrics": [{"key": "k", "value": True}]}, "not an integer"),
        ({"projectId": "p", "metrics": [{"key": "k", "value": 2**63}]}, "64-bit"),
        ({"projectId": "p", "metrics": [{"key": "k", "value": -(2**63) - 1}]}, "64-bit"),
        ({"projectId": "p", "metrics": [{"key": "k", "value": 2**62}] * 2}, "add up beyond"),
        ({"projectId": "p", "metrics": [{"key": "k", "value": 1}, {"key": "", "value": 1}]},
         'metrics[1] has no "key"'),
        ({"projectId": "p", "metrics": [{"key": "j", "value": 1}, {"key": "k", "value": -2**63},
                                        {"key": "k", "value": -1}]}, "add up beyond"),
    ],
)
def test_bad_payloads_raise_value_error(sqlite_path, payload, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        handle(Message("bad", payload))
    assert stats_usage._buffer == []  # nothing of a bad message is buffered


def test_an_empty_metric_list_is_valid(where):
    handle(Message("a", {"projectId": "p", "metrics": []}))
    flush()
    assert totals(where) == {}


def _drop_usage_table() -> None:
    store = stats_usage._store
    if hasattr(store, "db"):  # SQLite
        store.db.execute("DROP TABLE usage")
    else:
        store.database.execute("DROP TABLE usage")


@pytest.mark.slow
def test_a_failed_flush_raises_clears_the_buffer_and_changes_nothing(where):
    handle(message("a", executions=1))
    flush()
    _drop_usage_table()  # the next write fails (on SQLite after seen was updated)
    handle(message("b", executions=1))
    with pytest.raises(Exception, match=r"no such table|UNKNOWN_TABLE"):
        flush()
    assert stats_usage._buffer == []
    init()  # recreates the table; "b" comes back as a redelivery and still counts
    handle(message("b", executions=1))
    flush()
    assert totals(where) == {("p1", "executions"): 1}


def test_flush_before_init_raises(where):
    close_store()
    handle(message("a", executions=1))
    with pytest.raises(RuntimeError, match="before init"):
        flush()
    assert stats_usage._buffer == []


def test_flush_with_nothing_buffered_writes_nothing(where):
    flush()
    assert totals(where) == {}


def test_the_sqlite_database_is_in_wal_mode(sqlite_path):
    assert stats_usage._store.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_period_is_the_hour_within_clickhouse_range():
    assert period_of(1_700_000_000) == 1_699_999_200
    assert period_of(-5) == 0
    assert period_of(2**62) == (2**32 - 3600) // 3600 * 3600


def test_noop_handles_anything():
    assert noop.handle(message("a", executions=1)) is None


@pytest.mark.parametrize("name", ["absent.sqlite", "absent.chdb"])
def test_totals_of_a_database_that_does_not_exist_yet_say_so(tmp_path, name):
    path = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "examples.stats_usage", str(path)],
                          capture_output=True, text=True, timeout=30,
                          cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: {path} holds no usage totals yet")
    assert "Traceback" not in done.stderr
    assert not path.exists()  # asking created nothing


@pytest.mark.slow
def test_the_command_prints_the_totals_of_the_default_store(tmp_path, monkeypatch):
    """``python -m examples.stats_usage``, no argument, in the folder the job ran in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(stats_usage.ENV_DB, raising=False)
    init()
    handle(message("a", executions=3, bandwidth=7))
    flush()
    close_store()  # the writer stops; the command starts its own
    done = subprocess.run([sys.executable, "-m", "examples.stats_usage"], capture_output=True,
                          text=True, timeout=90, cwd=tmp_path,
                          env={**_env_without_db(), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "p1\tbandwidth\t7\np1\texecutions\t3\n"
    assert (tmp_path / "stats-usage.chdb").is_dir()


def _env_without_db() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != stats_usage.ENV_DB}


def test_the_command_answers_help_with_its_usage(tmp_path):
    done = subprocess.run([sys.executable, "-m", "examples.stats_usage", "--help"],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m examples.stats_usage [-h] [db]")
    assert stats_usage.ENV_DB in done.stdout and ".sqlite" in done.stdout
    assert done.stderr == ""


def _open_at_once(path: str, barrier: Any) -> None:
    from examples.usage import sqlite

    barrier.wait()
    sqlite.connect(path).close()


def test_processes_opening_a_new_sqlite_store_at_once_all_start(tmp_path):
    # Each finds the new database not WAL yet and switches it; all but one are refused at
    # once ("database is locked", no busy wait) and must try again, not fail init() (a
    # Cluster soak's supervisors halted with HANDLER_INIT so).
    path = str(tmp_path / "usage.sqlite")
    context = multiprocessing.get_context("fork")
    for _ in range(5):  # the race is narrow: a fresh database each round
        barrier = context.Barrier(6)
        workers = [context.Process(target=_open_at_once, args=(path, barrier)) for _ in range(6)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert [worker.exitcode for worker in workers] == [0] * 6
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        for suffix in ("", "-wal", "-shm"):
            if (tmp_path / f"usage.sqlite{suffix}").exists():
                (tmp_path / f"usage.sqlite{suffix}").unlink()
