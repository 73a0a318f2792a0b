"""``drain``: find this host's supervisors of a queue through their records and stop them.

Every supervisor keeps a record in its broker, ``supervisors.{q}.<consumer id>`` = "host
pid" (written at connect, renewed with its deliveries). Drain reads the records of the
queue in the Redis given, keeps those of this host, and checks each pid's title (a record
may outlive its process by a lease, and a pid can be reused): only a process titled
``queue-supervisor: <queue> ...`` is signalled. A supervisor of another Redis that serves a
queue of the same name is never touched. Handler processes (``queue-supervisor: <queue>
handler <n> ...``) get no signal of ours: the supervisor stops them itself (the same split
as systemd's KillMode=mixed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterable

import psutil

TITLE = "queue-supervisor: {queue} "
#: Seconds between checks whether the stopped supervisors exited.
POLL = 0.1


def title(process: psutil.Process) -> str:
    """The process title as ``ps`` shows it (setproctitle rewrites the command line, and
    pads a title shorter than the one before with spaces: those are left out); "" for one
    that ended since it was listed (a zombie too) or cannot be read. (psutil lets a bare
    FileNotFoundError through when /proc/<pid> is half gone.)"""
    try:
        return " ".join(process.cmdline()).rstrip()
    except (psutil.Error, OSError):
        return ""


def is_supervisor_of(text: str, queue: str) -> bool:
    prefix = TITLE.format(queue=queue)
    return text.startswith(prefix) and not text[len(prefix):].startswith("handler ")


def find_supervisors(
    queue: str, records: Iterable[str]
) -> tuple[list[psutil.Process], list[str]]:
    """From the queue's records ("host pid"): this host's running supervisors of ``queue``
    (never this process), and the records of other hosts (to be drained there)."""
    here, found, elsewhere = socket.gethostname(), [], []
    for record in records:
        host, _, pid = record.rpartition(" ")
        if host != here:
            elsewhere.append(record)
            continue
        if not pid.isdecimal() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):  # gone, or another user's (hidepid)
            process = psutil.Process(int(pid))
            if is_supervisor_of(title(process), queue):
                found.append(process)
    return found, elsewhere


def stop(
    processes: list[psutil.Process], timeout: float
) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """SIGTERM each, wait up to ``timeout`` s for all to exit; returns (gone, still alive)."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGTERM)  # AccessDenied surfaces: not ours to stop
    deadline = time.monotonic() + timeout
    alive = [process for process in processes if running(process)]
    while alive and time.monotonic() < deadline:
        time.sleep(POLL)
        alive = [process for process in alive if running(process)]
    return [process for process in processes if process not in alive], alive


def running(process: psutil.Process) -> bool:
    """Still running; an exited process its parent has not reaped yet counts as gone."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
