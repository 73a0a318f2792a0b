"""How handler processes talk to the embedded engine's writer: frames on a Unix socket.

A frame is one byte of kind, four of payload length (big-endian), then the payload.
Requests: INSERT (``table`` newline JSONCompactEachRow rows), SELECT and EXECUTE (SQL). Replies:
OK (for SELECT, the rows as a JSON array of arrays) or ERROR (the engine's message).

The socket lives in Linux's abstract namespace, named after the database's real path: no
file to go stale, and the name is free again the moment its writer dies, however it dies.
That namespace has no permissions: anyone may bind a name first, or connect. So each side
checks the other's credentials (``SO_PEERCRED``, set by the kernel): the writer answers
only its own user, and a client sends usage only to a writer of its own user.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from typing import NamedTuple

HEADER = struct.Struct(">cI")
#: Largest frame accepted (a batch of rows, or a SELECT's result).
MAX_FRAME = 1 << 30

INSERT, SELECT, EXECUTE = b"I", b"S", b"X"
OK, ERROR = b"K", b"E"


def address(path: str) -> str:
    """The writer's abstract socket name for the database folder ``path``."""
    digest = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
    return f"\0queue-supervisor-stats-usage-{digest}"


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Peer(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer(sock: socket.socket) -> Peer:
    """Who is at the other end of a connected Unix socket (as it was when it connected,
    or for a listener's side, when it called listen)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return Peer(*_CREDENTIALS.unpack(raw))


def frame(kind: bytes, payload: bytes) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    """One whole frame (blocking, under the socket's timeout); ConnectionError at EOF."""
    kind, length = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    if length > MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes is larger than {MAX_FRAME}")
    return kind, _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the writer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Whole frames out of the bytes of a non-blocking socket, as they arrive."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._data += data
        frames = []
        while len(self._data) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._data)
            if length > MAX_FRAME:
                raise ConnectionError(f"frame of {length} bytes is larger than {MAX_FRAME}")
            end = HEADER.size + length
            if len(self._data) < end:
                break
            frames.append((kind, bytes(self._data[HEADER.size:end])))
            del self._data[:end]
        return frames
