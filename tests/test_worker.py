"""The handler process end to end: a real forked child, real rings, driven as the
supervisor drives it (DELIVER, CONFIRM, EXIT; reading READY/DONE/FAILED/... and the mark a
plain handler's process leaves on its outcome ring for the delivery it runs)."""

from __future__ import annotations

import json
import os
import random
import signal
import string
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from broker import envelope
from broker.failure import Failure
from support.handler_child import lines
from support.waiting import wait_until
from worker import protocol, titles
from worker.handler import Handler, load
from worker.process import CHILD_INIT_FAILED


def test_noop_handler_marks_each_start_reports_done_and_exits_on_request(children) -> None:
    child = children("tests.handlers.noop:handle")
    assert child.outcomes(1) == [("READY", 0, None)]
    assert child.to_parent.marked == 0
    (a, _), (b, _) = child.deliver({}, {"n": 1})
    # One record per delivery: no STARTED, the mark names the last one started.
    assert child.outcomes(2) == [("DONE", a, None), ("DONE", b, None)]
    assert child.to_parent.marked == b
    assert child.nothing_more()
    child.send(protocol.encode_exit())
    assert child.exit_status() == 0


def test_dotted_handler_path_works_too(children) -> None:
    child = children("tests.handlers.noop.handle")
    assert child.outcomes(1)[0][0] == "READY"


