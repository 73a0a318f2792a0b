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

# Re-exported for the handlers; the stores import them from .store, not from here (this
# module imports the stores: that would be a circle).
from examples.usage.store import NoTotals as NoTotals
from examples.usage.store import Store
from examples.usage.store import Usage as Usage

#: Schemes that name a ClickHouse server.
SERVER_SCHEMES = ("clickhouse://", "clickhouses://", "http://", "https://")


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
