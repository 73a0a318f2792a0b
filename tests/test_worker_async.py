"""The handler process of an async def handler: a real forked child on real rings, driven
as the supervisor drives it. Several deliveries run at once on one event loop."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from broker import envelope
from broker.failure import Failure
from support.handler_child import lines
from support.waiting import wait_until
from worker import protocol
from worker.handler import HandlerError, load
from worker.process import CHILD_INIT_FAILED


def kinds(outcomes) -> list[str]:
    return [kind for kind, _, _ in outcomes]


def test_deliveries_run_at_once_up_to_tasks_and_start_in_order(children, tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    child = children("tests.handlers.aio:handle", tasks=3)
    assert child.outcomes(1) == [("READY", 0, None)]
    sent = child.deliver(*({"log": str(log), "gate": str(gate)} for _ in range(5)))
    ids = [delivery_id for delivery_id, _ in sent]
    # Three start, in order, and all three are in the handler at once; two wait.
    assert child.outcomes(3) == [("STARTED", i, None) for i in ids[:3]]
    wait_until(lambda: len(lines(log)) == 3)
    assert [line.split()[2] for line in lines(log)] == ["1", "2", "3"]
    assert child.nothing_more()
    gate.touch()
    outcomes = child.outcomes(7)
    assert sorted(kinds(outcomes)) == ["DONE"] * 5 + ["STARTED"] * 2
    assert [i for kind, i, _ in outcomes if kind == "STARTED"] == ids[3:]
    for i in ids[3:]:  # a delivery is started before it is done
        assert outcomes.index(("STARTED", i, None)) < outcomes.index(("DONE", i, None))


def test_a_failure_is_reported_at_once_and_on_error_is_awaited(children, tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    child = children("tests.handlers.aio:handle", tasks=2)
    child.outcomes(1)
    (slow, _), (failing, pid) = child.deliver({"log": str(log), "gate": str(gate)},
                                              {"log": str(log), "fail": True})
    assert summaries(child.outcomes(3)) == [
        ("STARTED", slow, None), ("STARTED", failing, None),
        ("FAILED", failing, "ValueError: boom")]
    wait_until(lambda: f"error {pid} ValueError: boom" in lines(log))
    gate.touch()
    assert child.outcomes(1) == [("DONE", slow, None)]


def test_on_success_runs_only_after_a_committed_confirm(children, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.aio:handle", tasks=4)
    child.outcomes(1)
    (a, pid_a), (b, _) = child.deliver({"log": str(log)}, {"log": str(log)})
    assert sorted(kinds(child.outcomes(4))) == ["DONE", "DONE", "STARTED", "STARTED"]
    assert not any(line.startswith("success") for line in lines(log))
    child.send(protocol.encode_confirm(a, True), protocol.encode_confirm(b, False),
               protocol.encode_exit())
    assert child.exit_status() == 0
    assert [line for line in lines(log) if line.startswith("success")] == [f"success {pid_a}"]


def test_held_until_an_async_flush_returned_and_flushes_do_not_overlap(
    children, tmp_path: Path, monkeypatch
) -> None:
    log, flush_gate, gate = tmp_path / "log", tmp_path / "flush-gate", tmp_path / "gate"
    monkeypatch.setenv("AIO_FLUSH_GATE", str(flush_gate))
    child = children("tests.handlers.aio_flushing:handle", tasks=4)
    assert child.outcomes(1) == [("READY", 0, None)]
    (a, pid_a), (b, pid_b) = child.deliver({"log": str(log)},
                                           {"log": str(log), "gate": str(gate)})
    # a returns at once: HELD, and flush() starts (nothing waits to start) while b runs.
    assert child.outcomes(3) == [("STARTED", a, None), ("STARTED", b, None), ("HELD", a, None)]
    wait_until(lambda: lines(log) == [f"flushing {pid_a}"])
    gate.touch()  # b returns while the first flush() is still running: HELD, not flushed yet
    assert child.outcomes(1) == [("HELD", b, None)]
    assert child.nothing_more() and lines(log) == [f"flushing {pid_a}"]
    flush_gate.touch()
    assert child.outcomes(2) == [("DONE", a, None), ("DONE", b, None)]
    assert lines(log) == [f"flushing {pid_a}", f"flushed {pid_a}",
                          f"flushing {pid_b}", f"flushed {pid_b}"]


def test_a_failing_flush_fails_what_it_covered(children, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.aio_flushing:handle", tasks=4)
    child.outcomes(1)
    ((a, _),) = child.deliver({"log": str(log), "flush_fails": True})
    assert summaries(child.outcomes(3)) == [
        ("STARTED", a, None), ("HELD", a, None),
        ("FAILED", a, "RuntimeError: flush() failed: database down")]


def test_exit_waits_for_running_tasks_then_flushes(children, tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    child = children("tests.handlers.aio_flushing:handle", tasks=4)
    child.outcomes(1)
    sent = [envelope.build("tests", {"log": str(log), "gate": str(gate)}) for _ in range(3)]
    # In one batch: what came before EXIT runs, EXIT waits for it.
    child.send(*(protocol.encode_deliver(n, raw) for n, (_, raw) in enumerate(sent, 1)),
               protocol.encode_exit())
    assert kinds(child.outcomes(3)) == ["STARTED"] * 3
    gate.touch()
    outcomes = child.outcomes(6)
    assert sorted(kinds(outcomes)) == ["DONE"] * 3 + ["HELD"] * 3
    assert child.exit_status() == 0
    flushed = [pid for line in lines(log) if line.startswith("flushed")
               for pid in line.split()[1].split(",")]
    assert sorted(flushed) == sorted(pid for pid, _ in sent)


@pytest.mark.slow
def test_the_timeout_cancels_one_task_and_the_others_go_on(children, tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    child = children("tests.handlers.aio:handle", tasks=3, timeout=1.0)
    child.outcomes(1)
    (hung, pid), (ok, _) = child.deliver({"log": str(log), "hang": True},
                                         {"log": str(log), "gate": str(gate)})
    assert child.outcomes(2) == [("STARTED", hung, None), ("STARTED", ok, None)]
    gate.touch()  # the other one finishes beside the hung one, undisturbed
    outcomes = child.outcomes(2)
    assert summaries(outcomes) == [
        ("DONE", ok, None), ("FAILED", hung, "HandlerTimeout: handler timeout after 1.0s")]
    # Where the handler was waiting when it was cancelled, not asyncio's sleep.
    assert "tests/handlers/aio.py:" in outcomes[1][2].where
    assert outcomes[1][2].where.endswith(" in handle")
    assert "CancelledError" in outcomes[1][2].traceback
    wait_until(lambda: f"error {pid} TimeoutError: handler timeout after 1.0s" in lines(log))


def test_a_task_that_swallows_the_cancellation_still_fails_late(children, tmp_path) -> None:
    gate = tmp_path / "gate"
    child = children("tests.handlers.aio:handle", tasks=2, timeout=0.2)
    child.outcomes(1)
    ((late, _),) = child.deliver({"gate": str(gate), "swallow": True})
    assert child.outcomes(1) == [("STARTED", late, None)]
    time.sleep(0.5)
    assert child.nothing_more()  # cancelled, but it goes on: the supervisor kills it later
    gate.touch()
    assert summaries(child.outcomes(1)) == [
        ("FAILED", late, "HandlerTimeout: handler timeout after 0.2s")]


def test_stop_flag_skips_what_waits_even_while_every_task_is_busy(children, tmp_path) -> None:
    gate = tmp_path / "gate"
    child = children("tests.handlers.aio:handle", tasks=2)
    child.outcomes(1)
    sent = child.deliver(*({"gate": str(gate)} for _ in range(4)))
    ids = [delivery_id for delivery_id, _ in sent]
    assert child.outcomes(2) == [("STARTED", i, None) for i in ids[:2]]
    child.to_child.request_stop()  # no wake-up comes with it: the process looks on its own
    assert child.outcomes(2) == [("SKIPPED", i, None) for i in ids[2:]]
    gate.touch()
    assert sorted(child.outcomes(2)) == [("DONE", i, None) for i in ids[:2]]


def test_sigterm_ends_the_process_with_its_tasks_unreported(children, tmp_path: Path) -> None:
    child = children("tests.handlers.aio:handle", tasks=5)
    child.outcomes(1)
    sent = child.deliver(*({"hang": True} for _ in range(5)))
    assert kinds(child.outcomes(5)) == ["STARTED"] * 5
    os.kill(child.pid, signal.SIGTERM)
    assert child.exit_status() == -signal.SIGTERM
    assert child.nothing_more() and len(sent) == 5


def test_a_failing_async_init_reports_and_exits_with_code_3(children, monkeypatch) -> None:
    monkeypatch.setenv("AIO_INIT_FAILS", "1")
    child = children("tests.handlers.aio_flushing:handle", tasks=2)
    assert child.outcomes(1) == [("INIT_FAILED", 0, "init() failed: RuntimeError: no database")]
    assert child.exit_status() == CHILD_INIT_FAILED


def test_async_hooks_beside_a_plain_handler_are_refused_before_any_process() -> None:
    """The one load (the configuration check) refuses them: no process gets such a handler."""
    with pytest.raises(HandlerError, match="async hooks need an async def handler"):
        load("tests.handlers.aio_sync_handle:handle")


def summaries(outcomes: list) -> list:
    """Outcomes with each FAILED record's failure read as its one-line summary."""
    return [(kind, delivery_id, data.summary if isinstance(data, Failure) else data)
            for kind, delivery_id, data in outcomes]


