"""The chaos soak's handler: ``examples.stats_usage`` with seeded failures and a ledger.

A payload may carry ``"chaos": {"fail": p, "draw": n}``: the call then fails with
probability ``p``, decided by a hash of (seed, n, attempts), so a run is reproducible and a
retry (attempts + 1) gets a fresh draw; ``"chaos": {"work": s}`` makes the call ``s``
seconds longer (besides ``$CHAOS_WORK_MS`` for every call). The failure happens before
the message is buffered, so it can never touch the totals; everything else is the
stats-usage handler unchanged (its own validation rejects a payload without a metrics
list, its ``flush()`` counts each pid once).

Every call and every durable flush is appended to ``$CHAOS_LEDGER`` with one ``write()``
on an ``O_APPEND`` descriptor, so concurrent handler processes never interleave lines:

    I <unix time> <process> <pid> <attempts> <outcome>   one call: "." buffered,
                                                       "x" seeded failure, "v" invalid payload
    C <unix time> <process> <pid> <pid> ...              these pids' flush() returned

A ``C`` line is written after ``flush()`` returned, so a process killed between the database
commit and that write under-reports one flush; the store (its seen pids) stays the authority on
what was counted.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from examples import stats_usage

ENV_LEDGER = "CHAOS_LEDGER"
ENV_SEED = "CHAOS_SEED"
#: Milliseconds each call takes (a sleep standing for the I/O of a real handler).
ENV_WORK_MS = "CHAOS_WORK_MS"

class ChaosFailure(Exception):
    """The seeded failure of one call (the message is retried by policy)."""


class LedgerLines:
    """This process's lines in ``$CHAOS_LEDGER`` and the pids its store has buffered; the
    plain and the async handler both keep one."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.work = 0.0  # seconds each call takes ($CHAOS_WORK_MS)
        self.buffered: list[str] = []  # pids buffered in the store since the last flush

    def open(self) -> None:
        self.work = float(os.environ.get(ENV_WORK_MS, "0")) / 1000
        self.fd = os.open(os.environ[ENV_LEDGER], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def before(self, message: Any) -> None:
        """The seeded failure, if this call draws one (written, then raised)."""
        if seeded_failure(message.payload, message.pid, message.attempts):
            self.call(message, "x")
            raise ChaosFailure(f"seeded failure of {message.pid} at attempt {message.attempts}")

    def call(self, message: Any, outcome: str) -> None:
        self._write(f"I {time.time():.3f} {os.getpid()} {message.pid} {message.attempts} "
                    f"{outcome}\n")
        if outcome == ".":
            self.buffered.append(message.pid)

    def take_buffered(self) -> list[str]:
        """The pids the next flush covers (the store empties its buffer whether or not the
        flush succeeds)."""
        pids, self.buffered = self.buffered, []
        return pids

    def flushed(self, pids: list[str]) -> None:
        if pids:
            self._write(f"C {time.time():.3f} {os.getpid()} {' '.join(pids)}\n")

    def _write(self, line: str) -> None:
        if self.fd is None:
            raise RuntimeError("chaos handler used before init()")
        os.write(self.fd, line.encode())


_lines = LedgerLines()


def init() -> None:
    stats_usage.init()
    _lines.open()


def fails(seed: str, draw: object, attempts: int, probability: float) -> bool:
    """The seeded draw: True with ``probability`` for this (seed, draw, attempts)."""
    if probability <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{draw}:{attempts}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < probability


def extra_work(payload: Any) -> float:
    """``"chaos": {"work": seconds}``: this call takes that much longer."""
    chaos = payload.get("chaos") if isinstance(payload, dict) else None
    work = chaos.get("work", 0) if isinstance(chaos, dict) else 0
    return float(work) if isinstance(work, int | float) and work > 0 else 0.0


def seeded_failure(payload: Any, pid: str, attempts: int) -> bool:
    chaos = payload.get("chaos") if isinstance(payload, dict) else None
    if not isinstance(chaos, dict):
        return False
    probability = chaos.get("fail", 0)
    if not isinstance(probability, int | float):
        return False
    seed = os.environ.get(ENV_SEED, "0")
    return fails(seed, chaos.get("draw", pid), attempts, float(probability))


def handle(message: Any) -> None:
    time.sleep(_lines.work + extra_work(message.payload))
    _lines.before(message)
    try:
        stats_usage.handle(message)
    except ValueError:
        _lines.call(message, "v")
        raise
    _lines.call(message, ".")


def flush() -> None:
    pids = _lines.take_buffered()
    stats_usage.flush()
    _lines.flushed(pids)
