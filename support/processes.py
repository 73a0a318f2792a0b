"""Walks of process trees that survive a process ending mid-walk, for tests and benchmarks
(issue 39.6).

A walk lists processes (``children()``, ``process_iter``) and then reads each one, and any
of them may exit in between: one that exited but was not reaped yet is a zombie, whose
command line is gone (psutil raises ZombieProcess, a NoSuchProcess), one already reaped
raises NoSuchProcess. For a walk either is simply gone: these helpers say so instead of
raising. Titles and liveness are read as the product reads them (``supervisor.ops.drain``:
``drain``, ``status`` and the dashboard walk the same way).
"""

from __future__ import annotations

import contextlib
import signal

import psutil

from supervisor.ops.drain import running, title

__all__ = ["family", "gone", "handlers", "kill", "name", "running", "title"]


def family(pid: int) -> list[psutil.Process]:
    """The process and every process below it, as listed now ([] once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def handlers(pid: int, queue: str) -> list[psutil.Process]:
    """The handler processes below supervisor ``pid`` (titled ``queue-supervisor: <queue>
    handler <n> ...``; not the fork server nor its handler servers), as listed now."""
    prefix = f"queue-supervisor: {queue} handler "
    return [process for process in family(pid)[1:] if title(process).startswith(prefix)]


def name(process: psutil.Process) -> str:
    """The executable's name, "" once the process is gone."""
    try:
        return process.name()
    except (psutil.NoSuchProcess, OSError):
        return ""


def gone(process: psutil.Process) -> bool:
    """Ended (a zombie its parent has not reaped yet counts as ended)."""
    return not running(process)


def kill(process: psutil.Process, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` (SIGKILL), unless it ended meanwhile."""
    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(sig)
