"""The metrics endpoint: /metrics, /healthz and /readyz over HTTP, from a thread of its own.

The endpoint is anyone's who can reach the port, so it must never cost the supervisor
what its work needs: one thread runs an event loop of its own for every connection (no
thread per connection), holds at most ``MAX_CONNECTIONS`` (a new one beyond them closes
the oldest, which a scraper that sends its request at once never is), and closes any
connection not done within ``REQUEST_TIMEOUT``. A thread per connection without a timeout
let 1,004 half-sent requests take every descriptor, and the broker's reconnects with them.
The answer itself is prometheus-client's own WSGI app: formats (text, OpenMetrics), gzip
and ``name[]`` filters are exactly what ``start_http_server`` served. What it answers with
(the registry, the health checks) is ``supervisor.metrics``'s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import unquote

#: Seconds a connection may take from its accept to the end of the answer.
REQUEST_TIMEOUT = 5
#: Connections held at once (a scrape takes milliseconds; a few Prometheus servers scrape).
MAX_CONNECTIONS = 32
#: Bytes of request line and headers read at most (a scrape sends a few hundred).
MAX_REQUEST = 8192
#: Connections the kernel queues until accepted: they hold no descriptor of ours, and a
#: scraper that arrives during a flood gets in without waiting for a SYN retransmit.
BACKLOG = 512
#: Seconds between two answers at least (the endpoint's thread shares the supervisor's
#: GIL: six clients scraping as fast as they could made it settle 5,000 jobs in 9.5 s
#: instead of 1.5 s; paced and cached, in 2.3 s instead of 2.2). Fifty answers a second
#: is far beyond what scrapers and health checks ask; a flood waits in its connections
#: (at most MAX_CONNECTIONS, each closed after REQUEST_TIMEOUT) instead.
ANSWER_GAP = 0.02
#: Seconds a rendered /metrics answer is served again to the same kind of request (format,
#: compression, filter): a render costs milliseconds of the supervisor's CPU.
METRICS_CACHE = 1.0


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class HealthChecks(Protocol):
    """What /healthz and /readyz answer (``supervisor.metrics.Health``): good, and why."""

    def alive(self) -> tuple[bool, str]: ...

    def ready(self) -> tuple[bool, str]: ...


def routes(metrics_app: WsgiApp, health: HealthChecks) -> WsgiApp:
    """/metrics, /healthz and /readyz; 404 for any other path."""
    metrics_app = cached(metrics_app)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            return _plain(start_response, *health.alive())
        if path == "/readyz":
            return _plain(start_response, *health.ready())
        return _plain(start_response, False, f"not found: {path[:100]!r}; try /metrics, "
                      "/healthz or /readyz", status="404 Not Found")

    return app


def cached(app: WsgiApp, clock: Callable[[], float] = time.monotonic,
           seconds: float | None = None) -> WsgiApp:
    """``app`` whose answer to one kind of request (query, Accept, Accept-Encoding) is
    rendered at most once per ``seconds``. Called from the endpoint's one thread only."""
    kept: dict[tuple[str, str, str], tuple[float, str, list[tuple[str, str]], bytes]] = {}
    fresh_for = METRICS_CACHE if seconds is None else seconds

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        kind = (environ.get("QUERY_STRING", ""), environ.get("HTTP_ACCEPT", ""),
                environ.get("HTTP_ACCEPT_ENCODING", ""))
        now = clock()
        hit = kept.get(kind)
        if hit is None or now - hit[0] >= fresh_for:
            started: list[Any] = []

            def keep(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
                started[:] = [status, headers]

            body = b"".join(app(environ, keep))
            if len(kept) >= 16:  # kinds are the client's to choose: never many kept
                kept.clear()
            hit = kept[kind] = (now, started[0], started[1], body)
        start_response(hit[1], hit[2])
        return [hit[3]]

    return serve


def _plain(start_response: Callable[..., Any], good: bool, text: str,
           status: str | None = None) -> list[bytes]:
    """A one-line text answer: 200 when ``good``, else 503 (or ``status``)."""
    body = (text + "\n").encode()
    start_response(status or ("200 OK" if good else "503 Service Unavailable"),
                   [("Content-Type", "text/plain; charset=utf-8")])
    return [body]



class Endpoint:
    """HTTP/1.x, one request per connection, for a WSGI app, from one thread's event loop."""

    def __init__(self, app: WsgiApp, host: str, port: int) -> None:
        self._app = app
        # Bound here, in the caller: a port in use fails the start (exit 2), not the thread.
        self._listener = socket.create_server((host, port), family=_family(host),
                                              backlog=BACKLOG)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.port = self.address[1]
        self._open: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}  # oldest first
        self._next_answer = 0.0  # the loop's time of the next answer (see ANSWER_GAP)
        self._loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve_forever(),), name="metrics",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _serve_forever(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self._listener,
                                            limit=MAX_REQUEST)
        async with server:
            await self._stopping.wait()
        tasks = list(self._open.values())
        for writer in list(self._open):
            writer.transport.abort()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_CONNECTIONS:
            # Out of the count at once: the connections of one burst start together, and
            # each must close another one before the first closed one's task has run.
            oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.transport.abort()  # its read fails, its task ends
        task = asyncio.current_task()
        assert task is not None
        self._open[writer] = task
        try:
            await asyncio.wait_for(self._answer(reader, writer), REQUEST_TIMEOUT)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError, ValueError):
            pass  # slow, cut, oversized or not HTTP: closed without an answer
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()  # no lingering close: the descriptor goes now

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        environ = _environ(head, self.address)
        now = asyncio.get_running_loop().time()
        turn, self._next_answer = self._next_answer, max(now, self._next_answer) + ANSWER_GAP
        if turn > now:
            await asyncio.sleep(turn - now)
        status, headers, body = self._call_app(environ)
        lines = [f"HTTP/1.1 {status}", *(f"{name}: {value}" for name, value in headers),
                 f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer.write("\r\n".join(lines).encode("latin-1") + body)
        writer.close()  # after what is still buffered is sent, within the timeout
        await writer.wait_closed()

    def _call_app(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
            started[:] = [status, headers]

        body = b"".join(self._app(environ, start_response))
        return started[0], started[1], body


def _environ(head: bytes, address: tuple[str, int]) -> dict[str, Any]:
    """The WSGI environ of a request head (ValueError if it is not one)."""
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, target, version = request_line.split(" ")
    if not version.startswith("HTTP/"):
        raise ValueError("not an HTTP request")
    path, _, query = target.partition("?")
    environ = {
        "REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query,
        "SERVER_NAME": address[0], "SERVER_PORT": str(address[1]),
        "SERVER_PROTOCOL": version, "wsgi.url_scheme": "http",
    }
    for line in header_lines:
        name, colon, value = line.partition(":")
        if colon:
            environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
    return environ


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def exposure_warning(host: str) -> str | None:
    """Why serving on ``host`` lets others read the figures, or None for loopback."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"[supervisor] metrics_host = {host} is not a loopback address: anyone who can "
            "reach this host on the metrics port reads the queue's figures, and the endpoint "
            "has no authentication. Bind 127.0.0.1 and scrape through a tunnel or a proxy "
            "with authentication, or firewall the port to the Prometheus servers")