@pytest.mark.slow
def test_a_held_async_success_carries_the_handlers_own_seconds_not_the_wait_for_flush(
    children, tmp_path: Path, monkeypatch
) -> None:
    log, flush_gate = tmp_path / "log", tmp_path / "flush-gate"
    monkeypatch.setenv("AIO_FLUSH_GATE", str(flush_gate))
    child = children("tests.handlers.aio_flushing:handle", tasks=4)
    child.outcomes(1)
    ((delivery_id, pid),) = child.deliver({"log": str(log)})
    assert child.outcomes(2) == [("STARTED", delivery_id, None), ("HELD", delivery_id, None)]
    wait_until(lambda: lines(log) == [f"flushing {pid}"])
    time.sleep(1.5)  # flush() waits at its gate this long at least
    flush_gate.touch()
    assert child.to_parent.wait(30)
    done_id, seconds = protocol.done_fields(child.to_parent.get())
    assert done_id == delivery_id and 0 < seconds < 1.0


def test_the_title_counts_the_running_jobs_and_names_the_oldest(children, tmp_path: Path) -> None:
    """An async process's title: how many run, the oldest's pid, attempt and start; idle
    once they ended (written at most every tick of its loop, only when it changed)."""
    import psutil

    from worker import titles

    first, second = tmp_path / "first", tmp_path / "second"
    child = children("tests.handlers.aio:handle", tasks=3)
    assert child.outcomes(1) == [("READY", 0, None)]

    def title() -> titles.HandlerTitle | None:
        text = " ".join(psutil.Process(child.pid).cmdline()).strip()
        return titles.parse(text.removeprefix("queue-supervisor: tests handler "))

    [(_, oldest)] = child.deliver({"gate": str(first)})
    wait_until(lambda: (read := title()) is not None and read.pid == oldest)
    later = child.deliver(*({"gate": str(second)} for _ in range(2)))
    wait_until(lambda: (read := title()) is not None and read.running == 3)
    read = title()
    assert read is not None and (read.pid, read.attempt, read.busy) == (oldest, 1, True)
    first.touch()  # the oldest ends: the next one is named
    wait_until(lambda: (read := title()) is not None and read.running == 2)
    read = title()
    assert read is not None and read.pid == later[0][1]
    second.touch()
    wait_until(lambda: title() == titles.HandlerTitle(0, False))
