"""The failure record kept beside a failed or dead job (broker/failure.py)."""

import orjson
import pytest

from broker.failure import MAX_RECORD_BYTES, MAX_TRACEBACK_BYTES, Failure


def test_a_record_round_trips() -> None:
    failure = Failure(error="mymod.Timeout", message="db down", where="h.py:3 in handle",
                      traceback="Traceback...\n", attempt=2, at=1.5, outcome="retrying",
                      consumer="host-1")
    assert Failure.decode(failure.encode()) == failure
    assert failure.summary == "mymod.Timeout: db down"


def test_huge_and_strange_values_are_bounded_and_keep_the_traceback_end() -> None:
    failure = Failure(error="E", message="\u202e<script>" * 100_000,
                      traceback="x" * 100_000 + "raise E")
    data = failure.encode()
    assert len(data) <= MAX_RECORD_BYTES
    decoded = Failure.decode(data)
    assert decoded.traceback.endswith("raise E")
    assert len(decoded.traceback.encode()) <= MAX_TRACEBACK_BYTES


def test_other_versions_records_are_read_leniently() -> None:
    data = orjson.dumps({"error": "E", "attempt": True, "at": 5, "later": [1]})
    assert Failure.decode(data) == Failure(error="E", at=5.0)


@pytest.mark.parametrize("data", [b"", b"[]", b'{"message": "m"}', b"\xff", b'{"error": 1}'])
def test_what_is_not_a_record_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a failure record"):
        Failure.decode(data)


def test_a_line_of_text_becomes_a_record() -> None:
    assert Failure.from_text("ValueError: bad").summary == "ValueError: bad"
    assert Failure.from_text("worker lost: killed by signal 9").message == (
        "worker lost: killed by signal 9")
    assert Failure.from_text(None).message == "unknown error"
