"""The server's version, read once at connect: a server too old for what we use is refused.

We need Redis 6.2 or later: LMOVE and BLMOVE (6.2) move a job between lists in one command,
and the scripts use nothing newer. Valkey, a fork of Redis 7.2, serves every version of it.
The version comes from HELLO (Redis 6.0+), which every ACL user may send: a least-privilege
user is refused INFO. A server that does not know HELLO is older than 6.0.
"""

from __future__ import annotations

from typing import Any

import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from broker.base import BrokerRefused

MINIMUM = (6, 2)
WHY = "LMOVE and BLMOVE came in Redis 6.2"


def parse(reply: Any) -> tuple[str, tuple[int, ...]]:
    """(server name, version) from HELLO's reply: a flat list of pairs in RESP2 (what
    redis-py hands back), a map in RESP3."""
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2], strict=False))
    if not isinstance(reply, dict):
        raise ValueError(f"unexpected HELLO reply {reply!r:.80}")
    fields = {_text(key): _text(value) for key, value in reply.items()}
    version = tuple(int(part) for part in fields.get("version", "").split(".") if part.isdigit())
    if not version:
        raise ValueError(f"HELLO gave no version: {fields!r:.120}")
    return fields.get("server", "redis"), version


def refusal(where: str, server: str, version: tuple[int, ...]) -> str | None:
    """Why this server cannot serve us, or None when it can."""
    if server.lower() != "redis" or version >= MINIMUM:
        return None  # Valkey numbers its own releases, from 7.2 on
    shown = ".".join(map(str, version))
    return (f"{where} is Redis {shown}; this supervisor needs Redis "
            f"{'.'.join(map(str, MINIMUM))} or later ({WHY})")


async def check(client: Any, where: str) -> None:
    """Refuse (BrokerRefused: exit 5, no restart loop) a server too old for us."""
    cluster = isinstance(client, RedisCluster)
    try:
        if cluster:  # every master answers for its own version
            replies = await client.execute_command("HELLO", target_nodes=RedisCluster.PRIMARIES)
            if not isinstance(replies, dict) or {"version", b"version"} & replies.keys():
                replies = {"": replies}  # one master: redis-py hands back its reply alone
        else:
            replies = {"": await client.execute_command("HELLO")}
    except redis.exceptions.ResponseError as error:
        if "unknown command" not in str(error).lower():
            raise
        raise BrokerRefused(
            f"{where} does not know HELLO, so it is older than Redis 6.0 (or HELLO was "
            f"renamed away); this supervisor needs Redis {'.'.join(map(str, MINIMUM))} or "
            f"later ({WHY})") from error
    for node, reply in replies.items():
        server, version = parse(reply)
        reason = refusal(f"{where} (master {node})" if node else where, server, version)
        if reason:
            raise BrokerRefused(reason)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
