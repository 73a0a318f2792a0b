"""The soak's view of the usage database the handlers write: seen pids, totals, sabotage.

One store is kept open for the whole check (on the embedded engine, opening one may start
a writer process, and closing it stops the writer this process started).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from examples.usage import NoTotals, Store, is_sqlite, open_store

#: File (or folder) name of the database in the soak's work folder, per ``--store``.
NAMES = {"clickhouse": "usage.chdb", "sqlite": "usage.sqlite"}


class UsageReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._store: Store | None = None

    def store(self) -> Store | None:
        """The open store, or None while the database does not exist yet."""
        if self._store is None:
            with contextlib.suppress(NoTotals):
                self._store = open_store(str(self.path), create=False)
        return self._store

    def seen(self) -> set[str]:
        store = self.store()
        return store.seen() if store is not None else set()

    def totals(self) -> dict[tuple[str, str], int]:
        store = self.store()
        return store.totals() if store is not None else {}

    def corrupt_one_total(self) -> None:
        """Self-test of the checks: add 1 to one stored value."""
        store = self.store()
        assert store is not None, "nothing to corrupt: no database"
        if is_sqlite(str(self.path)):
            store.db.execute(  # type: ignore[attr-defined]
                "UPDATE usage SET value = value + 1 WHERE (project, metric) = "
                "(SELECT project, metric FROM usage ORDER BY project, metric LIMIT 1)")
        else:
            store.database.execute(  # type: ignore[attr-defined]
                "ALTER TABLE usage UPDATE value = value + 1 WHERE pid IN "
                "(SELECT min(pid) FROM usage) SETTINGS mutations_sync = 1")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
