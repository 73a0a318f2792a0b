"""A no-op handler that records queue latency: handler start minus the publish time.

Payloads carry their float publish time in ``t`` (the envelope's timestamp is whole
seconds). Each handler process appends one 8-byte float per message to its own file in
``$BENCH_LATENCY_DIR`` (one write of 8 bytes: cheap next to a delivery, and nothing is held
back until exit). No ``flush()``: the supervisor acknowledges exactly as for the no-op.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any

ENV_DIR = "BENCH_LATENCY_DIR"
_pack = struct.Struct("<d").pack
_fd: int | None = None


def own_file(prefix: str) -> int:
    """This process's file in ``$BENCH_LATENCY_DIR`` (``<prefix>-<pid>.bin``), to append to."""
    folder = os.environ.get(ENV_DIR) or "."
    return os.open(os.path.join(folder, f"{prefix}-{os.getpid()}.bin"),
                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def files(folder: str, prefix: str) -> list[str]:
    """Every process's file of ``prefix`` in ``folder``."""
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))
            if name.startswith(f"{prefix}-") and name.endswith(".bin")]


def _open() -> int:
    global _fd
    _fd = own_file("latency")
    return _fd


def record(message: Any) -> None:
    began = time.time()
    published = message.payload.get("t")
    if isinstance(published, float):
        os.write(_fd if _fd is not None else _open(), _pack(began - published))


def handle(message: Any) -> None:
    record(message)


def read(folder: str) -> list[float]:
    """Every latency (seconds) the handler processes wrote in ``folder``."""
    samples: list[float] = []
    for path in files(folder, "latency"):
        with open(path, "rb") as file:
            data = file.read()
        samples += [value for (value,) in struct.iter_unpack("<d", data[: len(data) // 8 * 8])]
    return samples
