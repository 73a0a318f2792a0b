"""The Lua scripts of ``lua/``, loaded once and called by name.

Scripts run with EVALSHA; when the server answers NOSCRIPT (its script cache was lost to a
restart or SCRIPT FLUSH) the script is loaded again and the call repeated. NOSCRIPT is
returned before a script runs, so the retry can neither lose nor double-apply anything.

Scripts report a bad key type or counter with an error reply that starts with ``QSTYPE``
(before their first write); it surfaces here as ``WrongTypeError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from broker.base import BrokerError, WrongTypeError

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"


def lua_source(name: str) -> str:
    """The text of ``lua/<name>.lua``."""
    return (LUA_DIR / f"{name}.lua").read_text()


class Scripts:
    """Named scripts bound to one redis-py asyncio client (plain or cluster)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._scripts: dict[str, Any] = {}

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self._client.register_script(lua_source(name))
        try:
            return await script(keys=keys, args=args)
        except ResponseError as error:
            raise translate(name, error) from error


def translate(name: str, error: ResponseError) -> BrokerError:
    """Our scripts' validation errors become WrongTypeError; anything else a BrokerError."""
    message = str(error)
    if "QSTYPE" in message or message.startswith("WRONGTYPE"):
        detail = message.split("QSTYPE", 1)[-1].strip()
        return WrongTypeError(f"{name}.lua refused to run: {detail}")
    return BrokerError(f"{name}.lua failed: {message}")
