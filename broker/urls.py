"""Broker URLs as people may see them: ``redact`` hides every credential a URL can carry.

The one place that knows the credential forms; every log line, error message, ``status``
output and repr that shows a URL goes through ``redact``:

- userinfo ``user:password@`` and password-only ``:password@`` keep the user name only;
- a bare ``name@`` (a NATS token, or a Redis user name) is hidden whole;
- an unencoded ``@`` inside a password: the userinfo ends at the *last* ``@``, as Python's
  ``urlsplit`` (and so redis-py and nats-py) read it;
- query parameters that carry secrets (``?password=``, ``pass``, ``token``, ``auth`` ...).

When unsure where a credential ends it hides more rather than less: a ``/``, ``?`` or
``#`` inside a password (which no client reads back as written) still stays hidden.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

HIDDEN = "***"

#: The URL schemes of each broker (``rediss`` and ``tls`` are TLS).
REDIS_SCHEMES = ("redis", "rediss")
NATS_SCHEMES = ("nats", "tls")


def broker_kind(url: str) -> str:
    """``"redis"`` or ``"nats"`` by the URL's scheme; ValueError for any other scheme."""
    scheme = urlsplit(url).scheme
    if scheme in REDIS_SCHEMES:
        return "redis"
    if scheme in NATS_SCHEMES:
        return "nats"
    raise ValueError(f"no broker adapter for URL scheme {scheme!r}")


#: A query parameter whose name contains one of these (any case) carries a secret.
SECRET_QUERY_WORDS = ("pass", "pwd", "token", "secret", "auth", "key", "cred", "jwt", "seed")

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
_STARTS_WITH_URL = re.compile(_SCHEME)
#: A URL inside free text runs to the next whitespace.
_URL_IN_TEXT = re.compile(_SCHEME + r"\S*")
#: In a list of servers (``nats://a@h1,nats://b@h2``) each URL starts after a comma.
_NEXT_URL = re.compile(r",(?=" + _SCHEME + ")")
_QUERY_PARAMETER = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")
_ALREADY_HIDDEN = re.compile(re.escape(HIDDEN) + r"[:,.)'\"\]]*")


def split_servers(url: str) -> list[str]:
    """The URLs of a server list (``nats://h1:4222,nats://h2:4222``), as NATS clients take
    it: split at every comma, blanks around each trimmed. A comma inside a password must
    be written ``%2C``. A single URL is a list of one."""
    return [part.strip() for part in url.split(",")]


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``.

    A text that starts with a URL is taken as URLs to its end (so a password with a space
    stays hidden); in any other text, each URL runs to the next whitespace.
    """
    if _STARTS_WITH_URL.match(text):
        return ",".join(_redact_one(url) for url in _NEXT_URL.split(text))
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda match: _redact_one(match.group()), text)


def _redact_one(url: str) -> str:
    scheme_end = url.index("://") + 3
    scheme, rest = url[:scheme_end], url[scheme_end:]
    userinfo, at, location = rest.rpartition("@")
    if at:
        rest = f"{_hidden_userinfo(userinfo)}@{location}"
    return scheme + _QUERY_PARAMETER.sub(_hide_secret_parameter, rest)


def _hidden_userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    if not colon or re.search(r"[/?#]", user):
        return HIDDEN  # a token, or not a user name at all: show none of it
    return f"{user}:{HIDDEN}"


def _hide_secret_parameter(match: re.Match[str]) -> str:
    separator, name, value = match.groups()
    if not any(word in name.lower() for word in SECRET_QUERY_WORDS):
        return match.group()
    if _ALREADY_HIDDEN.fullmatch(value):  # redacted before, then followed by ": ..." in text
        return match.group()
    return f"{separator}{name}={HIDDEN}"
