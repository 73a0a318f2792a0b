"""Reserving ahead: a settle call that makes room for a receive reserves that room in its
own write, so that the receive after it claims at once instead of waiting a round trip for
its reserve (``RedisBroker.reserve_ahead``). A plain Redis without replica confirmation
only (one connection, in order), and one reservation ahead at a time; one the receive
cannot take (it asks for fewer: a settlement was not applied), or whose reply was lost, goes
back to the ready list first.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import redis.exceptions

from broker.base import MAX_BATCH, BrokerError
from broker.redis.connection import broker_errors
from broker.redis.keys import QueueKeys
from broker.redis.reservation import Reservation
from broker.redis.scripts import Scripts, call_then
from broker.redis.wire import Wire

log = logging.getLogger("broker.redis.broker")  # its log lines keep the broker's name

#: A script call: its name, keys and arguments.
Command = tuple[str, list[str], list[Any]]


class ReserveAhead:
    """The reservation made ahead by a settle call, for the next receive."""

    def __init__(self, wire: Wire | None, scripts: Scripts, keys: QueueKeys) -> None:
        """``wire``: the scripts' connection (None on a Cluster, which never reserves
        ahead)."""
        self._wire = wire
        self._scripts = scripts
        self._keys = keys
        #: The room the next settle call reserves in its own write (0: none).
        self.wanted = 0
        self._sending = False
        #: The reservation a settle call got (for the next receive), and the key of one
        #: whose reply was lost (given back before anything else is reserved).
        self._reservation: Reservation | None = None
        self._lost: str | None = None
        #: The scripts' connection (``Wire.connects``) on which settle.lua last ran: a
        #: reserve goes ahead only on it. On a new one (a restarted server: its script cache
        #: empty) settle.lua could answer NOSCRIPT, not run, while the reserve behind it ran:
        #: reserved beyond prefetch until it is run again.
        self.settled_on = -1

    def idle(self) -> bool:
        """Nothing reserved ahead, lost or on its way, and settle.lua known to be loaded on
        the scripts' connection of now: another reserve may go ahead."""
        return not (
            self.settled_on != cast(Wire, self._wire).connects
            or self._reservation is not None or self._lost is not None or self._sending)

    async def settle_and_reserve(self, keys: list[str], args: list[Any], ahead: Command) -> Any:
        """settle.lua's reply; the reserve sent in the same write is kept for the next
        receive, or, if its reply is lost with the settle's, given back by it."""
        self._sending = True
        try:
            reply, reserved = await call_then(
                self._scripts, cast(Wire, self._wire), ("settle", keys, args), ahead)
        except BaseException:
            self._lost = ahead[1][2]  # applied or not, unknown
            raise
        finally:
            self._sending = False
        self._reply(ahead, reserved)
        return reply

    def _reply(self, command: Command, reply: Any) -> None:
        """What the reserve sent ahead got: the reservation for the next receive."""
        key = command[1][2]
        if isinstance(reply, redis.exceptions.ResponseError):  # NOSCRIPT: not run
            log.debug("reserve ahead not run: %s", reply)
            return
        if reply:  # nothing ready: nothing reserved, nothing registered (no timeout)
            oversized = [int(item) for item in reply if item.__class__ is not bytes]
            payloads = [item for item in reply if item.__class__ is bytes] if oversized else reply
            token = key[len(self._keys.reservation("")):]
            self._reservation = Reservation(key, token, payloads, oversized)

    async def take(self, max_messages: int) -> Reservation | None:
        """The reservation a settle call made ahead, if it fits in ``max_messages``; one
        that does not (a settlement was not applied: the room it was made for is not
        there), or whose reply was lost, goes back to the ready list first."""
        lost, ahead, self._reservation = self._lost, self._reservation, None
        if lost is not None:
            await self._give_back(lost)  # raises while unreachable: kept for the next try
            self._lost = None
        if ahead is None or len(ahead.payloads) <= max_messages:
            return ahead
        self._lost = ahead.key
        await self._give_back(ahead.key)
        self._lost = None
        return None

    async def _give_back(self, key: str) -> None:
        """A reservation made ahead goes back to the ready list unclaimed: marked expired,
        then recover.lua moves its payloads (in their order) and unregisters it; one never
        made is not registered and nothing happens. Over the scripts' connection, as the
        reserve went: redis-py's pool may still hold a connection a restart closed."""
        wire = cast(Wire, self._wire)
        async with broker_errors("give back a reservation made ahead"):
            await wire.call("ZADD", self._keys.reservations, "XX", 0, key)
            await self._scripts.call(
                "recover", [self._keys.reservations, self._keys.ready, key], [MAX_BATCH, 0])

    async def give_back_at_exit(self) -> None:
        """At exit: a reservation made ahead and never claimed goes back to the ready list
        now. If that fails it stays registered: recovery returns it after its deadline."""
        key = self._lost or (self._reservation.key if self._reservation is not None else None)
        if key is None:
            return
        self._reservation = None
        try:
            await self._give_back(key)
        except BrokerError as error:
            log.warning("reservation %s made ahead not given back (%s): recovery returns its "
                        "payloads after its deadline", key, error)
        self._lost = None
