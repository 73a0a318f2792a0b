"""The stats-usage handler: usage metrics per project, on ClickHouse (or SQLite).

A message says how much of which metric one project used, as Appwrite's stats-usage queue
does::

    {"project": {"$id": "6570a1"}, "metrics": [{"key": "executions", "value": 1},
                                               {"key": "bandwidth", "value": 5120}]}

``"projectId": "6570a1"`` is accepted instead of ``"project"``. Values are integers in the
signed 64-bit range and may be negative (a deletion lowers a count); an empty ``metrics``
list is valid and adds nothing.

``handle()`` only validates and buffers; ``flush()`` writes the buffer as one insert (one
transaction on SQLite), and the worker acknowledges the messages only after it returned
(the durability barrier). Each message counts once by its pid, however often it is
delivered and whichever handler process receives it again.

Where: ``$STATS_USAGE_DB`` (see ``examples.usage``): by default ``stats-usage.chdb`` in the
working directory, the embedded ClickHouse engine, which one writer process serves to every
handler process; a ``clickhouse://`` or ``http(s)://`` URL for a ClickHouse server; a path
ending in ``.sqlite`` for SQLite.
"""

from __future__ import annotations

import os
from typing import Any

from examples.usage import NoTotals, Store, Usage, open_store

ENV_DB = "STATS_USAGE_DB"
DEFAULT_DB = "stats-usage.chdb"
_INT64 = range(-(2**63), 2**63)
_LOW, _HIGH = _INT64[0], _INT64[-1]
_LAST_HOUR = 2**32 - 3600  # ClickHouse's DateTime ends in 2106

_store: Store | None = None
_buffer: list[Usage] = []


def target() -> str:
    """Where the totals are: ``$STATS_USAGE_DB``, else the default."""
    return os.environ.get(ENV_DB) or DEFAULT_DB


# --- the handler hooks -----------------------------------------------------------------------


def init(where: str | None = None) -> None:
    """Open the store of this handler process (once, after the fork)."""
    global _store
    if _store is not None:
        _store.close()
        _store = None
    _store = open_store(where or target())


def handle(message: Any) -> None:
    """Validate one message and buffer its metrics; raises ValueError on a bad payload."""
    project, metrics = parse(message.payload)
    _buffer.append(Usage(message.pid, project, period_of(message.timestamp), metrics))


def flush() -> None:
    """Count every buffered message not counted before, in one insert.

    The buffer is emptied whether or not this succeeds: on failure the worker fails the
    messages it covered, and they come back as redeliveries.
    """
    pending = _buffer.copy()
    _buffer.clear()
    if not pending:
        return
    if _store is None:
        raise RuntimeError("stats_usage.flush() before init(): no database is open")
    _store.add(pending)


# --- the payload -----------------------------------------------------------------------------


def parse(payload: Any) -> tuple[str, list[tuple[str, int]]]:
    """``(project id, [(metric, value), ...])`` of a payload; raises ValueError if malformed."""
    if not isinstance(payload, dict):
        raise ValueError(f"payload is a {type(payload).__name__}, not an object")
    project = _project_id(payload)
    metrics = payload.get("metrics")
    if not isinstance(metrics, list):
        raise ValueError('payload has no "metrics" list')
    parsed = []
    for index, metric in enumerate(metrics):
        # The common case in a few comparisons; anything else gets _metric()'s verdict.
        if type(metric) is dict:
            key, value = metric.get("key"), metric.get("value")
            if type(key) is str and key and type(value) is int and _LOW <= value <= _HIGH:
                parsed.append((key, value))
                continue
        parsed.append(_metric(index, metric))
    if len(parsed) > 1 and len({key for key, _ in parsed}) < len(parsed):
        sums: dict[str, int] = {}
        for key, value in parsed:  # a repeated metric is summed: the sum must fit too
            sums[key] = sums.get(key, 0) + value
            if sums[key] not in _INT64:
                raise ValueError(f'metrics of "{key}" add up beyond the signed 64-bit range')
    return project, parsed


def _project_id(payload: dict[str, Any]) -> str:
    project = payload.get("project")
    if isinstance(project, dict):
        project = project.get("$id")
    elif project is None:
        project = payload.get("projectId")
    if not isinstance(project, str) or not project:
        raise ValueError('payload names no project ("project": {"$id": ...} or "projectId")')
    return project


def _metric(index: int, metric: Any) -> tuple[str, int]:
    if not isinstance(metric, dict):
        raise ValueError(f"metrics[{index}] is a {type(metric).__name__}, not an object")
    key, value = metric.get("key"), metric.get("value")
    if not isinstance(key, str) or not key:
        raise ValueError(f'metrics[{index}] has no "key" string')
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'metrics[{index}] ("{key}") has a value that is not an integer')
    # Checked here, not at the insert, where it would fail every message of the batch.
    if value not in _INT64:
        raise ValueError(f'metrics[{index}] ("{key}") is beyond the signed 64-bit range')
    return key, value


def period_of(timestamp: int) -> int:
    """The start of the hour of ``timestamp`` (Unix seconds), within ClickHouse's range."""
    return min(max(timestamp, 0), _LAST_HOUR) // 3600 * 3600


def make_payload(project: str, metrics: dict[str, int]) -> dict[str, Any]:
    """A stats-usage payload for ``project``: what producers publish and tests send."""
    return {
        "project": {"$id": project},
        "metrics": [{"key": key, "value": value} for key, value in metrics.items()],
    }


# --- reading ---------------------------------------------------------------------------------


def totals(where: str | None = None) -> dict[tuple[str, str], int]:
    """Every total: ``{(project, metric): value}``; NoTotals if there is no database."""
    store = open_store(where or target(), create=False)
    try:
        return store.totals()
    finally:
        store.close()


def seen_pids(where: str | None = None) -> set[str]:
    """The pids counted so far; NoTotals if there is no database."""
    store = open_store(where or target(), create=False)
    try:
        return store.seen()
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.stats_usage [DB]``: print the usage totals a run produced."""
    import argparse
    import sys

    from broker.urls import redact

    parser = argparse.ArgumentParser(
        prog="python -m examples.stats_usage",
        description="Print the usage totals the stats-usage job stored, one line per project "
        "and metric (tab-separated: project, metric, total). Exit 1 when the store holds "
        "none yet; nothing is created by asking.",
    )
    parser.add_argument(
        "db", nargs="?", default=None,
        help=f"the store: a folder (embedded ClickHouse, chDB), a clickhouse:// or http(s):// "
        f"URL of a ClickHouse server, or a path ending in .sqlite (default: ${ENV_DB}, "
        f"else {DEFAULT_DB} in the working directory)",
    )
    where = parser.parse_args(argv).db or target()
    try:  # asking must not create an empty database
        found = totals(where)
    except NoTotals:
        print(f"error: {redact(where)} holds no usage totals yet (run the stats-usage job "
              f"first, e.g. python -m supervisor conf/stats-usage.toml)", file=sys.stderr)
        return 1
    for (project, metric), value in sorted(found.items()):
        print(f"{project}\t{metric}\t{value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
