"""One sample of a Redis queue's sizes: one pipeline of O(1) reads plus the oldest ready
envelope (``oldest.lua``: LINDEX of the tail). Never a SCAN: a scrape costs the same on
a queue of ten million jobs as on an empty one. The token registry is read whole (HVALS):
it holds one entry per supervisor run and a sweep forgets the long-gone ones.

The delayed set's first member (the lowest score: due first, whole seconds of the server
clock) gives how long the oldest delayed retry is overdue: every supervisor's maintenance
promotes what is due, so past a few maintenance intervals nobody does (issue 39.3)."""

from __future__ import annotations

import logging
from typing import Any

import redis.exceptions

from broker.gauges import QueueGauges
from broker.redis import recovery
from broker.redis.broker import RedisBroker
from broker.redis.connection import broker_errors

log = logging.getLogger(__name__)

#: The readings of the pipeline, in its order (the names of QueueGauges fields).
READINGS = ("ready", "processing", "failed", "dead", "poison", "delayed")
_refused: set[str] = set()  # readings the server refused once (logged once per process)


async def sample(broker: RedisBroker) -> QueueGauges:
    """The queue's sizes now. BrokerError when the server cannot be reached."""
    keys = broker.keys
    async with broker_errors("metrics sample"):
        pipe = broker.client.pipeline(transaction=False)
        for key in (keys.ready, keys.processing, keys.failed, keys.dead, keys.poison):
            pipe.llen(key)
        pipe.zcard(keys.delayed)
        pipe.hvals(keys.supervisor_tokens)
        pipe.zrangebyscore(keys.delayed, "-inf", "+inf", start=0, num=1, withscores=True)
        *sizes, tokens, first = await pipe.execute(raise_on_error=False)
        values = {name: _reading(name, size) for name, size in zip(READINGS, sizes, strict=True)}
        alive = _reading("supervisors_alive", tokens)
        first = _reading("delayed_overdue", first)
        # The clock the registry's entries were written by (a Cluster: the queue's node).
        now, _ = await recovery.server_time(broker.client, keys.supervisor_tokens)
        age = await broker.oldest_ready_age()
    return QueueGauges(
        **values, oldest_ready_age=age or 0.0,
        supervisors_alive=None if alive is None else _alive(alive, now),
        delayed_overdue=None if first is None else overdue(first, now),
        reconnects=broker.reconnects, unreplicated=broker.unreplicated,
    )


def _reading(name: str, value: Any) -> Any:
    """A pipeline's answer, or None (logged once) for a refused or mistyped key."""
    if isinstance(value, Exception):
        if isinstance(value, redis.exceptions.ConnectionError):
            raise value
        if name not in _refused:
            _refused.add(name)
            if isinstance(value, redis.exceptions.NoPermissionError):
                why = "an ACL user from before this version: run `acl` again"
            elif str(value).startswith("WRONGTYPE"):
                # Not an ACL matter: something else wrote that key (see `check`).
                why = "its key holds another type than this queue's; nothing here writes it"
            else:
                why = "it is left out of every sample of this process"
            log.warning("metrics: %s left out, the server refused its reading: %s (%s)",
                        name, value, why)
        return None
    return value


def _alive(entries: list[bytes], now: int) -> int:
    """Registry entries ``"<until> <consumer>"`` whose until (server seconds) is to come."""
    count = 0
    for entry in entries:
        until, _, _ = entry.partition(b" ")
        if until.isdigit() and int(until) > now:
            count += 1
    return count


def overdue(first: list[tuple[bytes, float]], now: int) -> float:
    """Seconds the first of the delayed set (``ZRANGE ... WITHSCORES`` of one) is past its
    due time at server time ``now``; 0 when none is due."""
    return float(max(0, now - int(first[0][1]))) if first else 0.0
