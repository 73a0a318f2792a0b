"""Running the chaos soak (``python -m bench.chaos``) from a test, and reading its verdict."""

from __future__ import annotations

import subprocess
import sys

from support.servers import environ_without_broker
from support.supervision import ROOT


def soak(broker: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--broker", broker, "--quiet", *args],
        cwd=ROOT, env=environ_without_broker(), capture_output=True, text=True,
        timeout=timeout,
    )


def failed_rows(output: str) -> list[str]:
    """The check rows that failed (not the closing "result (...): FAIL" line)."""
    return [line for line in output.splitlines() if not line.startswith("result (")
            and (line.split()[-1:] == ["FAIL"] or "  FAIL  (" in line)]