def test_raising_handler_fails_the_delivery_and_calls_on_error(children, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.raises:handle")
    child.outcomes(1)
    ((delivery_id, pid),) = child.deliver({"log": str(log)})
    assert summaries(child.outcomes(1)) == [("FAILED", delivery_id, "ValueError: boom")]
    wait_until(lambda: lines(log) == [f"on_error {pid} ValueError"])


def test_malformed_envelope_fails_without_reaching_the_handler(children, tmp_path: Path) -> None:
    child = children("tests.handlers.raises:handle")
    child.outcomes(1)
    child.send(protocol.encode_deliver(7, b"not json"))
    (failed,) = child.outcomes(1)
    assert child.to_parent.marked == 1  # the first delivery of its ring was reached
    assert failed[:2] == ("FAILED", 7) and failed[2].error == "broker.envelope.MalformedEnvelope"


def test_every_attempts_value_reaches_the_handler(children, tmp_path: Path) -> None:
    # The attempts beside the envelope are any signed 64-bit value, or unknown (None): then
    # the envelope's own field counts. A JSON array payload reaches the handler as a list.
    log = tmp_path / "log"
    child = children("tests.handlers.attempts:handle")
    child.outcomes(1)
    sent = [0, 4294967296, 2**63 - 1, -1, -(2**63), None]
    records = []
    for delivery_id, attempts in enumerate(sent, start=1):
        raw = envelope.encode({"pid": f"p{delivery_id}", "queue": "tests", "timestamp": 1,
                               "payload": {"log": str(log)}, "attempts": 5})
        records.append(protocol.encode_deliver(delivery_id, raw, attempts))
    as_list = envelope.encode({"pid": "list", "queue": "tests", "timestamp": 1,
                               "payload": [str(log)], "attempts": 2**63 - 1})
    records.append(protocol.encode_deliver(len(sent) + 1, as_list))
    child.send(*records)
    outcomes = child.outcomes(len(records))
    assert [kind for kind, _, _ in outcomes] == ["DONE"] * len(records)
    assert lines(log) == [
        "p1 0 dict", "p2 4294967296 dict", f"p3 {2**63 - 1} dict", "p4 -1 dict",
        f"p5 {-(2**63)} dict", "p6 5 dict", f"list {2**63 - 1} list",
    ]


@pytest.mark.parametrize(("handler", "tasks"), [
    ("tests.handlers.fields:handle", 1), ("tests.handlers.fields:handle_async", 2),
])
def test_an_envelope_flagged_plain_is_read_with_orjson_alone(
    children, tmp_path: Path, handler: str, tasks: int
) -> None:
    # The supervisor flags an envelope plain when its decode took the fast path: orjson
    # alone reads it the same, so the handler gets the same message with the flag or without.
    log = tmp_path / "log"
    child = children(handler, tasks=tasks)
    child.outcomes(1)
    pid, raw = envelope.build("tests", {"log": str(log), "v": [1.5, -0.0, "é/", None, {}]})
    # A timestamp decode would cast (never flagged plain by a supervisor) shows that the
    # process trusts the flag and does not decode a flagged envelope again.
    probe = b'{"pid":"p","queue":"tests","timestamp":"5","payload":{"log":%s}}' % (
        json.dumps(str(log)).encode())
    child.send(protocol.encode_deliver(1, raw, 3, plain=True),
               protocol.encode_deliver(2, raw, 3),
               protocol.encode_deliver(3, probe, 0, plain=True),
               protocol.encode_deliver(4, probe, 0))
    outcomes = child.outcomes(8 if tasks > 1 else 4)  # with STARTED from an async one
    assert [kind for kind, _, _ in outcomes if kind != "STARTED"] == ["DONE"] * 4
    decoded = envelope.decode(raw)
    built = repr((pid, "tests", decoded["timestamp"], 3, decoded["payload"]))
    assert lines(log) == [
        built, built, repr(("p", "tests", "5", 0, {"log": str(log)})),
        repr(("p", "tests", 5, 0, {"log": str(log)})),
    ]


def test_successes_are_done_only_after_flush_returned(children, tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    child = children("tests.handlers.flushing:handle")
    child.outcomes(1)
    ((delivery_id, pid),) = child.deliver({"log": str(log), "gate": str(gate)})
    wait_until(lambda: child.to_parent.marked == delivery_id)
    wait_until(lambda: lines(log) == ["flushing"])  # flush() is running, held by the gate
    assert child.nothing_more()
    gate.touch()
    assert child.outcomes(1) == [("DONE", delivery_id, None)]
    assert lines(log) == ["flushing", f"flush {pid}"]


@pytest.mark.slow
def test_a_held_success_carries_the_handlers_own_seconds_not_the_wait_for_flush(
    children, tmp_path: Path
) -> None:
    """DONE's seconds feed the handler histogram and the pace the supervisor sizes rings
    by: a wait for flush() (which depends on what else the flush covers) is not the
    handler's time."""
    log, gate = tmp_path / "log", tmp_path / "gate"
    child = children("tests.handlers.flushing:handle")
    child.outcomes(1)
    ((delivery_id, _),) = child.deliver({"log": str(log), "gate": str(gate)})
    wait_until(lambda: lines(log) == ["flushing"])
    time.sleep(1.5)  # flush() waits at its gate this long at least
    gate.touch()
    assert child.to_parent.wait(30)
    done_id, seconds = protocol.done_fields(child.to_parent.get())
    assert done_id == delivery_id and 0 < seconds < 1.0


def test_flush_runs_every_n_successes_and_when_the_ring_is_empty(children, tmp_path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.flushing:handle", flush_every=2)
    child.outcomes(1)
    sent = child.deliver(*({"log": str(log)} for _ in range(5)))
    ids = [delivery_id for delivery_id, _ in sent]
    assert child.outcomes(5) == [("DONE", delivery_id, None) for delivery_id in ids]
    pids = [pid for _, pid in sent]
    assert [line for line in lines(log) if line != "flushing"] == [
        f"flush {pids[0]},{pids[1]}", f"flush {pids[2]},{pids[3]}", f"flush {pids[4]}",
    ]


def test_exit_flushes_held_successes_first(children, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.flushing:handle")
    child.outcomes(1)
    pid_a, raw_a = envelope.build("tests", {"log": str(log)})
    pid_b, raw_b = envelope.build("tests", {"log": str(log)})
    child.send(protocol.encode_deliver(1, raw_a), protocol.encode_deliver(2, raw_b),
               protocol.encode_exit())
    assert [kind for kind, _, _ in child.outcomes(2)] == ["DONE", "DONE"]
    assert child.exit_status() == 0
    assert lines(log) == ["flushing", f"flush {pid_a},{pid_b}"]


def test_a_failing_flush_fails_every_message_it_covered(children, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.flush_raises:handle")
    child.outcomes(1)
    sent = child.deliver(*({"log": str(log)} for _ in range(3)))
    outcomes = child.outcomes(3)
    assert [kind for kind, _, _ in outcomes] == ["FAILED"] * 3
    assert [delivery_id for _, delivery_id, _ in outcomes] == [i for i, _ in sent]
    assert {failure.summary for _, _, failure in outcomes} == {
        "RuntimeError: flush() failed: database down"}
    wait_until(lambda: len(lines(log)) == 3)
    assert lines(log) == [f"on_error {pid} database down" for _, pid in sent]


def test_on_success_runs_only_after_a_committed_confirm(children, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = children("tests.handlers.confirming:handle")
    assert child.outcomes(1) == [("READY", 0, None)]
    (a, pid_a), (b, _) = child.deliver({"log": str(log)}, {"log": str(log)})
    assert [kind for kind, _, _ in child.outcomes(2)] == ["DONE"] * 2
    assert lines(log) == []  # done is not confirmed: nothing yet
    child.send(protocol.encode_confirm(a, True), protocol.encode_confirm(b, False),
               protocol.encode_confirm(a, True),  # a duplicate is ignored
               protocol.encode_exit())
    assert child.exit_status() == 0
    assert lines(log) == [f"success {pid_a}"]


def test_stop_flag_skips_deliveries_that_did_not_start(children, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    child = children("tests.handlers.gated:handle")
    child.outcomes(1)
    ((running, _),) = child.deliver({"gate": str(gate)})
    wait_until(lambda: child.to_parent.marked == running)
    (b, _), (c, _) = child.deliver({}, {})
    child.to_child.request_stop()
    gate.touch()
    assert child.outcomes(3) == [("DONE", running, None), ("SKIPPED", b, None),
                                 ("SKIPPED", c, None)]


def test_sigterm_exits_without_reporting_the_running_delivery(children, tmp_path: Path) -> None:
    child = children("tests.handlers.gated:handle")
    child.outcomes(1)
    ((running, _),) = child.deliver({"gate": str(tmp_path / "never")})
    wait_until(lambda: child.to_parent.marked == running)
    os.kill(child.pid, signal.SIGTERM)
    assert child.exit_status() == -signal.SIGTERM
    assert child.nothing_more()


def test_sigint_is_ignored(children, tmp_path: Path) -> None:
    child = children("tests.handlers.noop:handle")
    child.outcomes(1)
    os.kill(child.pid, signal.SIGINT)
    ((delivery_id, _),) = child.deliver({})
    assert child.outcomes(1) == [("DONE", delivery_id, None)]


def test_failing_init_reports_and_exits_with_code_3(children) -> None:
    child = children("tests.handlers.init_raises:handle")
    assert child.outcomes(1) == [("INIT_FAILED", 0, "init() failed: RuntimeError: no database")]
    assert child.exit_status() == CHILD_INIT_FAILED == 3


def test_the_process_runs_the_handler_it_inherited_and_imports_nothing(children, tmp_path):
    """The handler is loaded once, before the fork: the process neither imports it again
    nor needs its path to be importable (a test may hand it a stub)."""
    out = tmp_path / "out"

    def handle(message) -> None:
        out.write_text(str(message.payload["n"]))

    stub = Handler("nowhere.at_all:handle", ModuleType("nowhere"), handle, None, None, None,
                   None)
    child = children(stub)
    assert child.outcomes(1) == [("READY", 0, None)]
    ((delivery_id, _),) = child.deliver({"n": 7})
    assert child.outcomes(1) == [("DONE", delivery_id, None)]
    assert out.read_text() == "7"


def test_only_a_module_with_on_success_wants_confirmations() -> None:
    """What READY once carried: the supervisor reads it from the handler it loaded."""
    assert not load("tests.handlers.noop:handle").wants_confirm
    assert load("tests.handlers.confirming:handle").wants_confirm


def test_a_100_kib_payload_arrives_intact_through_256_byte_slots(children, tmp_path) -> None:
    out = tmp_path / "out"
    data = "".join(random.choices(string.ascii_letters + "/\\\"é", k=100 * 1024))
    child = children("tests.handlers.recorder:handle", slots=1024, slot_size=256)
    child.outcomes(1)
    ((delivery_id, _),) = child.deliver({"out": str(out), "data": data})
    assert child.outcomes(1) == [("DONE", delivery_id, None)]
    assert out.read_text(encoding="utf-8") == data


def test_a_full_outcome_ring_delays_outcomes_but_loses_none(children) -> None:
    child = children("tests.handlers.noop:handle", outcome_slots=4)  # 4 outcomes fit at a time
    child.outcomes(1)
    sent = child.deliver(*({"n": n} for n in range(200)))
    assert child.outcomes(200) == [("DONE", delivery_id, None) for delivery_id, _ in sent]


def process_title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline()).strip()


@pytest.mark.slow
def test_process_title_shows_queue_slot_the_job_it_runs_or_idle(children, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    child = children("tests.handlers.gated:handle")
    child.outcomes(1)
    wait_until(lambda: process_title(child.pid) == "queue-supervisor: tests handler 0 idle")
    before = int(time.time())
    [(_, pid)] = child.deliver({"gate": str(gate)})
    prefix = "queue-supervisor: tests handler 0 "
    wait_until(lambda: process_title(child.pid).startswith(prefix + "busy: job"))
    title = process_title(child.pid)
    read = titles.parse(title.removeprefix("queue-supervisor: tests handler "))
    assert title.startswith(f"{prefix}busy: job {pid} attempt 1 since "), title
    assert read is not None and (read.handler, read.pid, read.attempt) == (0, pid, 1)
    assert before <= read.since <= time.time()  # UTC, to the second
    gate.touch()
    wait_until(lambda: process_title(child.pid) == "queue-supervisor: tests handler 0 idle")


def test_a_title_shows_a_hostile_pid_escaped_and_cut(children, tmp_path: Path) -> None:
    """A producer's pid with a NUL, a newline and an escape, 300 characters long: the title
    stays one line of bounded length (a NUL would make setproctitle raise) and still
    reads back."""
    gate = tmp_path / "gate"
    child = children("tests.handlers.gated:handle")
    child.outcomes(1)
    _, raw = envelope.build("tests", {"gate": str(gate)}, pid="a\x00\n\x1b[2J" + "x" * 300)
    child.send(protocol.encode_deliver(1, raw, 4))
    wait_until(lambda: "busy: job" in process_title(child.pid))
    title = process_title(child.pid)
    assert not {"\x00", "\n", "\x1b"} & set(title), title
    assert len(title) < 200 and " attempt 5 since " in title, title
    read = titles.parse(title.removeprefix("queue-supervisor: tests handler "))
    assert read is not None and read.pid.startswith("a\\x00\\n\\x1b[2Jxxx"), read
    assert read.pid.endswith("...") and len(read.pid) == titles.PID_CHARS
    gate.touch()
    assert child.outcomes(1)[0][0] == "DONE"


def summaries(outcomes: list) -> list:
    """Outcomes with each FAILED record's failure read as its one-line summary."""
    return [(kind, delivery_id, data.summary if isinstance(data, Failure) else data)
            for kind, delivery_id, data in outcomes]


def test_a_plain_handlers_title_is_written_from_its_note_only_when_it_changed() -> None:
    """The process's loop notes each job (one store); the title's thread writes what the
    note says at each tick, only when it changed (a new run is a new note)."""
    written: list[tuple] = []

    class Recorder:
        def job(self, pid: str, attempts: int, since: float) -> None:
            written.append(("job", pid, attempts, since))

        def set_busy(self, busy: bool) -> None:
            written.append(("busy", busy))

    watched = titles.Watched(Recorder())  # type: ignore[arg-type]
    watched.show()  # idle, as the title already says
    watched.state = True
    watched.show()
    watched.show()
    began = time.monotonic() - 5
    watched.state = ("p1", 0, began)
    watched.show()
    watched.state = ("p1", 0, began)  # the same job run again: a new note
    watched.show()
    watched.state = False
    watched.show()
    assert [entry[:3] for entry in written] == [
        ("busy", True), ("job", "p1", 0), ("job", "p1", 0), ("busy", False)]
    assert all(abs(entry[3] - (time.time() - 5)) < 2 for entry in written if entry[0] == "job")
