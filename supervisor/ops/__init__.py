"""Operator commands: ``python -m supervisor COMMAND CONF ...`` (status, recover, retry,
publish, drain, check). They read and repair a queue's broker state from outside a running
supervisor; none of them is on the hot path, so they favour clear output over speed. ``acl``
only prints the Redis users the job and these commands need (``broker.redis.acl``)."""

import os
import sys

#: The console script's name (pyproject.toml [project.scripts]).
SCRIPT = "queue-supervisor"

#: Subcommand names; any other first argument is a job file to run.
COMMANDS = ("status", "recover", "retry", "publish", "drain", "check", "acl")


def program_name() -> str:
    """How this program was started, for usage lines: the console script, or the module."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return SCRIPT if script == SCRIPT else "python -m supervisor"
