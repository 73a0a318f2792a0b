"""The machine a benchmark ran on, and how busy it was."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(servers: dict[str, str], load_at_start: list[float]) -> dict[str, Any]:
    memory = psutil.virtual_memory()
    return {
        "cpu": cpu_model(),
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_gib": round(memory.total / 2**30, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": _versions("redis", "hiredis", "nats-py", "uvloop", "orjson", "dramatiq"),
        "servers": servers,
        "load_at_start": load_at_start,
    }


def load() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def busy_processes(threshold: float = 10.0) -> list[str]:
    """Processes using more than ``threshold`` % of a core right now (a quiet machine has none
    besides the benchmark)."""
    try:
        out = subprocess.run(["top", "-bn1", "-w", "200"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    busy = []
    lines = out.splitlines()
    header = next((i for i, line in enumerate(lines) if line.lstrip().startswith("PID")), None)
    if header is None:
        return []
    for line in lines[header + 1:]:
        fields = line.split()
        try:
            if float(fields[8]) >= threshold:
                busy.append(f"{fields[-1]} {fields[8]}%")
        except (IndexError, ValueError):
            continue
    return busy


def _versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found
