"""A handler's failure as the supervisor receives it (issue 25): the FAILED ring record
carries a Failure (class, message, where, traceback), bounded whatever was raised, and a
plain-text body (an older handler process) still decodes. Timeouts and lost handler
processes become Failures too."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from broker.failure import MAX_MESSAGE_BYTES, MAX_TRACEBACK_BYTES, Failure
from supervisor import failures
from tests.handlers import raises_strange
from worker import protocol, tracebacks
from worker.base import failure_of

SYNC, ASYNC = "tests.handlers.raises_strange:handle", "tests.handlers.raises_strange:handle_async"


def _line_of(text: str) -> int:
    source = Path(raises_strange.__file__).read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if line.strip() == text)


def failed_record(children, handler: str, kind: str) -> tuple[Failure, bytes]:
    """Run one delivery that raises ``kind``; its FAILED record, decoded and as it was sent."""
    child = children(handler)
    assert child.outcomes(1)[0][0] == "READY"
    ((delivery_id, _),) = child.deliver({"raise": kind})
    if handler == ASYNC:  # a plain handler sends no STARTED: it marks the start on its ring
        assert child.outcomes(1) == [("STARTED", delivery_id, None)]
    raw = None
    while raw is None:
        child.to_parent.wait(1.0)
        raw = child.to_parent.get()
    kind_sent, sent_id, data = protocol.decode(raw)
    assert (kind_sent, sent_id) == (protocol.FAILED, delivery_id)
    return protocol.failure_data(data), raw


@pytest.mark.parametrize("handler", [SYNC, ASYNC])
def test_a_raising_handler_sends_class_message_where_and_traceback(children, handler) -> None:
    failure, _ = failed_record(children, handler, "boom")
    assert (failure.error, failure.message) == ("ValueError", "boom")
    line = _line_of('raise ValueError("boom")')
    assert failure.where.endswith(f"raises_strange.py:{line} in fail"), failure.where
    assert failure.traceback.startswith("Traceback (most recent call last):")
    assert "worker/" not in failure.traceback  # from the handler's frame on: not our loop
    assert 'raise ValueError("boom")' in failure.traceback
    assert failure.traceback.rstrip().endswith("ValueError: boom")
    assert failure.summary == "ValueError: boom"
    assert 0 < failure.seconds < 30  # timed by its process, as a success is (issue 38)


@pytest.mark.parametrize("handler", [SYNC, ASYNC])
def test_a_handlers_own_class_is_named_with_its_module(children, handler) -> None:
    failure, _ = failed_record(children, handler, "custom")
    assert failure.summary == "tests.handlers.raises_strange.BadInput: no such user"


@pytest.mark.parametrize("kind", ["huge", "bidi", "surrogate", "unprintable", "deep"])
def test_strange_failures_are_bounded_and_decodable(children, kind) -> None:
    # The test child's outcome ring is small (16 KB): the record shrinks to half of it.
    failure, raw = failed_record(children, SYNC, kind)
    assert len(raw) <= 16384 // 2
    assert Failure.decode(raw[9:]) == failure  # the body is the record itself
    assert len(failure.message.encode()) <= MAX_MESSAGE_BYTES
    assert len(failure.traceback.encode()) <= MAX_TRACEBACK_BYTES
    assert failure.where  # always the innermost frame
    if kind == "huge":
        assert failure.message.startswith("xxx") and failure.traceback.rstrip().endswith("END")
    if kind == "bidi":  # kept as raised: escaping is for whoever shows it (logs, commands)
        assert failure.message == "\u202eevil\nsecond line\u2028\x1b[31m"
    if kind == "surrogate":
        assert failure.message == "bad ? half"
    if kind == "unprintable":
        assert failure.summary == (
            "tests.handlers.raises_strange.Unprintable: <str() raised RuntimeError>")
    if kind == "deep":  # the end of a thousand frames: where it raised
        assert failure.error == "RecursionError" and "in _recurse" in failure.where
        assert failure.traceback.rstrip().endswith("maximum recursion depth exceeded")


def test_an_old_plain_text_failed_body_still_decodes() -> None:
    # A handler process of the previous version sent UTF-8 text (during a rolling upgrade).
    old = struct.pack("<BQ", protocol.FAILED, 5) + "ValueError: bad \u00e9".encode()
    kind, delivery_id, data = protocol.decode(old)
    assert (kind, delivery_id) == (protocol.FAILED, 5)
    assert protocol.failure_data(data) == Failure(error="ValueError", message="bad \u00e9")
    for body, summary in [(b"\xff\xfe{", "Error: \ufffd\ufffd{"),
                          (b'{"message": "no class"}', '{"message": "no class"}'),
                          (b"flush() failed: RuntimeError: x", "Error: flush() failed: "
                                                               "RuntimeError: x")]:
        data = protocol.decode(struct.pack("<BQ", protocol.FAILED, 1) + body)[2]
        assert protocol.failure_data(data).summary == summary
    assert protocol.text_data(protocol.decode(old)[2]) == "ValueError: bad \u00e9"


def test_a_failure_record_fits_any_limit_keeping_the_traceback_end() -> None:
    failure = Failure(error="E", message="m" * 5000, where="w.py:1 in f",
                      traceback="frame\n" * 5000 + "E: m")
    for limit in (16384, 4096, 300, 120):
        body = protocol.failure_body(failure, limit)
        assert len(body) <= limit
        decoded = Failure.decode(body)
        assert decoded.error == "E"
        if decoded.traceback:
            assert decoded.traceback.endswith("E: m")
    with pytest.raises(ValueError, match="does not fit in 5 bytes"):
        protocol.failure_body(failure, 5)


def test_failure_of_never_raises_and_names_builtins_plainly() -> None:
    try:
        {}["missing"]
    except KeyError as error:
        failure = failure_of(error, "flush() failed")
    assert failure.summary == "KeyError: flush() failed: 'missing'"
    assert "in test_failure_of_never_raises_and_names_builtins_plainly" in failure.where
    assert failure_of(TimeoutError()).summary == "TimeoutError"  # never raised: no frame
    assert failure_of(TimeoutError()).where == ""


def test_a_timeout_and_a_lost_handler_process_are_failures() -> None:
    timeout = failures.timed_out("handler timeout after 5.0s", 4321)
    assert timeout.summary == "HandlerTimeout: handler timeout after 5.0s (handler process " \
                              "4321 killed)"
    assert failures.lost(4321, -9).summary == (
        "WorkerLost: handler process 4321 killed by signal 9 (SIGKILL)")
    assert failures.lost(4321, 1).summary == "WorkerLost: handler process 4321 exited with code 1"
    assert failures.lost(4321, 70).summary == (  # worker.process.CHILD_BROKEN
        "WorkerLost: handler process 4321 exited with code 70 (broken: the error it logged "
        "before says why)")
    assert failures.lost(4321, -200).summary == (
        "WorkerLost: handler process 4321 killed by signal 200")


def test_a_chained_failure_shows_its_cause_and_a_deep_one_its_innermost_frames() -> None:
    def wrapped() -> None:
        try:
            {}["key"]
        except KeyError as error:
            raise RuntimeError("lookup failed") from error

    try:
        wrapped()
    except RuntimeError as error:
        failure = failure_of(error)
    text = failure.traceback
    assert text.index("KeyError: 'key'") < text.index("direct cause") < text.index(
        "RuntimeError: lookup failed")
    assert "{}[\"key\"]" in text and 'raise RuntimeError("lookup failed") from error' in text

    def deep(depth: int) -> None:
        if depth == 500:
            raise ValueError("bottom")
        deep(depth + 1)

    try:
        deep(0)
    except ValueError as error:
        failure = failure_of(error)
    assert "outer frames not shown]" in failure.traceback
    assert failure.traceback.count(", in deep\n") == tracebacks.MAX_FRAMES
    assert failure.traceback.endswith("ValueError: bottom\n")
