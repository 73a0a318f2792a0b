"""Bulk retry and delete of what a search matched: the confirmed plans, and the actions.

A bulk action is two steps. The confirmation page searches again, keeps the pids (NATS:
``seq:N``) it matched as a ``Plan`` under the one-time action token of its form, and shows
their count and the first of them; the form carries that token and the plan's digest.
Its POST spends the token (``auth.Guard.check``), takes the plan (once: ``Plans.take``) and
acts on exactly those pids: entries that came to match after the confirmation are not
touched, and a form sent again finds neither token nor plan. Each pid is moved or deleted
only if it is still where it was (the scripts of ``retry`` and ``failed delete``, the dead
stream's own sequence on NATS).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.base import EnvelopeLimited
from broker.nats import admin as nats_admin
from broker.redis.admin import lists as redis_lists
from broker.redis.admin import retry as retrying
from broker.redis.recovery import RECORD_LIMIT
from supervisor.dashboard.auth import ONCE_SECONDS

#: Plans kept at most, over all sessions (the oldest goes first): each holds up to
#: ``search.SEARCH_ENTRIES`` pids.
MAX_PLANS = 32
#: Pids a confirmation page lists (it counts them all).
SHOW = 10
ACTIONS = ("retry", "delete")


@dataclass(frozen=True, slots=True)
class Plan:
    """What a confirmation page showed, to be done by its form only."""

    session_id: str
    queue: int
    kind: str  # failed, dead (NATS: dead)
    action: str  # retry, delete
    selectors: tuple[str, ...]
    until: float

    @property
    def digest(self) -> str:
        return digest(self.selectors)


def digest(selectors: Sequence[str]) -> str:
    """What the form carries of the pids it confirms."""
    return hashlib.sha256("\n".join(selectors).encode()).hexdigest()[:32]


class Plans:
    """The confirmed plans not yet acted on, by the one-time token of their form."""

    def __init__(self) -> None:
        self._plans: OrderedDict[str, Plan] = OrderedDict()

    def put(self, once: str, session_id: str, queue: int, kind: str, action: str,
            selectors: Sequence[str]) -> Plan:
        now = time.time()
        while self._plans and (len(self._plans) >= MAX_PLANS
                               or next(iter(self._plans.values())).until < now):
            self._plans.popitem(last=False)
        plan = Plan(session_id, queue, kind, action, tuple(selectors), now + ONCE_SECONDS)
        self._plans[once] = plan
        return plan

    def take(self, once: str, session_id: str, queue: int, kind: str, action: str,
             digest_: str) -> Plan | None:
        """The plan of this form, once, if it is this session's, queue's, list's and
        action's, and its digest is the form's."""
        plan = self._plans.pop(once, None)
        if (plan is None or plan.until < time.time() or plan.session_id != session_id
                or (plan.queue, plan.kind, plan.action) != (queue, kind, action)
                or plan.digest != digest_):
            return None
        return plan


async def redis(broker: Any, action: str, source: str, pids: Sequence[str]) -> str:
    """Retry or delete each of ``pids`` still in ``source``; one line saying what happened."""
    queue = broker.keys.queue
    if action == "retry":
        own = broker.max_envelope_bytes if isinstance(broker, EnvelopeLimited) else 0
        report = await retrying.retry(broker.client, broker.scripts, broker.keys,
                                      source=source, pids=pids,
                                      max_record_bytes=own or RECORD_LIMIT)
        line = (f"{report.moved:,} of the {len(pids):,} confirmed jobs of {queue} moved from "
                f"{source} back to the ready list")
        extra = [(report.expired, "had no job record left (job_ttl) and left the list"),
                 (report.malformed, "were left: undecodable or over the envelope limit"),
                 (len(report.missing) + report.skipped,
                  "were not there any more or changed (retried or deleted meanwhile)")]
    else:
        deleted = await redis_lists.delete(broker.client, broker.scripts, broker.keys,
                                           source, pids)
        line = (f"{len(deleted.deleted):,} of the {len(pids):,} confirmed jobs of {queue} "
                f"deleted from {source} with their job and failure records")
        extra = [(len(deleted.missing), "were not there any more (retried or deleted "
                                        "meanwhile)")]
    return "; ".join([line, *(f"{count:,} {what}" for count, what in extra if count)])


async def nats(stream: nats_admin.DeadStream, queue: str, action: str,
               selectors: Sequence[str]) -> str:
    """Retry or delete each confirmed dead letter (``seq:N``) still in the dead stream."""
    dead = stream.names.dead_stream
    letters, _ = await stream.find(list(selectors))
    there = {f"seq:{letter.job.seq}" for letter in letters}
    report = nats_admin.Moved(missing=[s for s in selectors if s not in there])
    step = nats_admin.retry if action == "retry" else nats_admin.remove
    for letter in letters:
        await step(stream, letter, report)
    done = (f"published again to {stream.names.subject} and deleted from {dead}"
            if action == "retry" else f"deleted from {dead}")
    line = (f"{len(report.done):,} of the {len(selectors):,} confirmed dead letters of {queue} "
            f"{done}")
    extra = [(report.duplicates, "had been re-driven within the last 2 minutes already: "
                                 "the server dropped the second copy"),
             (len(report.malformed), "were left: not an envelope a handler could take"),
             (len(report.missing), "were gone meanwhile (retried or deleted by someone else)")]
    return "; ".join([line, *(f"{count:,} {what}" for count, what in extra if count)])
