"""Logging set-up: one JSON object per line, or readable lines when stderr is a terminal.

Every record carries ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``process`` and
``message``; ``queue``, ``pid`` (a message's pid), ``consumer``, ``error`` and a failed
run's ``attempt``, ``max_attempts``, ``outcome``, ``where`` and ``traceback`` (its handler's,
in JSON only) are added when passed with ``extra=``. A traceback goes into ``exc`` of the
same object, so a record is always exactly one line, whatever it contains: log collectors
never see half a record.

Values put into a record (the ``%`` arguments and the extras) are data, often from a
message (pid, queue, reason, a handler's error text, a payload excerpt): control
characters in them are escaped (``\\x1b``), so none reaches a terminal or forges a line,
and each is cut at ``MAX_FIELD`` characters with a marker. Errors this program composed
(exceptions, ``Explanation``) may run to ``MAX_EXPLANATION``. Broker URLs in a line are
redacted (``broker.urls.redact``) whatever passed them in.

Handler processes are forked after ``setup`` ran, so they log the same way. A process a
handler starts (the stats-usage example's writer) is not a fork: ``setup`` leaves the format
and level in the environment (``ENV_LOG``) and such a process calls ``setup_inherited``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import orjson

from broker.urls import redact

#: Fields taken from ``extra=`` when present, in this order (``traceback`` after them).
EXTRA_FIELDS = ("queue", "pid", "consumer", "attempt", "max_attempts", "outcome", "error",
                "where")
#: What the text format leaves out: the message of a failed run's line says it already.
_SAID_IN_THE_MESSAGE = frozenset(("error", "attempt", "max_attempts", "outcome", "where"))
#: A value from outside (pid, queue, reason, handler error text) is cut after this many
#: characters: it must describe the input, never carry it.
MAX_FIELD = 200
#: An error this program composed (a broker refusal explains itself in a few sentences).
MAX_EXPLANATION = 1000
#: The whole message, whatever was interpolated: a backstop, never reached by our own lines.
MAX_MESSAGE = 4000
#: A traceback (kept on several lines inside ``exc``).
MAX_TRACEBACK = 20_000
#: A handler's traceback on a failed run's line: its last this many characters, each of its
#: lines cut at MAX_FIELD (it repeats what the handler raised, often a message's data). The
#: whole of it is in the failure record the broker keeps.
MAX_HANDLER_TRACEBACK = 4000
MAX_REASON = MAX_FIELD
MALFORMED = "malformed message moved to poison: %s"
#: ``json:info`` or ``text:debug``: how the job logs, for the processes its handlers start.
ENV_LOG = "QUEUE_SUPERVISOR_LOG"

#: What a terminal or a log reader could act on: C0/C1 controls, DEL, line and paragraph
#: separators, bidirectional overrides, and lone surrogates (which no UTF-8 encoder takes).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069"
                     r"\ud800-\udfff]")
#: The same, but a traceback keeps its line breaks (it is indented or inside one JSON string).
_UNSAFE_IN_TRACEBACK = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f"
                                  r"\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


class Explanation(str):
    """Text this program composed, e.g. a configuration warning: cut at MAX_EXPLANATION."""


def escape(text: str) -> str:
    """``text`` with every unsafe character written as ``\\xNN`` or ``\\uNNNN``."""
    return _UNSAFE.sub(_escaped, text)


def clean(text: str, limit: int = MAX_FIELD) -> str:
    """``text`` escaped and, beyond ``limit`` characters, cut with a marker saying so."""
    shown = escape(text[: limit + 1])
    if len(text) <= limit and len(shown) <= limit:
        return shown
    return f"{shown[:limit]}...[cut: {len(text)} characters]"


def error_line(text: object) -> str:
    """``error: ...`` for stderr, as one safe line: URLs redacted, unsafe characters escaped."""
    return "error: " + clean(redact(str(text)), MAX_MESSAGE)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class _Field:
    """A ``%`` argument as it may appear: ``%s`` and ``%r`` both give the cleaned text."""

    __slots__ = ("limit", "value")

    def __init__(self, value: Any, limit: int) -> None:
        self.value, self.limit = value, limit

    def __str__(self) -> str:
        return clean(_text(self.value), self.limit)

    def __repr__(self) -> str:
        return clean(repr(self.value), self.limit)


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "backslashreplace")
    return str(value)


def _limit_of(value: Any) -> int:
    return MAX_EXPLANATION if isinstance(value, BaseException | Explanation) else MAX_FIELD


def _argument(value: Any) -> Any:
    if isinstance(value, int | float):  # bool too: numbers carry nothing and keep %d, %.1f
        return value
    return _Field(value, _limit_of(value))


def message_of(record: logging.LogRecord) -> str:
    """The record's message with every argument cleaned, URLs redacted, one line."""
    args = record.args
    if isinstance(args, Mapping):
        args = {name: _argument(value) for name, value in args.items()}
    elif args:
        args = tuple(_argument(value) for value in args)
    text = str(record.msg) % args if args else str(record.msg)
    return clean(redact(text), MAX_MESSAGE)


