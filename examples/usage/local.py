"""The embedded engine as the handler processes see it: requests to its writer process
(``examples.usage.writer``), which this side starts when none serves the database.

Every request may be repeated safely (inserts are idempotent per pid, reads and
``CREATE ... IF NOT EXISTS`` change nothing twice), so a writer that dies mid-request is
replaced and asked again until ``CALL_TIMEOUT``; only then does the call fail (and with it
the flush, whose messages are redelivered). The engine's own errors fail at once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

import examples
from examples.usage import wire
from examples.usage.store import NoTotals

#: Seconds one request may take, starting a writer included (importing the engine alone
#: takes ~1.5 s, more on a busy host).
CALL_TIMEOUT = 60.0
#: Seconds a writer this process started gets to stop when the store is closed.
STOP_TIMEOUT = 10.0


class WriterError(RuntimeError):
    """The engine refused a request (the message is its own)."""


class WriterUnavailable(RuntimeError):
    """No writer could be reached or started in time."""


class ForeignWriter(WriterUnavailable):
    """The writer's socket name is held by a process of another user: nothing is sent to
    it, at once and on every try (it could read the rows and forge every answer)."""


class WriterClient:
    """A ``Database`` (see ``examples.usage.clickhouse``) served by the folder's writer."""

    def __init__(self, path: str, *, create: bool = True) -> None:
        if not create and not os.path.isdir(path):
            raise NoTotals(f"{path} does not exist")
        self.path = path
        self._address = wire.address(path)
        self._sock: socket.socket | None = None
        self._child: subprocess.Popen[bytes] | None = None

    def execute(self, sql: str) -> None:
        self._call(wire.EXECUTE, sql.encode())

    def insert(self, table: str, rows: bytes) -> None:
        self._call(wire.INSERT, table.encode() + b"\n" + rows)

    def select(self, sql: str) -> list[Any]:
        return orjson.loads(self._call(wire.SELECT, sql.encode()))

    def close(self) -> None:
        """Disconnect, and stop the writer this process started (others start their own)."""
        self._disconnect()
        child, self._child = self._child, None
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def _call(self, kind: bytes, payload: bytes) -> bytes:
        deadline = time.monotonic() + CALL_TIMEOUT
        request = wire.frame(kind, payload)
        delay = 0.02
        while True:
            try:
                sock = self._connect(max(0.1, deadline - time.monotonic()))
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.sendall(request)
                reply, body = wire.recv_frame(sock)
            except OSError as error:  # refused, reset, closed mid-reply, timed out
                self._disconnect()
                self._check_child()
                if time.monotonic() > deadline:
                    raise WriterUnavailable(
                        f"no stats-usage writer for {self.path} answered within "
                        f"{CALL_TIMEOUT:.0f}s ({error})") from error
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            if reply == wire.ERROR:
                raise WriterError(body.decode(errors="replace"))
            return body

    def _connect(self, timeout: float) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)  # a listener that never accepts fills its backlog: no hang
        try:
            sock.connect(self._address)
        except OSError:
            sock.close()
            self._start_writer()
            raise
        writer = wire.peer(sock)
        if writer.uid != os.geteuid():
            sock.close()
            raise ForeignWriter(
                f"the stats-usage writer socket for {self.path} is held by pid {writer.pid} "
                f"of uid {writer.uid}, not by this user (uid {os.geteuid()}): no usage is "
                "sent to it and the flush fails, so its messages are not acknowledged. Stop "
                "that process, or set STATS_USAGE_DB to another path")
        self._sock = sock
        return sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _start_writer(self) -> None:
        self._check_child()
        if self._child is not None:
            return  # ours is still starting
        root = str(Path(examples.__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._child = subprocess.Popen(
            [sys.executable, "-m", "examples.usage.writer", self.path, str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
        )

    def _check_child(self) -> None:
        """A writer of ours that exited with an error of its own (not a signal, not a lost
        race) will not do better on a retry: say so at once."""
        if self._child is None or self._child.poll() is None:
            return
        code, self._child = self._child.returncode, None
        if code > 0:
            raise WriterUnavailable(
                f"the stats-usage writer for {self.path} exited with code {code} "
                f"(its error is in the log above)")

