"""A reservation: payloads moved from a queue's ready list into a list of their own, not
yet claimed (see ``broker.redis.keys`` for the state contract)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Reservation:
    """Payloads moved from the ready list into the reservation list ``key``, not yet claimed.

    ``token`` (32 lowercase hex) names the reservation and becomes the owner token, the
    receipt, of every delivery claimed from it.
    """

    key: str
    token: str
    payloads: list[bytes]
    #: Lengths of the payloads over the size limit that reserve.lua moved straight to poison
    #: (they never crossed the wire).
    oversized: list[int] = field(default_factory=list)
