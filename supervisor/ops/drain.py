"""``drain``: find this host's supervisors of a queue by process title and stop them.

A supervisor's title is ``queue-supervisor: <queue> <state> [...]``; its handler processes
are ``queue-supervisor: <queue> handler <n> ...`` and get no signal of ours: the supervisor
stops them itself (the same split as systemd's KillMode=mixed).
"""

from __future__ import annotations

import contextlib
import signal
import time

import psutil

TITLE = "queue-supervisor: {queue} "
#: Seconds between checks whether the stopped supervisors exited.
POLL = 0.1


def title(process: psutil.Process) -> str:
    """The process title as ``ps`` shows it (setproctitle rewrites the command line)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def is_supervisor_of(text: str, queue: str) -> bool:
    prefix = TITLE.format(queue=queue)
    return text.startswith(prefix) and not text[len(prefix):].startswith("handler ")


def find_supervisors(queue: str) -> list[psutil.Process]:
    """Running supervisors of ``queue`` on this host (never this process)."""
    found = []
    for process in psutil.process_iter():
        if process.pid != psutil.Process().pid and is_supervisor_of(title(process), queue):
            found.append(process)
    return found


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
