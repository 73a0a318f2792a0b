"""Every failed run is logged once, after its settlement, with what became of the job
(issue 25): pid, queue, attempt of max, outcome ("retrying in N s", "failed", "dead"), the
error and where; the traceback too, in JSON, once the job stops retrying. Readable in both
formats, escaped whatever the handler raised."""

from __future__ import annotations

import asyncio
import io
import logging
import signal

import orjson
import pytest

from broker.base import Action, Delivery, Outcome, Result, Settlement
from broker.failure import Failure
from broker.memory import MemoryBroker
from supervisor import failures, logs
from supervisor.buffer import Buffer, State
from supervisor.settlement import Settler
from support.envelopes import publish
from support.supervision import counter, keys, wait_for, write_config

log = logging.getLogger("supervisor.settlement")

FAILURE = Failure(error="ValueError", message="bad input", where="/srv/app/h.py:12 in handle",
                  traceback='Traceback (most recent call last):\n  File "/srv/app/h.py", line '
                            '12, in handle\n    raise ValueError("bad input")\n'
                            "ValueError: bad input\n")


@pytest.fixture
def stream():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    yield out
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def delivery(attempts: int, pid: str = "65f0c1a2b3c4d5.12345678") -> Delivery:
    return Delivery(pid=pid, queue="stats-usage", timestamp=1, attempts=attempts, payload={},
                    raw=b"{}", receipt=None)


def rejected(attempts: int, failure: Failure = FAILURE, pid: str = "65f0c1a2b3c4d5.12345678"):
    return Settlement(Action.REJECT, delivery(attempts, pid), failure.summary, failure)


def test_a_retried_run_is_one_warning_with_every_field(stream) -> None:
    logs.setup("info", stream)
    failures.log_outcome(log, rejected(1), Result(Outcome.OK, "retrying in 4 s"), 3)
    [line] = stream.getvalue().splitlines()
    record = orjson.loads(line)
    assert record["level"] == "warning"
    assert record["message"] == ("job 65f0c1a2b3c4d5.12345678 attempt 2/3 failed: ValueError: "
                                 "bad input (/srv/app/h.py:12 in handle); retrying in 4 s")
    assert {k: record[k] for k in ("queue", "pid", "attempt", "max_attempts", "outcome",
                                   "error", "where")} == {
        "queue": "stats-usage", "pid": "65f0c1a2b3c4d5.12345678", "attempt": 2,
        "max_attempts": 3, "outcome": "retrying in 4 s", "error": "ValueError: bad input",
        "where": "/srv/app/h.py:12 in handle"}
    assert "traceback" not in record  # while it is retried, the error line is enough


@pytest.mark.parametrize("outcome", ["failed", "dead"])
def test_a_final_run_is_one_error_with_the_traceback(stream, outcome) -> None:
    logs.setup("info", stream)
    failures.log_outcome(log, rejected(2), Result(Outcome.OK, outcome), 3)
    [line] = stream.getvalue().splitlines()
    record = orjson.loads(line)
    assert record["level"] == "error"
    assert (record["attempt"], record["outcome"]) == (3, outcome)
    assert record["message"].endswith(f"; no attempts left: moved to {outcome}")
    assert record["traceback"] == FAILURE.traceback  # its lines kept, inside the one object


def test_a_terminal_gets_one_readable_line(stream) -> None:
    logs.setup("info", stream, json=False)
    failures.log_outcome(log, rejected(1), Result(Outcome.OK, "retrying in 4 s"), 3)
    failures.log_outcome(log, rejected(2), Result(Outcome.OK, "failed"), 3)
    retrying, final = stream.getvalue().splitlines()  # no traceback lines in text
    assert " WARNING supervisor.settlement[" in retrying
    assert retrying.endswith(
        "job 65f0c1a2b3c4d5.12345678 attempt 2/3 failed: ValueError: bad input "
        "(/srv/app/h.py:12 in handle); retrying in 4 s queue=stats-usage "
        "pid=65f0c1a2b3c4d5.12345678")
    assert " ERROR supervisor.settlement[" in final
    assert "attempt 3/3 failed: ValueError: bad input" in final
    assert "; no attempts left: moved to failed queue=stats-usage" in final


def test_a_broker_that_does_not_say_is_read_by_the_budget(stream) -> None:
    logs.setup("info", stream)
    failures.log_outcome(log, rejected(0), Result(Outcome.OK), 2)
    failures.log_outcome(log, rejected(1), Result(Outcome.OK), 2)
    failures.log_outcome(log, Settlement(Action.REJECT, delivery(0), "worker lost"),
                         Result(Outcome.OK), 0)
    first, second, unknown = map(orjson.loads, stream.getvalue().splitlines())
    assert (first["outcome"], first["level"]) == ("retrying", "warning")
    assert (second["outcome"], second["level"]) == ("failed", "error")
    assert unknown["message"].startswith("job 65f0c1a2b3c4d5.12345678 attempt 1 failed: "
                                         "Error: worker lost; retrying")


