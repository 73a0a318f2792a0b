"""Broker URLs: whether one is usable (``url_problem``), and as people may see them
(``redact`` hides every credential a URL can carry).

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
from urllib.parse import parse_qsl, urlsplit

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


# --- is a URL usable: the check behind ``[broker] url`` and QUEUE_BROKER_URL ----------------


def url_problem(url: str) -> str | None:
    """Why ``url`` is not usable, or None: one URL, or a comma-separated list (the servers
    of a NATS cluster, or the seed nodes of a Redis Cluster), each checked as a URL of its
    own, all with one scheme (TLS for all, or for none)."""
    servers = split_servers(url)
    if len(servers) == 1:
        return _one_url_problem(url)
    for number, server in enumerate(servers, 1):
        where = f"server {number} of {len(servers)}"
        if not server:
            return f"has an empty {where} (a stray comma?)"
        problem = _one_url_problem(server)
        if problem:
            return f"{where} ({redact(server)}) {problem}"
    schemes = sorted({urlsplit(server).scheme for server in servers})
    if len(schemes) > 1:
        shown = ", ".join(f"{scheme}://" for scheme in schemes)
        return f"mixes schemes {shown}; every server of a list uses the same one"
    return _seed_list_problem(servers) if schemes[0] in REDIS_SCHEMES else None


def _one_url_problem(url: str) -> str | None:
    if "://" not in url:
        return "is not a URL (expected e.g. redis://127.0.0.1:6379/0)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- parsing the port is what raises on a bad one
    except ValueError as error:
        # Never urllib's message: it quotes the "port", often a piece of the password.
        return f"is not a valid URL ({_parse_failure(error)}; {_ENCODE_SECRETS})"
    if _userinfo_cut_short(url, parts.netloc):
        return ("has an @ after its host: the password or token before it holds an unencoded "
                f"/ ? or #, which ends it early ({_ENCODE_SECRETS})")
    if parts.scheme not in REDIS_SCHEMES + NATS_SCHEMES:
        return f'has scheme "{parts.scheme}"; expected one of redis, rediss, nats, tls'
    if not parts.hostname:
        return "names no host"
    database = parts.path.strip("/")
    if parts.scheme in REDIS_SCHEMES and database and not database.isdecimal():
        return f'names database "{database}"; a Redis database is a number'
    if parts.scheme in REDIS_SCHEMES:
        # redis-py lets URL parameters override its arguments: an ssl_cert_reqs=none there
        # would silently turn off what the tls_* keys (and their defaults) ask for.
        query = parse_qsl(parts.query, keep_blank_values=True)
        tls_params = [name for name, _ in query if name.startswith("ssl")]
        if tls_params:
            return (f"sets {tls_params[0]} in its query; TLS is set with the [broker] "
                    "tls_* keys (a URL parameter would override them)")
    return None


#: A password or token with one of these unencoded ends the userinfo early (the parser
#: reads the rest as port, path, query or fragment): the one fix, said in every such error.
_ENCODE_SECRETS = ("a password or token containing / ? # or @ must be percent-encoded: "
                   "%2F %3F %23 %40")


def _parse_failure(error: ValueError) -> str:
    """What urllib found wrong, in words that quote no part of the URL."""
    message = str(error)
    if message.startswith("Port could not be cast"):
        return "the port after the host is not a number"
    if message.startswith("Port out of range"):
        return "the port is not in 0-65535"
    if "IPv6" in message:
        return "unbalanced [ ] around the host (an IPv6 address is written [::1])"
    return "it cannot be parsed"


def _userinfo_cut_short(url: str, netloc: str) -> bool:
    """An ``@`` after the host the parser found: the userinfo was cut at an unencoded
    ``/``, ``?`` or ``#`` (``redis://u:12#secret@h``, ``nats://tok/en@h``), so the host
    is a piece of it. An ``@`` inside a query value (``?password=p@ss``) is no sign."""
    after_host = url[url.index("://") + 3 + len(netloc):]
    at = after_host.find("@")
    return "@" not in netloc and at >= 0 and "=" not in after_host[:at]


def _seed_list_problem(seeds: list[str]) -> str | None:
    """Why the seed nodes of a Redis Cluster cannot be used together, or None: the client
    connects to every node with the first seed's credentials (broker.redis.seeds)."""
    users = {(urlsplit(seed).username, urlsplit(seed).password) for seed in seeds}
    if len(users) > 1:
        return "gives different credentials per seed; a cluster has one user for all nodes"
    return None
