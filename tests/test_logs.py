"""Log output: one JSON object per line; the malformed-message helper never logs a payload."""

from __future__ import annotations

import io
import logging

import orjson
import pytest

from broker import envelope
from supervisor import logs


@pytest.fixture
def stream():
    """stderr stand-in; the root logger is restored afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    yield out
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def records(out: io.StringIO) -> list[dict]:
    lines = out.getvalue().splitlines()
    return [orjson.loads(line) for line in lines]  # every line is a whole object


def test_one_json_object_per_line_with_the_extras(stream):
    logs.setup("info", stream)
    log = logging.getLogger("supervisor.test")
    log.info("consuming %s", "jobs", extra={"queue": "jobs"})
    log.debug("not shown at info")
    try:
        raise RuntimeError("line one\nline two")
    except RuntimeError:
        log.exception("handler failed", extra={"queue": "jobs", "pid": "abc", "error": "boom"})
    first, second = records(stream)
    assert first["level"] == "info" and first["logger"] == "supervisor.test"
    assert first["message"] == "consuming jobs" and first["queue"] == "jobs"
    assert first["time"].endswith("Z") and isinstance(first["process"], int)
    assert "pid" not in first and "error" not in first
    assert second["level"] == "error"
    assert (second["pid"], second["error"]) == ("abc", "boom")
    assert "RuntimeError: line one\nline two" in second["exc"]  # inside the one line


def test_a_terminal_gets_readable_lines(stream):
    logs.setup("info", stream, json=False)
    logging.getLogger("supervisor").warning("hello", extra={"queue": "jobs"})
    [line] = stream.getvalue().splitlines()
    assert "WARNING supervisor[" in line and line.endswith("hello queue=jobs")


def test_setup_twice_keeps_one_handler(stream):
    logs.setup("info", stream)
    logs.setup("warning", stream)
    logging.getLogger("x").warning("once")
    assert len(records(stream)) == 1


def test_malformed_logs_one_line_with_the_reason_and_never_the_payload(stream):
    logs.setup("info", stream)
    secret = '{"pid": "p1", "queue": "jobs", "payload": "SECRET-TOKEN-123"'
    try:
        envelope.decode(secret.encode())
    except envelope.MalformedEnvelope as error:
        reason = str(error)
    logs.log_malformed(logging.getLogger("supervisor"), "jobs", reason)
    [record] = records(stream)
    assert record["message"] == f"malformed message moved to poison: {reason}"
    assert record["level"] == "warning" and record["queue"] == "jobs"
    assert record["error"] == reason
    assert "SECRET" not in stream.getvalue()


def test_a_long_reason_is_cut_to_one_short_line(stream):
    logs.setup("info", stream)
    logs.log_malformed(logging.getLogger("supervisor"), "jobs", "bad\n" + "x" * 10_000)
    [record] = records(stream)
    assert len(record["error"]) == logs.MAX_REASON and "\n" not in record["error"]
