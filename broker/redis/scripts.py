"""The Lua scripts of ``lua/``, loaded once (their shared helpers inlined from
``lua/includes/``) and called by name.

Scripts run with EVALSHA; when the server answers NOSCRIPT (its script cache was lost to a
restart or SCRIPT FLUSH) the script is loaded again and the call repeated. NOSCRIPT is
returned before a script runs, so the retry can neither lose nor double-apply anything.

On a Redis Cluster the client follows MOVED and ASK redirections itself. While the queue's
slot is being migrated, a script whose keys are partly moved is refused with TRYAGAIN (its
redirections may also run out): like NOSCRIPT, that is answered before the script runs, so
the call is repeated, with a growing pause, for up to ``NOT_RUN_PATIENCE`` seconds.

Scripts report a bad key type or counter with an error reply that starts with ``QSTYPE``
(before their first write); it surfaces here as ``WrongTypeError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    NoScriptError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from broker.base import BrokerError, WrongTypeError
from broker.redis.replication import Replication, write_and_wait
from broker.redis.wire import Wire

#: Cluster errors raised before a script ran (TTL exhausted is a ClusterError): safe to repeat.
NOT_RUN = (TryAgainError, ClusterDownError, ClusterError, SlotNotCoveredError)
#: How long a call repeats those; a slot migration normally takes milliseconds.
NOT_RUN_PATIENCE = 10.0

def _lua_dir() -> Path:
    """Where the scripts are: ``broker/redis/lua/`` inside an installed package (the wheel
    carries them as package data), else the checkout's top-level ``lua/`` (tests, editable
    runs)."""
    installed = resources.files("broker.redis") / "lua"
    if installed.is_dir():
        return Path(str(installed))
    return Path(__file__).resolve().parents[2] / "lua"


LUA_DIR = _lua_dir()


#: ``--- @include "includes/<helper>"`` (BullMQ's form) on a line of its own stands for the
#: text of ``lua/includes/<helper>.lua``: the helpers several scripts share have one copy.
_INCLUDE = re.compile(r'^--- @include "(?P<path>[\w/-]+)"[ \t]*(?:\n|\Z)', re.MULTILINE)


def lua_source(name: str) -> str:
    """The text of the script ``<name>.lua`` as Redis runs it (and hashes it for EVALSHA):
    each include line replaced by the helper it names, which ends with its own newline.
    One level: a helper includes nothing."""
    return _INCLUDE.sub(_included, (LUA_DIR / f"{name}.lua").read_text())


def _included(match: re.Match[str]) -> str:
    return (LUA_DIR / f"{match['path']}.lua").read_text()


class Scripts:
    """Named scripts bound to one redis-py asyncio client (plain or cluster), or, on a plain
    Redis, to a ``Wire`` (the lean connection of the hot path)."""

    def __init__(self, client: Any, wire: Wire | None = None) -> None:
        self._client = client
        self._wire = wire
        self._scripts: dict[str, Any] = {}
        self._shas: dict[str, str] = {}

    def _script(self, name: str) -> Any:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self._client.register_script(lua_source(name))
        return script

    async def call_replicated(
        self, name: str, keys: Sequence[str], args: Sequence[Any], replication: Replication
    ) -> tuple[Any, int]:
        """Like ``call``, then WAIT for ``replication.replicas`` on the same connection:
        the reply and how many replicas acknowledged the script's writes."""
        script = self._script(name)
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        for _ in range(2):  # a NOSCRIPT reply: load the script, then once more
            [reply], confirmed = await write_and_wait(
                self._client, keys[0], [command], replication
            )
            if not isinstance(reply, NoScriptError):
                break
            await self._client.script_load(script.script)
        if isinstance(reply, ResponseError):
            raise translate(name, reply) from reply
        return reply, confirmed

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        if self._wire is not None:
            return await self._call_on_wire(self._wire, name, keys, args)
        script = self._script(name)
        deadline, pause = time.monotonic() + NOT_RUN_PATIENCE, 0.01
        while True:
            try:
                return await script(keys=keys, args=args)
            except NOT_RUN as error:
                if time.monotonic() + pause > deadline:
                    raise BrokerError(f"{name}.lua not run: {error}") from error
            except ResponseError as error:
                raise translate(name, error) from error
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    def sha(self, name: str) -> str:
        sha = self._shas.get(name)
        if sha is None:
            sha = self._shas[name] = hashlib.sha1(lua_source(name).encode()).hexdigest()
        return sha

    async def _call_on_wire(
        self, wire: Wire, name: str, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        sha = self.sha(name)
        try:
            try:
                return await wire.call("EVALSHA", sha, len(keys), *keys, *args)
            except ResponseError as error:
                if not str(error).startswith("NOSCRIPT"):
                    raise
            # Answered before the script ran: load it and run it now, exactly once.
            await wire.call("SCRIPT", "LOAD", lua_source(name))
            return await wire.call("EVALSHA", sha, len(keys), *keys, *args)
        except ResponseError as error:
            raise translate(name, error) from error


async def call_then(
    scripts: Scripts, wire: Wire, first: tuple[str, Sequence[str], Sequence[Any]],
    then: tuple[str, Sequence[str], Sequence[Any]],
) -> tuple[Any, Any]:
    """Two scripts sent in one write on ``wire``: ``first``'s reply (raised as ``call``
    raises), and ``then``'s reply as it came, an error reply (NOSCRIPT too: not run) as
    the ResponseError itself. A connection error fails both (neither known to have run)."""
    futures = await wire.send(*(
        ("EVALSHA", scripts.sha(name), len(keys), *keys, *args) for name, keys, args in (
            first, then)))
    try:
        reply = await futures[0]
    except BaseException:
        futures[1].add_done_callback(_retrieved)  # fails with it, or is dropped: no warning
        raise
    second = await futures[1]
    name, keys, args = first
    if isinstance(reply, ResponseError):
        if not str(reply).startswith("NOSCRIPT"):
            raise translate(name, reply) from reply
        # Answered before the script ran: load it and run it now, exactly once.
        reply = await scripts.call(name, keys, args)
    return reply, second


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def translate(name: str, error: ResponseError) -> BrokerError:
    """Our scripts' validation errors become WrongTypeError; anything else a BrokerError."""
    message = str(error)
    if "QSTYPE" in message or message.startswith("WRONGTYPE"):
        detail = message.split("QSTYPE", 1)[-1].strip()
        return WrongTypeError(f"{name}.lua refused to run: {detail}")
    return BrokerError(f"{name}.lua failed: {message}")
