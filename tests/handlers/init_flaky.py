"""init() raises INIT_ERROR (a builtin exception's name, ConnectionError unless set) the
first INIT_FAILURES times (2 unless set), counted in the file E2E_DIR/init-attempts across
processes; then handles messages as tests.handlers.e2e_record does."""

from __future__ import annotations

import builtins
import os

from tests.handlers.e2e_record import DIR, _append, handle  # noqa: F401 - the handler

_COUNTER = os.path.join(DIR, "init-attempts")


def init() -> None:
    _append("init-attempts", str(os.getpid()))
    with open(_COUNTER) as attempts:
        count = len(attempts.read().splitlines())
    if count <= int(os.environ.get("INIT_FAILURES", "2")):
        error = getattr(builtins, os.environ.get("INIT_ERROR", "ConnectionError"))
        raise error(f"database not up yet (attempt {count})")
