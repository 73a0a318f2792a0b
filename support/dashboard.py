"""A running ``python -m supervisor dashboard`` for tests, and an HTTP client for it."""

from __future__ import annotations

import contextlib
import html
import http.cookiejar
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from support.servers import free_port
from support.supervision import ROOT

#: The CSRF token of a page's action forms.
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
#: The one-time action token of a page's action forms.
ONCE = re.compile(r'name="once" value="([^"]+)"')


class Dashboard:
    """The dashboard process (sampling every second, pages refreshing every second)."""

    def __init__(self, configs: list[Path], workdir: Path, token: str | None = None,
                 interval: float = 1.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"dashboard-{self.port}.log"
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("QUEUE_BROKER_URL", "QUEUE_DASHBOARD_TOKEN")}
        environ["PYTHONPATH"] = str(ROOT)
        if token is not None:
            environ["QUEUE_DASHBOARD_TOKEN"] = token  # as docs/dashboard.md advises: not in argv
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "dashboard", *map(str, configs),
             "--listen", f"127.0.0.1:{self.port}", "--interval", str(interval),
             "--refresh", "1"],
            cwd=ROOT, env=environ, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.client = Client(self.url)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                if self.client.get("/healthz")[0] == 200:
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the dashboard did not start:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


class Client:
    """GET and POST with cookies kept (a session after ``login``)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.cookies = http.cookiejar.CookieJar()
        self.headers: dict[str, str] = {}  # of the last answer
        self._opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.cookies), _NoRedirect())

    def request(self, path: str, fields: dict[str, str] | None = None) -> tuple[int, str]:
        data = urllib.parse.urlencode(fields).encode() if fields is not None else None
        try:
            with self._opener.open(self.base + path, data=data, timeout=30) as answer:
                self.headers = dict(answer.headers)
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as error:
            self.headers = dict(error.headers)
            return error.code, error.read().decode()

    def get(self, path: str) -> tuple[int, str]:
        return self.request(path)

    def post(self, path: str, fields: dict[str, str]) -> tuple[int, str]:
        return self.request(path, fields)

    def login(self, token: str, who: str = "tester", target: str | None = None) -> int:
        fields = {"token": token, "who": who} | ({"next": target} if target else {})
        status, _ = self.post("/login", fields)
        return status

    def csrf(self, path: str) -> str:
        """The CSRF token of the action forms on ``path`` (the session's own)."""
        return self.form(path)["csrf"]

    def form(self, path: str) -> dict[str, str]:
        """The CSRF token and the one-time action token of the action forms of a fresh
        rendering of ``path``: what a person's click on one of them sends besides the
        action's own fields."""
        status, body = self.get(path)
        found, once = CSRF.search(body), ONCE.search(body)
        assert found and once, f"no action form on {path} ({status}): {body[-1500:]}"
        return {"csrf": html.unescape(found.group(1)), "once": html.unescape(once.group(1))}

    def act(self, path: str, fields: dict[str, str], index: int = 0) -> tuple[int, str]:
        """POST the action ``fields`` of queue ``index`` as a form of ``path`` would."""
        return self.post(f"/q/{index}/action", fields | self.form(path))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A login's 303 is returned as it is (its cookie is kept by the cookie processor)."""

    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


class FailingRedis:
    """A TCP server that answers every Redis command with the same error (``-ERR ...``): a
    broker whose error is as long as a test wants."""

    def __init__(self, message: str) -> None:
        self.reply = f"-ERR {message}\r\n".encode()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._server.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        pending = b""
        with connection, contextlib.suppress(OSError):
            while chunk := connection.recv(65536):
                pending += chunk
                count, pending = _commands(pending)
                connection.sendall(self.reply * count)

    def close(self) -> None:
        self._server.close()


def _commands(data: bytes) -> tuple[int, bytes]:
    """The whole RESP commands at the start of ``data`` (arrays of bulk strings), and the
    rest: each gets its own reply, so a pipeline is answered in full."""
    count = 0
    while data.startswith(b"*") and b"\r\n" in data:
        header, rest = data[1:].split(b"\r\n", 1)
        for _ in range(int(header)):
            if not rest.startswith(b"$") or b"\r\n" not in rest:
                return count, data
            size, body = rest[1:].split(b"\r\n", 1)
            if len(body) < int(size) + 2:
                return count, data
            rest = body[int(size) + 2:]
        count, data = count + 1, rest
    return count, data


def poll(condition, what: str, timeout: float = 60) -> Any:
    """``condition()`` until true, twice a second (each try is a page the dashboard renders:
    no need to ask more often than it samples)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)
    return value


def table_rows(body: str, css_class: str, columns: tuple[str, ...]) -> list[dict[str, str]] | None:
    """The rows of a page's ``<table class="css_class">``, each row's cells (text) by
    ``columns`` (rows of another width, such as a "nothing runs" row, are left out); None
    when the page has no such table."""
    table = re.search(rf'<table class="{css_class}">.*?</table>', body, re.S)
    if not table:
        return None
    rows = []
    for found in re.finditer(r"<tr>(.*?)</tr>", table.group(), re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
                 for cell in re.findall(r"<td[^>]*>(.*?)</td>", found.group(1), re.S)]
        if len(cells) == len(columns):
            rows.append(dict(zip(columns, cells, strict=True)))
    return rows
