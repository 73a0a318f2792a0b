"""A small asyncio TCP proxy between a NATS client and its server, for fault tests.

It understands just enough of the NATS text protocol to cut the byte streams into
operations (PUB/HPUB from the client, MSG/HMSG from the server, everything else one line),
so a test can:

- ``drop_replies_to(subjects)``: forward the client's PUBs to these subjects, but drop
  the server's answer to them (the MSG on the PUB's reply subject);
- ``cut_after(pattern)``: once a client operation containing ``pattern`` was forwarded,
  close the connection before the server's next byte reaches the client;
- ``pause()`` / ``resume()``: hold all bytes in both directions;
- ``cut()``: close every proxied connection now.

New connections are always accepted, so a client can reconnect through the proxy.
``published`` counts client PUBs per subject (to check that nothing was replayed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterable

from support.servers import free_port

_PAYLOAD_OPS = {b"PUB", b"HPUB", b"MSG", b"HMSG"}


class FaultProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.port = free_port()
        self.published: Counter[str] = Counter()
        self.connections = 0  # accepted so far
        self._server: asyncio.Server | None = None
        self._pairs: set[_Pair] = set()
        self._victims: set[str] = set()
        self._victim_prefixes: set[str] = set()  # one request each
        self._doomed: set[str] = set()  # reply subjects whose answers are dropped
        self._cut_pattern: bytes | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.dropped = 0
        self.triggered = asyncio.Event()  # set when cut_after fired

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.cut()

    def drop_replies_to(self, subjects: Iterable[str]) -> None:
        self._victims |= set(subjects)

    def drop_replies_to_prefix(self, prefix: str) -> None:
        """Drop the reply to the next request whose subject starts with ``prefix``."""
        self._victim_prefixes.add(prefix)

    def _doomed_request(self, subject: str) -> bool:
        if subject in self._victims:
            return True
        for prefix in self._victim_prefixes:
            if subject.startswith(prefix):
                self._victim_prefixes.discard(prefix)
                return True
        return False

    def cut_after(self, pattern: bytes) -> None:
        self.triggered.clear()
        self._cut_pattern = pattern

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def cut(self) -> None:
        for pair in list(self._pairs):
            await pair.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        pair.tasks = [
            asyncio.create_task(self._client_to_server(reader, pair)),
            asyncio.create_task(self._server_to_client(up_reader, pair)),
        ]
        await asyncio.gather(*pair.tasks, return_exceptions=True)
        await pair.close()
        self._pairs.discard(pair)

    async def _client_to_server(self, reader: asyncio.StreamReader, pair: _Pair) -> None:
        async for op, args, frame in _frames(reader):
            await self._flowing.wait()
            if op in (b"PUB", b"HPUB"):
                subject = args[0].decode()
                self.published[subject] += 1
                if len(args) >= (4 if op == b"HPUB" else 3) and self._doomed_request(subject):
                    self._doomed.add(args[1].decode())
            pair.upstream.write(frame)
            await pair.upstream.drain()
            if self._cut_pattern is not None and self._cut_pattern in frame:
                self._cut_pattern = None
                self.triggered.set()
                await pair.close()  # the server got it; its answer never reaches the client
                return

    async def _server_to_client(self, reader: asyncio.StreamReader, pair: _Pair) -> None:
        async for op, args, frame in _frames(reader):
            await self._flowing.wait()
            if pair.closed:
                return
            if op in (b"MSG", b"HMSG") and args[0].decode() in self._doomed:
                self._doomed.discard(args[0].decode())
                self.dropped += 1
                continue
            pair.downstream.write(frame)
            await pair.downstream.drain()


class _Pair:
    """The two sockets of one proxied connection."""

    def __init__(self, downstream: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.downstream = downstream
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in (self.upstream, self.downstream):
            writer.close()
        for writer in (self.upstream, self.downstream):
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()


async def _frames(reader: asyncio.StreamReader) -> AsyncIterator[tuple[bytes, list[bytes], bytes]]:
    """(op, args, whole frame bytes) for each protocol operation until EOF."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            line = await reader.readuntil(b"\r\n")
            words = line.split()
            op = words[0].upper() if words else b""
            frame = line
            if op in _PAYLOAD_OPS:
                frame += await reader.readexactly(int(words[-1]) + 2)
            yield op, words[1:], frame
