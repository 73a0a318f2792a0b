"""A handler process's title: its queue and place, idle or busy, and the job it runs.

``ps`` (and the operator commands and the dashboard, through psutil) read it::

    queue-supervisor: q handler 0 idle
    queue-supervisor: q handler 0 busy: job 6b0ef07966.3653 attempt 2 since 2026-12-01T14:03:07Z
    queue-supervisor: q handler 1 busy: 12 running, oldest job 6b0ef07a01.1 attempt 1 since ...

A plain ``def`` handler's process only notes the job it starts (``Watched.state``: one
store a job); a thread of its own writes the title from that note every ``TICK`` (0.5 s),
when it changed: writing it at each start cost the no-op's handler process 1.5 µs a job
(its CPU per job went from 4.5 to 6 µs), for titles no one reads between two ticks. A job
that runs long is named within a tick of its start, and stays named until the next job or
until the process goes idle (50 ms without work). An ``async def`` handler's process
writes how many run and the oldest of them at most every tick of its loop (0.1 s), only
when that changed: its jobs start and end in bursts that a title per job would follow at a
cost and no one could read.

The start is UTC wall-clock time to the second, so that a reader on the same host (the
NATS ``status``, which has no supervisor records to read) can tell how long a job has run.
A job's pid is the producer's: one that is long or holds unprintable characters (a NUL
would make ``setproctitle`` raise) is written escaped and cut, so the title stays one line
of bounded length, and ``parse`` reads it back from the end, where only our text is.
"""

from __future__ import annotations

import calendar
import re
import threading
import time
from dataclasses import dataclass

import setproctitle

#: Characters of a job's pid a title shows at most (queue 5's pids have 23).
PID_CHARS = 64
_STAMP = "%Y-%m-%dT%H:%M:%SZ"
_JOB = re.compile(
    r"^(?P<handler>\d+) busy: (?:(?P<count>\d+) running, oldest )?job (?P<pid>.*) "
    r"attempt (?P<attempt>-?\d+) since (?P<since>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$")
_STATE = re.compile(r"^(?P<handler>\d+) (?P<state>busy|idle)(?:$|: (?P<count>\d+) running$)")


def shown_pid(pid: str) -> str:
    """``pid`` as a title shows it: escaped if it holds anything unprintable, cut."""
    if not pid.isprintable():
        pid = ascii(pid)[1:-1]
    return pid if len(pid) <= PID_CHARS else pid[:PID_CHARS - 3] + "..."


class Title:
    """The process title, written only when what it says changed (or a job started)."""

    def __init__(self, queue: str, place: int) -> None:
        self._prefix = f"queue-supervisor: {queue} handler {place}"
        self._busy: bool | None = None
        self._text = ""  # the title written last
        self._second = -1  # the whole second ``_since`` says
        self._since = ""
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        """Busy or idle; a job named by ``job`` stays named while the process is busy."""
        if busy != self._busy:
            self._busy = busy
            self._write(f"{self._prefix} {'busy' if busy else 'idle'}")

    def job(self, pid: str, attempts: int, since: float | None = None) -> None:
        """A plain handler started the job ``pid`` (``attempts``: its runs before this one)
        at ``since`` (unix s; now by default)."""
        second = int(time.time() if since is None else since)
        if second != self._second:
            self._second, self._since = second, time.strftime(_STAMP, time.gmtime(second))
        if len(pid) > PID_CHARS or not pid.isprintable():
            pid = shown_pid(pid)
        self._busy = True
        self._write(f"{self._prefix} busy: job {pid} attempt {attempts + 1} since {self._since}")

    def jobs(self, running: int, oldest: tuple[str, int, float] | None, busy: bool) -> None:
        """An async handler runs ``running`` jobs; ``oldest``: the pid, attempts and start
        (unix s) of the one that started first, when known; ``busy``: none runs, but the
        process has other work (``on_success``, ``flush()``)."""
        if not running:
            text = f"{self._prefix} {'busy' if busy else 'idle'}"
        elif oldest is None:
            text = f"{self._prefix} busy: {running} running"
        else:
            pid, attempts, began = oldest
            text = (f"{self._prefix} busy: {running} running, oldest job {shown_pid(pid)} "
                    f"attempt {attempts + 1} since {stamp(began)}")
        self._busy = bool(running) or busy
        if text != self._text:
            self._write(text)

    def _write(self, text: str) -> None:
        self._text = text
        setproctitle.setproctitle(text)


#: Seconds between two looks of a plain handler's title thread at what its process runs.
TICK = 0.5

#: What a plain handler's process does now: idle (False), busy with no job named (True), or
#: running a job: (its pid, its runs before this one, its start on the monotonic clock).
State = bool | tuple[str, int, float]


class Watched:
    """A plain handler's title, written by a thread of its own (see the module docstring).

    The process's loop assigns ``state`` (a new tuple per job: the thread tells a change by
    identity, never by comparing); the thread is the only writer of the title once started.
    """

    def __init__(self, title: Title) -> None:
        self.state: State = False
        self._title = title
        self._shown: State = False

    def start(self) -> None:
        threading.Thread(target=self._run, name="title", daemon=True).start()

    def show(self) -> None:
        """Write the title if ``state`` changed since it was last written."""
        state = self.state
        if state is self._shown:
            return
        self._shown = state
        if isinstance(state, tuple):
            pid, attempts, began = state
            self._title.job(pid, attempts, time.time() - (time.monotonic() - began))
        else:
            self._title.set_busy(state)

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            self.show()


def stamp(when: float) -> str:
    """A title's start time: UTC, to the second."""
    return time.strftime(_STAMP, time.gmtime(when))


@dataclass(frozen=True, slots=True)
class HandlerTitle:
    """What a handler process's title says (``parse``)."""

    handler: int
    busy: bool
    running: int = 0  # jobs running (an async process; a busy plain one: 1)
    pid: str = ""  # the job named (the oldest of several), as the title shows it
    attempt: int = 0  # its run, from 1 (0: no job named)
    since: float | None = None  # its start, unix s


def parse(text: str) -> HandlerTitle | None:
    """A handler title after its ``queue-supervisor: <queue> handler `` prefix, read
    back; None if it is not one (another version's, or cut short)."""
    text = text.rstrip()  # a title shorter than the one before is padded with spaces
    found = _JOB.match(text)
    if found is not None:
        since = calendar.timegm(time.strptime(found["since"], _STAMP))
        return HandlerTitle(int(found["handler"]), True, int(found["count"] or 1),
                            found["pid"], int(found["attempt"]), float(since))
    found = _STATE.match(text)
    if found is None:
        return None
    busy = found["state"] == "busy"
    return HandlerTitle(int(found["handler"]), busy, int(found["count"] or busy))