def extras_of(record: logging.LogRecord) -> dict[str, str | int]:
    """The extras present, each cleaned like a ``%`` argument (an int stays a number)."""
    found: dict[str, str | int] = {}
    for name in EXTRA_FIELDS:
        value = record.__dict__.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            found[name] = value
        elif value is not None:
            found[name] = clean(redact(_text(value)), _limit_of(value))
    return found


def handler_traceback_of(record: logging.LogRecord) -> str | None:
    """A failed run's traceback passed as ``extra={"traceback": ...}`` (formatted in the
    handler process), kept on its lines like ``exc``, unsafe characters escaped, bounded."""
    text = record.__dict__.get("traceback")
    if not isinstance(text, str) or not text:
        return None
    lines = [_cut(line, MAX_FIELD) for line in redact(text).split("\n")]
    text = _UNSAFE_IN_TRACEBACK.sub(_escaped, "\n".join(lines))
    if len(text) > MAX_HANDLER_TRACEBACK:  # the end is where it raised
        text = f"[cut: {len(text)} characters]...{text[-MAX_HANDLER_TRACEBACK:]}"
    return text


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[cut: {len(text)} characters]"


def traceback_of(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    if not record.exc_info:
        return None
    return _bounded_traceback(redact(formatter.formatException(record.exc_info)))


def _bounded_traceback(text: str) -> str:
    text = _UNSAFE_IN_TRACEBACK.sub(_escaped, text)  # its own line breaks stay
    if len(text) > MAX_TRACEBACK:
        text = f"{text[:MAX_TRACEBACK]}...[cut: {len(text)} characters]"
    return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": record.process,
            "message": message_of(record),
            **extras_of(record),
        }
        handler_traceback = handler_traceback_of(record)
        if handler_traceback is not None:
            entry["traceback"] = handler_traceback
        exc = traceback_of(self, record)
        if exc is not None:
            entry["exc"] = exc
        return orjson.dumps(entry).decode()


class TextFormatter(logging.Formatter):
    """For a person at a terminal: the same fields, one line per record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        shown = logging.makeLogRecord(record.__dict__)
        shown.msg, shown.args = message_of(record), None
        shown.exc_info, shown.exc_text, shown.stack_info = None, None, None
        line = super().format(shown)
        extras = [f"{name}={value}" for name, value in extras_of(record).items()
                  if name not in _SAID_IN_THE_MESSAGE]
        exc = traceback_of(self, record)
        if exc is not None:  # indented, so no line of it looks like a record
            extras.append("\n" + "\n".join("    " + part for part in exc.splitlines()))
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
    os.environ[ENV_LOG] = f"{'json' if json else 'text'}:{level.lower()}"


def setup_inherited(default_level: str = "info") -> None:
    """Log as the job that started this process does (``ENV_LOG``); run by hand, decide as
    ``setup`` does (JSON unless stderr is a terminal)."""
    form, _, level = os.environ.get(ENV_LOG, "").partition(":")
    json = {"json": True, "text": False}.get(form)
    if level.upper() not in logging.getLevelNamesMapping():
        level = default_level
    setup(level, json=json)


def log_malformed(logger: logging.Logger, queue: str, reason: str) -> None:
    """One warning for one malformed message: the reason only, never the payload."""
    reason = one_line(reason)
    logger.warning(MALFORMED, reason, extra={"queue": queue, "error": reason})


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """Whitespace runs as one space, then cut at ``limit`` with a marker (never longer)."""
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
