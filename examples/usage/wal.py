"""The writer's log of acknowledged inserts that are not in the engine yet.

An INSERT into the embedded engine writes a part (several files, each fsynced): 12-20 ms on
a quiet disk, 50 ms and more on a busy one, whatever its size. Appending the same rows to a
file and fsyncing it takes well under a millisecond. So the writer makes a round of inserts
durable here, answers them, and moves what the log holds into the engine in one large
INSERT now and then (``examples.usage.writer``): group commit across every handler process.

The log is a folder of segments, ``<seq>.log``, appended to one at a time. A record is
a length and a CRC-32 (4 bytes each, big-endian), then ``table`` newline JSONCompactEachRow rows.
A record is answered only after its fsync, so a torn record at the end of a segment (the
writer died while writing it) was never acknowledged: reading stops there. A segment is
deleted only once its rows are in the engine (an INSERT that returned: fsynced parts).
Replaying a segment twice (the writer died between the INSERT and the delete) counts
nothing twice: rows are idempotent per pid (``examples.usage.clickhouse``).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import defaultdict

RECORD = struct.Struct(">II")
#: The folder inside the database folder (the engine's own files are beside it).
FOLDER = "supervisor-usage-log"


class Log:
    """The segments of one database folder; only its writer (the engine's holder) opens it."""

    def __init__(self, path: str) -> None:
        self.folder = os.path.join(path, FOLDER)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        _fsync_dir(path)
        self._fd: int | None = None
        self._seq = max(self.segments(), default=(0, ""))[0]

    def segments(self) -> list[tuple[int, str]]:
        """``(seq, path)`` of every segment, oldest first."""
        found = []
        for name in os.listdir(self.folder):
            stem, _, ext = name.partition(".")
            if ext == "log" and stem.isdigit():
                found.append((int(stem), os.path.join(self.folder, name)))
        return sorted(found)

    def append(self, records: list[tuple[str, bytes]]) -> None:
        """Write ``(table, rows)`` records and fsync: durable when this returns."""
        if self._fd is None:
            self._open_next()
        assert self._fd is not None
        data = b"".join(_record(table, rows) for table, rows in records)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)

    def rotate(self) -> str | None:
        """Close the segment being appended to (the next append starts another); its path,
        or None if there is none."""
        if self._fd is None:
            return None
        os.close(self._fd)
        self._fd = None
        return self._path(self._seq)

    def remove(self, segment: str) -> None:
        """Forget a segment whose rows are in the engine."""
        os.unlink(segment)
        _fsync_dir(self.folder)

    def close(self) -> None:
        self.rotate()

    def _open_next(self) -> None:
        self._seq += 1
        self._fd = os.open(self._path(self._seq), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        _fsync_dir(self.folder)  # the new name is durable before any record in it is answered

    def _path(self, seq: int) -> str:
        return os.path.join(self.folder, f"{seq:012d}.log")


def read(segment: str) -> dict[str, list[bytes]]:
    """The rows of a segment by table, up to its first torn or damaged record."""
    with open(segment, "rb") as file:
        data = file.read()
    rows: dict[str, list[bytes]] = defaultdict(list)
    at = 0
    while at + RECORD.size <= len(data):
        length, crc = RECORD.unpack_from(data, at)
        body = data[at + RECORD.size:at + RECORD.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break  # never acknowledged: the writer died while writing it
        table, _, lines = body.partition(b"\n")
        rows[table.decode()].append(lines)
        at += RECORD.size + length
    return rows


def _record(table: str, rows: bytes) -> bytes:
    body = table.encode() + b"\n" + rows
    return RECORD.pack(len(body), zlib.crc32(body)) + body


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
