"""The stats-usage example handler, called in-process: exact totals, counted once per pid."""

from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from examples import noop, stats_usage
from examples.stats_usage import flush, handle, init, make_payload, totals
from support.supervision import ROOT


@dataclass
class Message:
    """Stands in for the worker's message object."""

    pid: str
    payload: dict[str, Any]
    queue: str = "stats-usage"
    timestamp: int = 1_700_000_000
    attempts: int = 0
    receipt: Any = field(default=None, repr=False)


@pytest.fixture
def db_path(tmp_path, monkeypatch):
    """A fresh database for each test, and a handler module state that does not leak."""
    path = str(tmp_path / "usage.sqlite")
    monkeypatch.setenv(stats_usage.ENV_DB, path)
    init()
    yield path
    stats_usage._buffer.clear()
    if stats_usage._db is not None:
        stats_usage._db.close()
        stats_usage._db = None


def message(pid: str, project: str = "p1", **metrics: int) -> Message:
    return Message(pid, make_payload(project, metrics))


def test_make_payload_has_the_documented_shape():
    assert make_payload("p1", {"executions": 2}) == {
        "project": {"$id": "p1"},
        "metrics": [{"key": "executions", "value": 2}],
    }


def test_totals_are_exact(db_path):
    handle(message("a", executions=1, bandwidth=100))
    handle(message("b", executions=2))
    handle(message("c", project="p2", executions=5, bandwidth=-40))
    handle(Message("d", {"projectId": "p2", "metrics": [{"key": "bandwidth", "value": 50}]}))
    assert totals(db_path) == {}  # nothing is written before flush()
    flush()
    assert totals(db_path) == {
        ("p1", "executions"): 3,
        ("p1", "bandwidth"): 100,
        ("p2", "executions"): 5,
        ("p2", "bandwidth"): 10,
    }


def test_a_metric_repeated_in_one_message_is_summed(db_path):
    handle(Message("a", {"projectId": "p", "metrics": [{"key": "k", "value": 1}] * 3}))
    flush()
    assert totals(db_path) == {("p", "k"): 3}


def test_a_redelivered_pid_counts_once_across_flushes(db_path):
    handle(message("a", executions=1))
    flush()
    handle(message("a", executions=1))  # the same message, redelivered
    handle(message("b", executions=1))
    flush()
    assert totals(db_path) == {("p1", "executions"): 2}


def test_a_pid_twice_in_one_flush_counts_once(db_path):
    handle(message("a", executions=1))
    handle(message("a", executions=1))
    flush()
    assert totals(db_path) == {("p1", "executions"): 1}


def test_a_redelivered_pid_counts_once_across_connections(db_path):
    handle(message("a", executions=4))
    flush()
    init()  # another handler process: a connection of its own to the same database
    handle(message("a", executions=4))
    flush()
    assert totals(db_path) == {("p1", "executions"): 4}


def _handle_all_and_flush(db_path: str, pids: list[str], barrier: Any) -> None:
    init(db_path)
    barrier.wait()  # both processes write at the same time: the busy timeout must hold
    for index, pid in enumerate(pids):
        handle(message(pid, executions=1))
        if index % 10 == 9:
            flush()
    flush()


def test_processes_sharing_the_database_count_each_pid_once(db_path):
    pids = [f"pid-{index}" for index in range(200)]
    stats_usage._db.close()  # a connection must not cross a fork: each child opens its own
    stats_usage._db = None
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    processes = [
        context.Process(target=_handle_all_and_flush, args=(db_path, order, barrier))
        for order in (pids, pids[::-1])
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0]
    assert totals(db_path) == {("p1", "executions"): 200}


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
    ],
)
def test_bad_payloads_raise_value_error(db_path, payload, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        handle(Message("bad", payload))
    assert stats_usage._buffer == []  # nothing of a bad message is buffered


def test_an_empty_metric_list_is_valid(db_path):
    handle(Message("a", {"projectId": "p", "metrics": []}))
    flush()
    assert totals(db_path) == {}


def test_a_failed_flush_raises_clears_the_buffer_and_changes_nothing(db_path):
    handle(message("a", executions=1))
    flush()
    with sqlite3.connect(db_path) as other:
        other.execute("DROP TABLE usage")  # the next write fails after seen was updated
    handle(message("b", executions=1))
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        flush()
    assert stats_usage._buffer == []
    init()  # recreates the table; "b" comes back as a redelivery and still counts
    handle(message("b", executions=1))
    flush()
    assert totals(db_path) == {("p1", "executions"): 1}


def test_flush_before_init_raises(db_path):
    stats_usage._db.close()
    stats_usage._db = None
    handle(message("a", executions=1))
    with pytest.raises(RuntimeError, match="before init"):
        flush()
    assert stats_usage._buffer == []


def test_flush_with_nothing_buffered_writes_nothing(db_path):
    flush()
    assert totals(db_path) == {}


def test_the_database_is_in_wal_mode(db_path):
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_noop_handles_anything():
    assert noop.handle(message("a", executions=1)) is None


def test_totals_of_a_database_that_does_not_exist_yet_say_so(tmp_path):
    path = tmp_path / "absent.sqlite"
    done = subprocess.run([sys.executable, "-m", "examples.stats_usage", str(path)],
                          capture_output=True, text=True, timeout=30,
                          cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: {path} holds no usage totals yet")
    assert "Traceback" not in done.stderr
    assert not path.exists()  # asking created nothing
