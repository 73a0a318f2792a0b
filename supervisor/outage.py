"""Whether the broker can be reached, told once each way.

Every loop that talks to the broker (receive, settle, renew, maintain, progress), and the
NATS connection itself, reports here instead of logging its own failures: the first failure
of an outage is one error line (where, what is held, what happens next), a long outage a
reminder now and then (at growing intervals), and the first success after it one
"reconnected" line. Nothing per delivery and nothing per attempt.

An event counts only if its call began after the last change of state: a reply that was
already on its way when the server went away, or the failure of a call that began before it
came back, does not flip the state again. A broker with a connection of its own (NATS) tells
when it breaks and when the next one is ready (``connection_lost``, ``connection_back``); then
that alone counts, since some of its calls succeed without the server (a receive that found
the connection closed returns nothing, a maintenance pass may send nothing).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from broker.base import BrokerError, BrokerRefused, WrongTypeError
from broker.errors import closed_transport, describe
from broker.urls import redact

log = logging.getLogger("supervisor.outage")

#: Seconds between the "still unreachable" lines of one outage; the last one repeats.
REMINDERS = (30.0, 60.0, 120.0, 300.0)


def unreachable(error: BaseException) -> bool:
    """Whether a failed broker call says the broker cannot be reached now (it may come
    back), rather than that it answered and refused (credentials, a key of the wrong type)."""
    if isinstance(error, (BrokerRefused, WrongTypeError)):
        return False
    return isinstance(error, (BrokerError, OSError)) or closed_transport(error)


class Outage:
    """The broker's reachability as the loops see it; ``down`` and ``outages`` are meant to
    be read (by metrics, status lines) as plain attributes."""

    def __init__(
        self,
        address: str,
        held: Callable[[], int],
        *,
        retry_every: float,
        lease: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = redact(address)
        self.held = held  # deliveries this supervisor owns now
        self.retry_every = retry_every
        self.lease = lease
        self.clock = clock
        self.down_since: float | None = None
        self.outages = 0  # how many began since the start
        self.changed = -math.inf  # when the state last changed
        self._reminders = 0
        self._next_reminder = math.inf
        #: The broker tells its connection's state (``connection_lost``, ``connection_back``).
        self.by_connection = False

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def seconds_down(self) -> float:
        return 0.0 if self.down_since is None else self.clock() - self.down_since

    def now(self) -> float:
        """Taken before a broker call, and handed back with its outcome (``began``)."""
        return self.clock()

    def connection_lost(self, reason: str) -> None:
        """The broker's connection broke (it builds the next one itself)."""
        self._lost(reason)

    def connection_back(self) -> None:
        """The broker's next connection is ready."""
        self._back()

    def lost(self, error: BaseException | str, began: float | None = None) -> None:
        """A broker call failed because the broker could not be reached."""
        if began is not None and began < self.changed:
            return  # begun before it came back: says nothing about now
        if self.by_connection and self.down_since is None:
            return  # the connection tells when it breaks (the loops' tries only remind)
        self._lost(error)

    def back(self, began: float | None = None) -> None:
        """A broker call succeeded."""
        if self.by_connection or (began is not None and began < self.changed):
            return  # told by the connection; or a reply on its way before the outage
        self._back()

    def _lost(self, error: BaseException | str) -> None:
        reason = redact(error if isinstance(error, str) else describe(error))
        now = self.clock()
        if self.down_since is None:
            self.down_since = self.changed = now
            self.outages += 1
            self._reminders = 0
            self._next_reminder = now + REMINDERS[0]
            log.error(
                "broker unreachable at %s (%s): %d deliveries held, their settlement and "
                "renewal paused; retrying every %gs at most. They stay ours and are settled "
                "once it is back, or recovered by another consumer %gs after their last "
                "renewal", self.address, reason, self.held(), self.retry_every, self.lease,
            )
        elif now >= self._next_reminder:
            self._reminders += 1
            self._next_reminder = now + REMINDERS[min(self._reminders, len(REMINDERS) - 1)]
            log.warning("broker at %s still unreachable after %.0fs: %d deliveries held; "
                        "retrying (last error: %s)", self.address, now - self.down_since,
                        self.held(), reason)

    def _back(self) -> None:
        if self.down_since is None:
            return
        now = self.clock()
        log.info("reconnected to %s after %.0fs; settling %d held deliveries",
                 self.address, now - self.down_since, self.held())
        self.down_since, self.changed = None, now
        self._next_reminder = math.inf
