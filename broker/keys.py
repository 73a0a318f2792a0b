"""Redis key names of one queue, in the layout `utopia-php/queue` uses (SPEC §4).

Every key is ``{ns}.{kind}.{queue}[.{suffix}]``. Lua scripts never build key names: Python
builds them here and passes them in KEYS, so Redis Cluster and Dragonfly see every key a
script touches.

State of one message (each pid is in exactly one place at any moment):

- ready: the raw envelope is in ``queue`` (producers LPUSH, consumers take from the right).
- reserved: the raw envelope is in a reservation list ``reservations.{q}.{token}`` whose key
  is registered in the sorted set ``reservations.{q}`` with a deadline (ms, server clock).
- processing: the pid is in ``processing``; ``jobs.{q}.{pid}`` holds the raw envelope and
  ``owners.{q}.{pid}`` the owner token ``<consumer id>:<nonce>``; the consumer's heartbeat
  ``consumers.{q}.{consumer id}`` expires after the lease unless renewed.
- failed: the pid is in ``failed`` and its envelope is kept in ``jobs.{q}.{pid}`` (jobTtl).
- poison: the undecodable raw bytes are in ``poison``.
- done: committed; nothing of it remains.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueKeys:
    namespace: str
    queue: str

    def _key(self, kind: str) -> str:
        return f"{self.namespace}.{kind}.{self.queue}"

    @property
    def ready(self) -> str:
        return self._key("queue")

    @property
    def processing(self) -> str:
        return self._key("processing")

    @property
    def failed(self) -> str:
        return self._key("failed")

    @property
    def dead(self) -> str:
        return self._key("dead")

    @property
    def poison(self) -> str:
        return self._key("poison")

    @property
    def reservations(self) -> str:
        """Sorted set: reservation list key -> deadline in ms of the server's clock."""
        return self._key("reservations")

    def reservation(self, token: str) -> str:
        return f"{self.reservations}.{token}"

    def job(self, pid: str) -> str:
        return f"{self._key('jobs')}.{pid}"

    def owner(self, pid: str) -> str:
        return f"{self._key('owners')}.{pid}"

    def consumer(self, consumer_id: str) -> str:
        return f"{self._key('consumers')}.{consumer_id}"

    def stat(self, name: str) -> str:
        """Counter ``total``, ``processing``, ``success`` or ``failed``."""
        return f"{self._key('stats')}.{name}"

    @property
    def reap_lock(self) -> str:
        return self._key("reap-lock")

    @property
    def reap_cursor(self) -> str:
        return self._key("reap-cursor")

    def all_fixed(self) -> list[str]:
        """Every key of the queue that does not depend on a pid, token or consumer."""
        return [
            self.ready, self.processing, self.failed, self.dead, self.poison,
            self.reservations, self.reap_lock, self.reap_cursor,
            *(self.stat(name) for name in ("total", "processing", "success", "failed")),
        ]


def owner_consumer(token: str) -> str:
    """The consumer id named by an owner token ``<consumer id>:<nonce>``."""
    return token.rpartition(":")[0]
