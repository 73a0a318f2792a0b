"""Operator commands: ``python -m supervisor COMMAND CONF ...`` (status, recover, retry,
failed, dead, poison, publish, drain, check). They read and repair a queue's broker state
from outside a running supervisor; none of them is on the hot path, so they favour clear
output over speed. ``acl`` only prints the Redis users the job and these commands need
(``broker.redis.acl``)."""

import os
import platform
import sys
from importlib import metadata

#: The console script's name (pyproject.toml [project.scripts]).
SCRIPT = "queue-supervisor"

#: Subcommand names; any other first argument is a job file to run.
COMMANDS = ("status", "recover", "retry", "failed", "dead", "poison", "publish", "drain",
            "check", "acl")


def program_name() -> str:
    """How this program was started, for usage lines: the console script, or the module."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return SCRIPT if script == SCRIPT else "python -m supervisor"


def version() -> str:
    """``--version``: this package's version and the ones a bug report needs beside it."""
    parts = [f"{SCRIPT} {_installed(SCRIPT)}"]
    parts += [f"{name} {_installed(name)}" for name in ("redis", "nats-py")]
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def output_closed() -> int:
    """stdout's reader went away (``... | head``): point stdout at /dev/null, so that the
    interpreter's last flush cannot fail as well, and exit without a traceback (Python's
    documentation, "Note on SIGPIPE"). The exit code is 1, as Python's own."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1
