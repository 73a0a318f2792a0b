"""Logging set-up: one JSON object per line, or readable lines when stderr is a terminal.

Every record carries ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``process`` and
``message``; ``queue``, ``pid`` (a message's pid), ``error`` and ``consumer`` are added
when passed with ``extra=``. A traceback goes into ``exc`` of the same object, so a record
is always exactly one line, whatever it contains: log collectors never see half a record.

Handler processes are forked after ``setup`` ran, so they log the same way.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import orjson

#: Fields taken from ``extra=`` when present, in this order.
EXTRA_FIELDS = ("queue", "pid", "consumer", "error")
#: A reason longer than this is cut: it must describe the input, never carry it.
MAX_REASON = 200
MALFORMED = "malformed message moved to poison: %s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": record.process,
            "message": record.getMessage(),
        }
        for name in EXTRA_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """For a person at a terminal: the same fields, one line per record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [
            f"{name}={record.__dict__[name]}"
            for name in EXTRA_FIELDS
            if record.__dict__.get(name) is not None and name != "error"
        ]
        return " ".join([line, *extras])


def setup(level: str, stream: TextIO | None = None, json: bool | None = None) -> None:
    """Send every log record to ``stream`` (stderr), JSON unless it is a terminal.

    Replaces whatever handlers the root logger had, so calling it twice is harmless.
    """
    stream = stream if stream is not None else sys.stderr
    if json is None:
        json = not _is_terminal(stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def log_malformed(logger: logging.Logger, queue: str, reason: str) -> None:
    """One warning for one malformed message: the reason only, never the payload."""
    reason = one_line(reason)
    logger.warning(MALFORMED, reason, extra={"queue": queue, "error": reason})


def one_line(text: str, limit: int = MAX_REASON) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _iso_time(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
