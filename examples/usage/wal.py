"""The writer's log of acknowledged inserts that are not in the engine yet.

An INSERT into the embedded engine writes a part (several files, each fsynced): 12-20 ms on
a quiet disk, 50 ms and more on a busy one, whatever its size. Appending the same rows to a
file and syncing it takes well under a millisecond. So the writer makes a round of inserts
durable here, answers them, and moves what the log holds into the engine in one large
INSERT now and then (``examples.usage.writer``): group commit across every handler process.

The log is a folder of segments, ``<seq>.wal``, appended to one at a time. A record is
a length and a CRC-32 (4 bytes each, big-endian), then ``table`` newline JSONCompactEachRow
rows; the CRC is seeded with the segment's seq. A record is answered only after its sync, so
a torn record at the end of a segment (the writer died while writing it) was never
acknowledged: reading stops there. A segment's rows leave the log only once they are in the
engine (an INSERT that returned: fsynced parts). Replaying a segment twice (the writer died
between the INSERT and the recycling) counts nothing twice: rows are idempotent per pid
(``examples.usage.clickhouse``).

Why ``fdatasync`` of a file written over, not ``fsync`` of one that grows: a file that grows
changes its size with every record, so each sync commits the file system's journal, and on
ext4 that commit waits for whatever else is in it, the engine's new parts included. (On the
shared 2-core VM: 0.56 -> 0.20 ms a sync alone; in the writer under 4 clients, 1.50 -> 1.34
and 3.19 -> 2.22 ms a round, where the virtual disk's own flush is most of it.) So a new
segment is written full of zeros once, and a moved segment is kept (up to ``KEEP_FREE``) and
reused as the next one: its records overwrite blocks that exist, which ``fdatasync`` makes
durable without the journal (it still syncs the size when a record goes past the end). What
a reused file held before is never read as records: their CRCs were seeded with another seq,
and zeros are no record (length 0). ``<seq>.log`` segments, of writers before these, are read
with their own rule (CRC of the body alone) and never reused.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import defaultdict

RECORD = struct.Struct(">II")
#: The folder inside the database folder (the engine's own files are beside it).
FOLDER = "supervisor-usage-log"
#: Segments whose records' CRCs are seeded with the seq; ``LEGACY``: not seeded, not reused.
SUFFIX, LEGACY = ".wal", ".log"
#: Bytes of zeros a new segment file starts with (one that outgrows them just grows).
SEGMENT_BYTES = 4 << 20
#: Moved segments kept to be reused as the next ones (``free-<seq>.wal``).
KEEP_FREE = 2
FREE_PREFIX = "free-"


class Log:
    """The segments of one database folder; only its writer (the engine's holder) opens it."""

    def __init__(self, path: str) -> None:
        self.folder = os.path.join(path, FOLDER)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        _fsync_dir(path)
        self._fd: int | None = None
        # Past every seq a file here was written with, the kept ones too: a reused file
        # never holds records of the seq it is reused as.
        kept = [os.path.basename(free)[len(FREE_PREFIX):-len(SUFFIX)] for free in self.free()]
        self._seq = max([seq for seq, _ in self.segments()]
                        + [int(seq) for seq in kept if seq.isdigit()], default=0)

    def segments(self) -> list[tuple[int, str]]:
        """``(seq, path)`` of every segment, oldest first."""
        found = []
        for name in os.listdir(self.folder):
            stem, ext = os.path.splitext(name)
            if ext in (SUFFIX, LEGACY) and stem.isdigit():
                found.append((int(stem), os.path.join(self.folder, name)))
        return sorted(found)

    def free(self) -> list[str]:
        """Moved segments kept for reuse."""
        return sorted(os.path.join(self.folder, name) for name in os.listdir(self.folder)
                      if name.startswith(FREE_PREFIX) and name.endswith(SUFFIX))

    def append(self, records: list[tuple[str, bytes]]) -> None:
        """Write ``(table, rows)`` records and sync them: durable when this returns."""
        if self._fd is None:
            self._open_next()
        assert self._fd is not None
        data = b"".join(_record(table, rows, self._seq) for table, rows in records)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        # The data, and the size if it grew: all a read after a crash needs (see above).
        os.fdatasync(self._fd)

    def rotate(self) -> str | None:
        """Close the segment being appended to (the next append starts another); its path,
        or None if there is none."""
        if self._fd is None:
            return None
        os.close(self._fd)
        self._fd = None
        return self._path(self._seq)

    def remove(self, segment: str) -> None:
        """Forget a segment whose rows are in the engine: kept for reuse, or deleted. (Its
        rows come back if a crash undoes the rename: moved again, they count once.)"""
        stem, ext = os.path.splitext(os.path.basename(segment))
        if ext == SUFFIX and len(self.free()) < KEEP_FREE:
            os.rename(segment, os.path.join(self.folder, f"{FREE_PREFIX}{stem}{SUFFIX}"))
        else:
            os.unlink(segment)
        _fsync_dir(self.folder)

    def close(self) -> None:
        self.rotate()

    def _open_next(self) -> None:
        self._seq += 1
        path = self._path(self._seq)
        free = self.free()
        if free:  # written over from its start: what it held is no record of this seq
            os.rename(free[0], path)
            fd = os.open(path, os.O_WRONLY)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_zeros(fd, SEGMENT_BYTES)
                os.fsync(fd)
                os.lseek(fd, 0, os.SEEK_SET)
            except BaseException:
                os.close(fd)
                raise
        self._fd = fd
        _fsync_dir(self.folder)  # the name is durable before any record in it is answered

    def _path(self, seq: int) -> str:
        return os.path.join(self.folder, f"{seq:012d}{SUFFIX}")


def read(segment: str) -> dict[str, list[bytes]]:
    """The rows of a segment by table, up to its first torn or damaged record (or the
    zeros or older records after its last one)."""
    stem, ext = os.path.splitext(os.path.basename(segment))
    seed = int(stem) if ext == SUFFIX else 0
    with open(segment, "rb") as file:
        data = file.read()
    rows: dict[str, list[bytes]] = defaultdict(list)
    at = 0
    while at + RECORD.size <= len(data):
        length, crc = RECORD.unpack_from(data, at)
        body = data[at + RECORD.size:at + RECORD.size + length]
        if not length or len(body) < length or _crc(body, seed) != crc:
            break  # never acknowledged (the writer died while writing it), or no record
        table, _, lines = body.partition(b"\n")
        rows[table.decode()].append(lines)
        at += RECORD.size + length
    return rows


def _record(table: str, rows: bytes, seq: int) -> bytes:
    body = table.encode() + b"\n" + rows
    return RECORD.pack(len(body), _crc(body, seq)) + body


def _crc(body: bytes, seed: int) -> int:
    return zlib.crc32(body, seed & 0xFFFFFFFF)


def _write_zeros(fd: int, size: int) -> None:
    block = bytes(1 << 20)
    while size > 0:
        size -= os.write(fd, block[:size])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
