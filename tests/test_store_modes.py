"""The stats-usage stores a hand run creates are its user's alone (issue 28, L2): folders
0700, files 0600, whatever the umask (a shell's 022 made them world-readable)."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples import stats_usage_async
from examples.usage import Usage, open_store


@pytest.fixture(autouse=True)
def shell_umask() -> Iterator[None]:
    previous = os.umask(0o022)  # a login shell's
    yield
    os.umask(previous)


def others_may_access(path: Path) -> list[str]:
    """``path`` and everything below it that its group or other users may access."""
    found = []
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        mode = stat.S_IMODE(item.lstat().st_mode)
        if not item.is_symlink() and mode & 0o077:
            found.append(f"{item} {mode:o}")
    return found


def test_a_new_sqlite_store_and_its_wal_files_are_private(tmp_path):
    path = tmp_path / "usage.sqlite"
    store = open_store(str(path))
    try:
        store.add([Usage("a", "p1", 0, [("executions", 1)])])
        made = sorted(tmp_path.iterdir())
        assert [p.name for p in made] == ["usage.sqlite", "usage.sqlite-shm", "usage.sqlite-wal"]
        assert [bad for p in made for bad in others_may_access(p)] == []
    finally:
        store.close()


def test_the_async_handler_creates_a_private_database(tmp_path):
    path = tmp_path / "usage.sqlite"

    async def open_and_close() -> None:
        db = await stats_usage_async.connect(str(path))
        await db.close()

    asyncio.run(open_and_close())
    assert others_may_access(path) == []


def test_a_new_embedded_clickhouse_store_is_private(tmp_path):
    path = tmp_path / "usage.chdb"
    store = open_store(str(path))
    try:
        store.add([Usage("a", "p1", 0, [("executions", 1)])])
        assert store.totals() == {("p1", "executions"): 1}
    finally:
        store.close()
    assert any(path.rglob("*.bin")), "the engine wrote no part: nothing was checked"
    assert others_may_access(path) == []
