"""Buffers message pids and writes them in flush(), like a handler batching database rows.

flush() logs "flushing" first and, if a message carried a "gate" path, waits for that file:
the test can look at the outcome ring while flush() is still running.
"""

from tests.handlers._log import append, wait_for

_buffered: list = []


def handle(message) -> None:
    _buffered.append(message)


def flush() -> None:
    if not _buffered:
        return
    log = _buffered[0].payload["log"]
    append(log, "flushing")
    for message in _buffered:
        if "gate" in message.payload:
            wait_for(message.payload["gate"])
    append(log, "flush " + ",".join(message.pid for message in _buffered))
    _buffered.clear()
