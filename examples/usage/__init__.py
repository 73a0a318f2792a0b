"""Where the stats-usage handler keeps its totals, chosen by the form of ``$STATS_USAGE_DB``:

- a path (default ``stats-usage.chdb``, a folder): the embedded ClickHouse engine (chDB),
  served to every process of the host by one writer process (``examples.usage.writer``);
- ``clickhouse://``, ``clickhouses://``, ``http://`` or ``https://``: a ClickHouse server,
  through ``clickhouse-connect`` (``examples.usage.clickhouse``);
- a path ending in ``.sqlite`` (or ``sqlite:PATH``): SQLite (``examples.usage.sqlite``).

Every store has the same two promises: ``add()`` returns only once the batch is durable,
and a message (pid) counts once however often it is added.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

#: Schemes that name a ClickHouse server.
SERVER_SCHEMES = ("clickhouse://", "clickhouses://", "http://", "https://")


class Usage(NamedTuple):
    """One validated message: what it adds to which project, and in which hour."""

    pid: str
    project: str
    period: int  # Unix seconds of the start of the hour the message was published in
    metrics: list[tuple[str, int]]


class NoTotals(Exception):
    """The target holds no usage totals (it does not exist, or no job has written it)."""


class Store(Protocol):
    def add(self, batch: list[Usage]) -> None:
        """Count every message of ``batch`` not counted before; durable when it returns."""

    def totals(self) -> dict[tuple[str, str], int]:
        """Every total: ``{(project, metric): value}``."""

    def seen(self) -> set[str]:
        """The pids counted (messages with at least one metric, for ClickHouse)."""

    def close(self) -> None: ...


def is_sqlite(target: str) -> bool:
    return target.startswith("sqlite:") or target.endswith((".sqlite", ".sqlite3"))


def open_store(target: str, *, create: bool = True) -> Store:
    """The store ``target`` names. ``create=False``: only one that exists (else NoTotals),
    and nothing is created by asking."""
    if target.startswith(SERVER_SCHEMES):
        from examples.usage.clickhouse import ClickHouseStore, ServerDatabase

        return ClickHouseStore(ServerDatabase(target), create=create)
    if is_sqlite(target):
        from examples.usage.sqlite import SqliteStore

        return SqliteStore(target.removeprefix("sqlite:"), create=create)
    from examples.usage.clickhouse import ClickHouseStore
    from examples.usage.local import WriterClient

    path = target.removeprefix("chdb:")
    return ClickHouseStore(WriterClient(path, create=create), create=create)
