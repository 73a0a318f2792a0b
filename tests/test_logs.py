"""Log output: one JSON object per line; the malformed-message helper never logs a payload."""

from __future__ import annotations

import io
import logging
import re

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


# A pid as a hostile producer could write it: terminal escapes (clear the screen, move the
# cursor, retitle the window), a forged record after CR/LF, and 100 KB in all.
HOSTILE_PID = ("\x1b[2J\x1b[H\x1b]0;owned\x07" + "p1\r\n2026-01-01 ERROR supervisor[1]: forged"
               + "\u202e\x00\x9b" + "x" * 100_000)
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202e]")


def log_hostile_message() -> None:
    """The supervisor's and a handler process's own lines that carry a message's fields."""
    log = logging.getLogger("supervisor")
    log.warning("delivery %s is no longer ours; dropped before it started", HOSTILE_PID,
                extra={"queue": HOSTILE_PID, "pid": HOSTILE_PID})
    logging.getLogger("worker.runner").warning(
        "delivery %d (job %s) failed: %s%s", 7, HOSTILE_PID,
        f"RuntimeError: asked to fail ({HOSTILE_PID})", " (handler.py:3)",
        extra={"error": RuntimeError(HOSTILE_PID)})
    log.error("%s of %s not confirmed (%s: %r); will settle again", "commit", HOSTILE_PID,
              "uncertain", HOSTILE_PID.encode())


def assert_safe(line: str) -> None:
    assert not CONTROL.search(line), repr(line[:300])
    assert len(line) < 3000  # three fields of 200 characters and their markers, not 100 KB
    assert "...[cut: 100" in line  # the marker says a value was cut, and its full length


def test_a_hostile_pid_is_escaped_and_cut_in_json_lines(stream):
    logs.setup("info", stream)
    log_hostile_message()
    lines = stream.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 4  # three records, three lines, nothing forged
    for line in lines[:3]:
        assert_safe(line)
        record = orjson.loads(line)
        for field in record.values():  # what jq -r prints is as safe as the line
            assert not CONTROL.search(str(field))
            assert len(str(field)) < 1500
        assert "\\x1b[2J\\x1b[H\\x1b]0;owned\\x07p1\\x0d\\x0a2026" in record["message"]
    first, second, _ = (orjson.loads(line) for line in lines[:3])
    assert first["pid"].startswith("\\x1b[2J") and first["queue"] == first["pid"]
    assert len(first["pid"]) <= logs.MAX_FIELD + len("...[cut: 100046 characters]")
    assert second["error"].startswith("\\x1b[2J")


def test_a_hostile_pid_is_escaped_and_cut_on_a_terminal(stream):
    logs.setup("info", stream, json=False)
    log_hostile_message()
    lines = stream.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 4
    for line in lines[:3]:
        assert_safe(line)
        assert "forged" not in line.partition("\\x0d\\x0a")[0]  # never before the escaped break
    assert " WARNING supervisor[" in lines[0] and " pid=\\x1b[2J" in lines[0]
    assert " WARNING worker.runner[" in lines[1] and "failed: RuntimeError: asked" in lines[1]


def test_a_traceback_stays_inside_its_record(stream):
    logs.setup("info", stream, json=False)
    try:
        raise ValueError("bad\x1b[2J\n2026-01-01 ERROR supervisor[1]: forged")
    except ValueError:
        logging.getLogger("supervisor").exception("handler failed")
    first, *rest = stream.getvalue().rstrip("\n").split("\n")
    assert "ERROR supervisor[" in first and rest
    assert all(line.startswith("    ") for line in rest)  # indented: none reads as a record
    assert "\x1b" not in stream.getvalue() and "\\x1b[2J" in stream.getvalue()


def test_our_own_explanations_are_not_cut_at_the_field_limit(stream):
    logs.setup("info", stream)
    warning = "job.toml: [nats] max_deliver is no longer used and is ignored: " + "why " * 80
    log = logging.getLogger("supervisor")
    log.warning("%s", logs.Explanation(warning))
    log.error("cannot connect to the broker: %s", RuntimeError(warning))
    first, second = records(stream)
    assert first["message"] == warning
    assert second["message"].endswith(warning)


def test_a_url_in_a_log_line_is_redacted_whoever_passed_it(stream):
    logs.setup("info", stream)
    logging.getLogger("x").error("lost %s", "redis://:Zx9-s3cret@Hq7@h:1/0?password=Zx9-s3cret",
                                 extra={"error": "nats://Zx9-s3cret@h:4222"})
    assert "Zx9" not in stream.getvalue() and "Hq7" not in stream.getvalue()
