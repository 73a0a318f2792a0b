"""TLS settings shared by both brokers: which CAs to trust, the client certificate for
mutual TLS, and whether the server's certificate must name the host we connect to.

Certificate verification itself is never optional: only the hostname check can be turned
off (unsafe, documented as such). Files are checked up front (``check_files``) so that a
bad path or PEM file stops the start with one line instead of failing every connection.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

#: Words of connection errors that, on a TLS connection without a client certificate,
#: usually mean the server wanted one (TLS 1.3 reports that only after the handshake).
_CLOSED_BY_SERVER = ("reset", "connection lost", "eof", "certificate required",
                     "certificate_required", "closed", "broken pipe")


class TlsFileError(ValueError):
    """A TLS file cannot be used; ``field`` is "ca", "cert" or "key"."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field = field
        self.problem = problem


class _Encrypted(Exception):
    """Raised by the password callback: the key asks for a passphrase."""


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """Paths of PEM files ("" = not set) and the hostname check.

    ``ca``: CA certificates that sign the server's certificate ("" = the system's).
    ``cert``/``key``: this client's certificate and its (unencrypted) key, for mutual TLS.
    """

    ca: str = ""
    cert: str = ""
    key: str = ""
    verify_hostname: bool = True

    @property
    def configured(self) -> bool:
        """True when anything differs from the defaults (plain system-trust TLS)."""
        return bool(self.ca or self.cert or self.key) or not self.verify_hostname

    def context(self) -> ssl.SSLContext:
        """A client context: the server's certificate verified, its name checked unless
        ``verify_hostname`` is false; raises TlsFileError for a file it cannot use."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.check_hostname = self.verify_hostname
        context.verify_mode = ssl.CERT_REQUIRED  # even without the hostname check
        if self.ca:
            _load_certificates(context, self.ca, "ca")
        if self.cert or self.key:
            _load_client_pair(context, self.cert, self.key)
        return context

    def redis_options(self) -> dict[str, Any]:
        """Keyword arguments of redis-py's clients for a rediss:// URL (it builds its own
        context per connection from the file names)."""
        return {
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": self.verify_hostname,
            "ssl_ca_certs": self.ca or None,  # None: the system's CAs
            "ssl_certfile": self.cert or None,
            "ssl_keyfile": self.key or None,
        }

    def hint(self, error: BaseException) -> str:
        """A hint to append to a connection error, or "": a TLS connection the server
        closed at once, without a client certificate, most likely needed one."""
        if self.cert:
            return ""
        text = " ".join(str(e) for e in _chain(error)).lower()
        if isinstance(error, ssl.SSLCertVerificationError) or "verify failed" in text:
            return ""
        if any(word in text for word in _CLOSED_BY_SERVER):
            return ("; the server closed the TLS connection: if it requires client "
                    "certificates (mutual TLS), set [broker] tls_cert and tls_key")
        return ""


def check_files(settings: TlsSettings) -> None:
    """Raise TlsFileError unless every file set can be read and used as intended."""
    settings.context()


def _load_certificates(context: ssl.SSLContext, path: str, field: str) -> None:
    _readable(path, field)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as error:
        raise TlsFileError(field, f"holds no PEM certificate ({error.reason or error})") from None


def _load_client_pair(context: ssl.SSLContext, cert: str, key: str) -> None:
    if not (cert and key):
        missing, given = ("key", "cert") if cert else ("cert", "key")
        raise TlsFileError(missing, f"is needed with the client {given}: set both or neither")
    # A certificate loads as a CA too: that tells a bad certificate from a bad key below.
    _load_certificates(ssl.create_default_context(), cert, "cert")
    _readable(key, "key")

    def no_passphrase() -> str:
        raise _Encrypted

    try:
        context.load_cert_chain(cert, key, password=no_passphrase)
    except _Encrypted:
        raise TlsFileError("key", "is encrypted: a supervisor cannot type its passphrase; "
                           "store it decrypted (openssl pkey -in KEY -out PLAIN) with mode "
                           "0600") from None
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error):
            raise TlsFileError("key", "is not the key of the client certificate") from None
        raise TlsFileError("key", f"is not a PEM private key ({error.reason or error})") from None


def _readable(path: str, field: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as error:
        raise TlsFileError(field, f"cannot be read: {error.strerror or error}") from None


def _chain(error: BaseException) -> list[BaseException]:
    """The error and its causes (redis-py and nats-py wrap the socket's error)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen
