"""Post-fork set-up shared by the fork server and the handler processes."""

from __future__ import annotations

import ctypes
import signal
import sys

#: Exit codes of a handler process, read by the supervisor when it reaps one.
CHILD_ORPHANED = 1  # it found its parent gone (the fork server exits so too)
CHILD_INIT_FAILED = 3  # its handler failed to load or init() raised: every process would
CHILD_BROKEN = 70  # our own code raised in it (not the handler): a lost worker

_PR_SET_PDEATHSIG = 1
_ALWAYS_DEFAULT = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` when our parent dies (Linux only).

    Returns False where that is not available; callers also watch ``os.getppid()``,
    which covers the race of a parent that died before this call.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reset_signals() -> None:
    """Undo the signal set-up inherited through fork.

    Python-level handlers become the default action (they belong to the parent's
    program), and so do SIGINT, SIGTERM and SIGCHLD; nothing stays blocked and no
    wake-up fd is inherited. Other ignored signals stay ignored (SIGPIPE, as Python
    itself sets it).
    """
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if callable(handler) or signum in _ALWAYS_DEFAULT:
            signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
