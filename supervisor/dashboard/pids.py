"""Which job a page or an action may name: only a pid of the shape the queue's producers
make, so a request cannot make the dashboard read another queue's keys.

A Redis job's record is ``jobs.{q}.<pid>``: a "pid" of ``x.<pid>`` would read
``jobs.{q}.x.<pid>``, which belongs to the queue ``{q}.x``. Every producer writes a pid
in the shape of PHP's ``uniqid('', true)`` (queue 5's ``Message``, and
``broker.envelope.new_pid`` here: a retry by a supervisor keeps the pid, PHP's ``retry()``
makes a new one of the same shape): 13 lowercase hex digits (seconds and microseconds),
then ``lcg_value() * 10`` printed as ``%.8F``, one digit (two only if it rounds up to
10), a dot and eight digits. That one dot sits at a fixed place after hex digits and
digits only, so no accepted pid of one queue is another queue's key: its queue name would
have to be those 14 or 15 characters, and its pid eight digits, which no producer makes.
A NATS dead letter is named by ``seq:N`` (what the dead list links to) or by such a pid.
"""

from __future__ import annotations

import re

#: ``uniqid('', true)``: 8 hex of seconds, 5 hex of microseconds, ``%.8F`` of [0, 10].
PID = re.compile(r"[0-9a-f]{13}(?:[0-9]|10)\.[0-9]{8}")
#: A NATS dead letter by its stream sequence.
SEQ = re.compile(r"seq:[1-9][0-9]{0,18}")
SHAPE = "13 hex digits, then D.DDDDDDDD (PHP's uniqid('', true), as every producer makes)"


def is_pid(text: object) -> bool:
    """A pid of the shape producers make (and nothing more: no other separator)."""
    return isinstance(text, str) and PID.fullmatch(text) is not None


def is_dead_letter(text: object) -> bool:
    """What names a NATS dead letter: ``seq:N`` or a pid."""
    return is_pid(text) or (isinstance(text, str) and SEQ.fullmatch(text) is not None)


def refusal(text: str, nats: bool = False) -> str:
    """Why ``text`` names no job here."""
    allowed = f"seq:N or a pid ({SHAPE})" if nats else f"a pid: {SHAPE}"
    return f"not a job of this queue: the dashboard takes {allowed}, nothing else"
