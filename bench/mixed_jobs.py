"""The mixed workload of ``python -m bench.mixed``, and the one handler every peer runs.

Job ``n`` sleeps ``duration_ms(n, workload)``: 1 ms, except one job in every hundred that
sleeps 500 ms (at a seeded random place within its hundred, so the same jobs are slow for
every peer and every run, and slow jobs never bunch up more than two in a row); with the
"hung" workload, job ``HUNG_AT`` sleeps an hour, far longer than any run. A sleep, as a
handler waiting on I/O would: the work costs no CPU, so the peers compare on how they hand
jobs to processes, not on how fast they compute.

The handler (``run``, wrapped by each peer: ``handle`` for the supervisor, an actor for
Dramatiq, a plain call in the take-when-free loop) writes one record per finished job to a
file of its process in ``$BENCH_LATENCY_DIR``: the job's number, its publish time (the
payload's ``t``), and its start and end (``time.time()``). One 32-byte ``os.write`` on an
O_APPEND file, after the sleep: the records alone say which jobs ran, when, how long each
waited in the queue (start - publish) and when the run ended, the same way for every peer
(no peer's own bookkeeping is read). A job that never ends writes nothing.
"""

from __future__ import annotations

import functools
import os
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

from bench.latency import files, own_file

SHORT_MS, SLOW_MS, HUNG_MS = 1, 500, 3_600_000
#: One slow job in every BLOCK jobs.
BLOCK = 100
#: The hung job's number (early, so it holds a process for almost the whole run).
HUNG_AT = 10
WORKLOADS = ("mixed", "mixed+hung")
SEED = 38

_RECORD = struct.Struct("<4d")  # n, published, started, ended
_fd: int | None = None


@functools.cache
def slow_offset(block: int) -> int:
    """Where the slow job of jobs ``block*100 .. block*100+99`` is (seeded, so fixed)."""
    return random.Random(SEED * 1_000_003 + block).randrange(BLOCK)


def duration_ms(n: int, workload: str) -> int:
    if workload == "mixed+hung" and n == HUNG_AT:
        return HUNG_MS
    return SLOW_MS if n % BLOCK == slow_offset(n // BLOCK) else SHORT_MS


def hung(workload: str, messages: int) -> int:
    """How many of ``messages`` jobs never end."""
    return int(workload == "mixed+hung" and messages > HUNG_AT)


def payload(n: int, workload: str, published: float | None = None) -> dict[str, Any]:
    """Job ``n``: its sleep in whole milliseconds (an integer, which survives PHP's JSON
    unchanged) and its float publish time."""
    return {"n": n, "ms": duration_ms(n, workload),
            "t": time.time() if published is None else published}


def run(job: dict[str, Any]) -> None:
    """The work: sleep the job's time, then record it (see the module docstring)."""
    started = time.time()
    time.sleep(int(job["ms"]) / 1000)
    record = _RECORD.pack(float(job["n"]), float(job["t"]), started, time.time())
    os.write(_fd if _fd is not None else _open(), record)


def handle(message: Any) -> None:
    """The supervisor's handler (``bench.mixed_jobs:handle``)."""
    run(message.payload)


def _open() -> int:
    global _fd
    _fd = own_file("mixed")
    return _fd


@dataclass(frozen=True)
class Record:
    n: int
    published: float
    started: float
    ended: float

    @property
    def waited(self) -> float:
        """Queue latency (s): handler start minus publish time."""
        return self.started - self.published


def finished(folder: str) -> int:
    """How many records the processes wrote so far (cheap: file sizes only)."""
    return sum(os.stat(path).st_size for path in files(folder, "mixed")) // _RECORD.size


def read(folder: str) -> list[Record]:
    records: list[Record] = []
    for path in files(folder, "mixed"):
        with open(path, "rb") as file:
            data = file.read()
        records += [Record(int(n), published, started, ended) for n, published, started, ended
                    in _RECORD.iter_unpack(data[: len(data) // _RECORD.size * _RECORD.size])]
    return records