@pytest.mark.parametrize("json", [True, False])
def test_what_a_handler_raised_is_escaped_and_cut(stream, json) -> None:
    logs.setup("info", stream, json=json)
    hostile = Failure(error="E", message="\x1b[2J\u202eforged\n2026 ERROR fake" + "x" * 5000,
                      where="h.py:1 in \u2028f", traceback="T\x1b[31m\nE\u202e\n")
    failures.log_outcome(log, rejected(2, hostile, pid="p\nq"), Result(Outcome.OK, "dead"), 3)
    [line] = stream.getvalue().splitlines()  # one line whatever it holds
    for unsafe in ("\x1b", "\u202e", "\u2028"):
        assert unsafe not in line
    message = orjson.loads(line)["message"] if json else line
    assert "\\x1b[2J\\u202eforged\\x0a2026 ERROR fake" in message
    assert "...[cut: " in message
    if json:
        record = orjson.loads(line)
        assert record["traceback"] == "T\\x1b[31m\nE\\u202e\n" and record["pid"] == "p\\x0aq"


@pytest.mark.slow
def test_each_failed_run_of_a_real_job_logs_its_outcome(tmp_path, redis_url, client,
                                                         supervisors) -> None:
    """A raising handler, one that kills its process and one past handler_timeout, each
    run twice: one line per run, the last with the traceback of what was raised."""
    raising, crashing, hanging = publish(client, [{"fail": True}, {"crash": True},
                                                  {"hang": True}])
    config = write_config(tmp_path, redis_url,
                          job={"max_attempts": 2, "handler_timeout": 1.0})
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: counter(client, "failed") >= 6 and client.llen(keys().failed) == 3, 60,
             "three jobs to fail twice each")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()
    records = [orjson.loads(line) for line in supervisor.output().splitlines() if line]
    runs = {pid: [r for r in records if r.get("pid") == pid and "outcome" in r]
            for pid in (raising, crashing, hanging)}
    for lines in runs.values():
        assert [(r["attempt"], r["max_attempts"], r["outcome"], r["level"]) for r in lines] == [
            (1, 2, "retrying in 0 s", "warning"), (2, 2, "failed", "error")], lines
    [_, last] = runs[raising]
    assert last["error"] == f"RuntimeError: asked to fail ({raising})"
    assert last["where"].endswith(" in handle") and "e2e_record.py:" in last["where"]
    assert "raise RuntimeError" in last["traceback"]
    assert all(r["error"].startswith("WorkerLost: handler process ")
               and r["error"].endswith(" killed by signal 9 (SIGKILL)") for r in runs[crashing])
    assert all(r["error"].startswith("HandlerTimeout: handler timeout after 1.0s (handler "
                                     "process ") for r in runs[hanging])


def test_every_failed_run_settled_logs_exactly_one_line(caplog) -> None:
    """Through the settler: applied rejects say what became of the job, and one recovered
    by another consumer before its reject says that the outcome is not ours to tell."""

    pids: list[str] = []

    async def scenario() -> None:
        broker = MemoryBroker(max_attempts=3)
        pids[:] = await broker.publish_many("jobs", [{"n": n} for n in range(3)])
        received = await broker.receive(3, 0.01)
        buffer = Buffer(prefetch=3, handlers=1)
        buffer.add(received.deliveries)
        buffer.queue(0, 3)
        for queued in buffer.in_state(State.QUEUED, 0):
            buffer.started(0, queued.id)
            buffer.finished(0, queued.id, FAILURE.summary, FAILURE)
        assert broker.recover(pids[2])  # another consumer took it over meanwhile
        settler = Settler(broker, buffer, lambda entry, ok: None)
        with caplog.at_level(logging.INFO, logger="supervisor.settlement"):
            assert await settler.settle(buffer.take_completed(10))

    asyncio.run(scenario())
    lines = [r for r in caplog.records if hasattr(r, "outcome")]
    assert [(r.attempt, r.outcome, r.levelname) for r in lines] == [
        (1, "retrying", "WARNING"), (1, "retrying", "WARNING"),
        (1, "outcome unknown: no longer ours when rejected (recovered or delivered again)",
         "WARNING")]
    assert [r.pid for r in lines] == pids
