"""NATS connections that are TLS whenever TLS was asked for.

nats-py starts TLS only when the server's INFO says ``tls_required``, even for a tls://
URL: a server without TLS (or anyone in between who rewrites INFO) would get the CONNECT,
credentials included, in plaintext. When TLS is asked for (a tls:// URL, or a ``tls``
context in the options), the client here checks that the socket is TLS before it sends
CONNECT and refuses otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

import nats.errors
from nats.aio.client import Client

from broker.tls import TlsSettings
from broker.urls import split_servers

#: asyncio logs this whenever a connection nats-py upgraded to TLS reaches its end: its
#: stream protocol was made for the plain socket and asks to stay half-open, which TLS
#: cannot. Harmless (the connection closes all the same), and noise in every log.
_HALF_CLOSE_NOTICE = "returning true from eof_received() has no effect when using ssl"


def _not_half_close_notice(record: logging.LogRecord) -> bool:
    return record.msg != _HALF_CLOSE_NOTICE


logging.getLogger("asyncio").addFilter(_not_half_close_notice)


class TlsNotStarted(nats.errors.Error):
    """TLS was asked for but the server did not start it; nothing was sent."""


class _TlsOnlyClient(Client):
    def _connect_command(self) -> bytes:
        # Called after nats-py's TLS upgrade (if any), before CONNECT is written.
        if not _is_tls(self):
            server = self._current_server.uri.netloc if self._current_server else "?"
            raise TlsNotStarted(
                f"the NATS server at {server.rpartition('@')[2]} did not start TLS (it does "
                "not require it): refusing to connect in plaintext, since TLS is configured "
                "(tls:// URL or [broker] tls_* keys); give the server a tls {} block"
            )
        return super()._connect_command()


def tls_options(url: str, tls: TlsSettings | None) -> dict[str, Any]:
    """``nats.connect`` options: none unless TLS is asked for (a tls:// URL or any TLS
    setting), then the context every connection must use."""
    tls = tls or TlsSettings()
    if not _tls_url(url) and not tls.configured:
        return {}  # nats:// without settings: nats-py's own upgrade if the server asks
    return {"tls": tls.context()}


def wants_tls(url: str, options: dict[str, Any]) -> bool:
    return _tls_url(url) or options.get("tls") is not None


def _tls_url(url: str) -> bool:
    """Any tls:// server in the (comma-separated) list asks for TLS on every connection."""
    return any(urlsplit(server).scheme == "tls" for server in split_servers(url))


async def connect(url: str, **options: Any) -> Client:
    """``nats.connect``, refusing a plaintext connection when TLS is asked for. ``url``
    may list several servers of one cluster, comma-separated: nats-py tries them in a
    random order (its default) until one answers."""
    client = _TlsOnlyClient() if wants_tls(url, options) else Client()
    servers = split_servers(url)
    try:
        await client.connect(servers if len(servers) > 1 else url, **options)
    except BaseException:
        _drop_socket(client)
        raise
    return client


def _drop_socket(client: Client) -> None:
    """Close the socket of a client whose connect failed (e.g. the plaintext one refused).

    Not ``client.close()``: after a failed TLS handshake it waits forever. Nothing else
    runs yet: nats-py starts its tasks only once a connect succeeded.
    """
    transport = getattr(client, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def _is_tls(client: Client) -> bool:
    writer = getattr(client._transport, "_io_writer", None)
    return writer is not None and writer.get_extra_info("ssl_object") is not None
