"""``recover``: run the broker's maintenance now, until a sweep recovers nothing.

One maintenance call does bounded work: it looks at the newest 1,000 processing entries
and one 1,000-entry window of the older ones. So "nothing recovered" only counts once
enough empty sweeps in a row have covered the whole processing list. The sweeps run without
waiting for the fleet's reap lock: every change is re-checked inside a script, so a sweep
beside a supervisor's or a PHP worker's recovers nothing twice. What it takes is what the
supervisors' sweeps take (``broker.redis.recovery``): a supervisor of ours that is gone has
its deliveries recovered as soon as their claims lapsed, any other owner's only past
``recovery_age``.

``forget_stopped`` is the rollback's last step (``drain``, once nothing of ours is left):
no supervisor of ours will sweep the queue again to forget the token registry's entries.
"""

from __future__ import annotations

import math
import time
from typing import Any

from broker.base import MAX_BATCH, MaintenanceReport
from broker.redis.recovery import server_time


async def recover(broker: Any, timeout: float = 60.0) -> tuple[MaintenanceReport, bool]:
    """Sweep until nothing is left to recover (or ``timeout``); returns the sum of what
    was recovered and whether it finished (False: it timed out)."""
    total = MaintenanceReport()
    deadline = time.monotonic() + timeout
    empty_in_a_row = 0
    while time.monotonic() < deadline:
        report = await broker.maintain(force=True)
        _add(total, report)
        empty_in_a_row = 0 if report.total else empty_in_a_row + 1
        if empty_in_a_row >= await _sweeps_to_cover(broker):
            return total, True
    return total, False


async def _sweeps_to_cover(broker: Any) -> int:
    """Sweeps that together look at every processing entry (head plus older windows)."""
    length: int = await broker.client.llen(broker.keys.processing)
    return 1 + math.ceil(max(length - MAX_BATCH, 0) / MAX_BATCH)


def _add(total: MaintenanceReport, report: MaintenanceReport) -> None:
    total.expired_reservations += report.expired_reservations
    total.dead_consumers += report.dead_consumers
    total.legacy += report.legacy
    total.promoted += report.promoted


async def forget_stopped(broker: Any) -> int:
    """Remove the token registry's entries of supervisors that are no longer alive (their
    until has passed); returns how many. Only once nothing of theirs is left: an entry
    is what makes their leftovers known as ours. An entry renewed between the read and the
    delete (a supervisor frozen past its lease that came back) is written again by its
    next renewal; until then its deliveries fall under queue 5's rule, which never takes a
    live one."""
    client, keys = broker.client, broker.keys
    now, _ = await server_time(client, keys.supervisor_tokens)
    ended = []
    async for prefix, entry in client.hscan_iter(keys.supervisor_tokens, count=MAX_BATCH):
        until, _, _ = entry.partition(b" ")
        if not (until.isdigit() and int(until) > now):
            ended.append(prefix)
    forgotten = 0
    for start in range(0, len(ended), MAX_BATCH):
        forgotten += await client.hdel(keys.supervisor_tokens, *ended[start:start + MAX_BATCH])
    return forgotten
