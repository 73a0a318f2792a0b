"""What every operator command shares below the command table: opening the job's broker,
the refusal of a command a broker cannot serve, and JSON safe to print on a terminal.

Kept apart from ``supervisor.ops.commands`` so that the command modules it registers
(``failed_commands``) can use them without importing the table that imports them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

from supervisor.config import Config


class Unsupported(Exception):
    """The command cannot serve this broker (yet)."""


_UNSAFE_IN_JSON = re.compile(r"[\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def json_for_terminal(state: dict[str, Any]) -> str:
    """``state`` as indented JSON with no character a terminal acts on: DEL, C1 controls
    and bidirectional overrides become ``\\uNNNN`` (the same JSON string: such characters
    can only occur inside strings)."""
    text = orjson.dumps(state, option=orjson.OPT_INDENT_2).decode()
    return _UNSAFE_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def redis_broker(config: Config, command: str) -> contextlib.AbstractAsyncContextManager[Any]:
    """A connected RedisBroker for the job's queue (NATS keeps no such state)."""
    if config.broker.kind != "redis":
        raise Unsupported(f"{command} is for Redis queues only: JetStream keeps and recovers "
                          f"its pending deliveries itself ({config.broker.safe_url})")
    return opened_broker(config, command)


@contextlib.asynccontextmanager
async def opened_broker(config: Config, command: str) -> AsyncIterator[Any]:
    """The job's broker, connected, and closed afterwards."""
    from supervisor.brokers import make_broker

    try:
        broker: Any = make_broker(config)
    except ValueError as error:  # no adapter for this URL's scheme in this version
        raise Unsupported(f"{command}: {error}") from None
    try:
        await broker.connect()
        yield broker
    finally:
        with contextlib.suppress(Exception):  # closing must not hide the real error
            await broker.close()
