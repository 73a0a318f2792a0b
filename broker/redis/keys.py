"""Redis key names of one queue, in queue 5's layout (SPEC §4).

Every key is ``{ns}.{kind}.{queue}[.{suffix}]``. Lua scripts never build key names: Python
builds them here and passes them in KEYS, so Redis Cluster and Dragonfly see every key a
script touches.

State of one message (each pid is in exactly one place at any moment):

- ready: the raw envelope is in ``queue`` (producers LPUSH, consumers take from the right).
- reserved: the raw envelope is in a reservation list ``reservations.{q}.{token}`` whose key
  is registered in the sorted set ``reservations.{q}`` with a deadline (whole seconds of the
  server clock).
- processing: the pid is in ``processing``; ``jobs.{q}.{pid}`` holds the raw envelope,
  ``owners.{q}.{pid}`` the reservation's token (32 lowercase hex, the receipt) and
  ``claims.{q}.{pid}`` the same token with the lease as its expiry: the delivery is live
  while its claim exists. Recovery takes it only once the claim is gone.
- delayed (this project's own, ``[job] retry_backoff`` > 0): a retry's new envelope is a
  member of the sorted set ``supervisor-delayed.{q}``, scored by when it is due (whole
  seconds of the server clock); ``promote.lua`` moves it to ``queue`` once due, ``drain``
  all of it, stamping each with the server's time as it moves. PHP workers never read the
  set.
- failed / dead: the pid is in ``failed`` or ``dead``; its record stays in ``jobs.{q}.{pid}``
  (with job_ttl), and our failure record beside it in ``supervisor-errors.{q}.{pid}``.
- poison: the undecodable raw bytes are in ``poison``; why, when this project's supervisor
  poisoned them, in ``supervisor-poison-reasons`` (below).
- done: committed; nothing of it remains.

A keyed (coalesced) message also holds ``pending.{q}.{hex key}`` = its pid until it is
committed or rejected. ``supervisors.{q}.{consumer id}`` is this project's own,
informational record of a running supervisor (queue 5 never reads it; nothing depends on it).
``supervisor-tokens.{q}`` is this project's own hash of the owner-token prefixes its
supervisors use (16 hex, one per supervisor run) -> ``"<last renewal, unix s> <consumer id>"``:
an owner token starting with a registered prefix is known to be ours, and it is ours *and
dead* once that supervisor's record has expired (``broker.redis.recovery``). Queue 5 never
reads either key; where they are missing, queue 5's recovery rule applies.
``supervisor-running.{q}.{consumer id}`` is this project's copy of the jobs a supervisor's
handler processes run (``supervisor.running``: JSON), for ``status`` and the dashboard: it
expires with the supervisor's record and is deleted with it at a stop; nothing depends on it.
``supervisor-errors.{q}.{pid}`` is this project's failure record of a failed or dead pid
(``broker.failure``), and ``supervisor-delayed.{q}`` a sorted set of the envelopes of
retries waiting for their backoff, scored by when they are due: queue 5 reads neither.
``supervisor-failures.{q}.{pid}`` is a list of this project's failure records of a job's
failed attempts, newest first, bounded (the first failure and the last ``FAILURES_KEPT``),
with the error record's expiry: the errors key keeps holding the last record as a string,
as older versions read it. ``supervisor-poison-reasons.{q}`` (hash) and
``supervisor-poison-times.{q}`` (sorted set) keep why an entry was poisoned and when, by the
SHA1 of its bytes, at most ``POISON_REASONS_KEPT`` (the oldest evicted as new ones come): the
poison list itself keeps exactly the raw bytes, as queue 5 (which pushes there too, with no
reason) has it. Queue 5 reads none of these.
``consumers.{q}.{consumer id}`` was the previous format's heartbeat: only ``check`` reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

#: The longest expiry or deadline offset (s) any script accepts, and what the configuration
#: allows for ``job_ttl`` and ``lease``: far below what EXPIRE refuses (about 9.2e15 s; Lua
#: would not undo the writes made before a refused EXPIRE), and 68 years.
MAX_TTL = 2**31 - 1

#: Reservation deadlines (scores of ``reservations.{q}``) from here up are milliseconds, this
#: project's old format; below, whole seconds as queue 5 writes them (year 5138 in seconds,
#: 1973 in ms: no real deadline is ambiguous). ``expired.lua`` and ``recover.lua`` hold
#: copies (scripts cannot import; tests/test_lua_helpers.py compares them).
MS_DEADLINES_FROM = 10**11

#: Failed attempts a job's history (``supervisor-failures.{q}.{pid}``) keeps besides its
#: first failure (kept for when the job was first published); ``includes/remember_failure.lua``
#: holds a copy (6 = this + 1).
FAILURES_KEPT = 5

#: Poison reasons kept (``supervisor-poison-reasons.{q}``); ``includes/remember_poison.lua``
#: holds a copy. A reason whose entry left the poison list (``poison delete``) stays until it
#: is among the oldest beyond this bound.
POISON_REASONS_KEPT = 1000


def hash_tag(name: str) -> str | None:
    """The Redis Cluster hash tag of a key name: what the first ``{...}`` encloses, if any
    (Redis hashes the whole name when the braces enclose nothing)."""
    opening = name.find("{")
    closing = name.find("}", opening + 1)
    if opening < 0 or closing <= opening + 1:
        return None
    return name[opening + 1 : closing]


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
        """Sorted set: reservation list key -> deadline in whole seconds of the server clock."""
        return self._key("reservations")

    def reservation(self, token: str) -> str:
        return f"{self.reservations}.{token}"

    def job(self, pid: str) -> str:
        return f"{self._key('jobs')}.{pid}"

    def owner(self, pid: str) -> str:
        return f"{self._key('owners')}.{pid}"

    def claim(self, pid: str) -> str:
        return f"{self._key('claims')}.{pid}"

    def pending(self, coalescing_key: str) -> str:
        """The coalescing marker of a keyed message: the key's bytes in lowercase hex."""
        return f"{self._key('pending')}.{coalescing_key.encode().hex()}"

    def marker(self, envelope: dict[str, Any]) -> str | None:
        """The coalescing marker of a decoded envelope, if it is keyed (a non-empty string
        ``key``, as queue 5's coalesce() writes it)."""
        key = envelope.get("key")
        return self.pending(key) if isinstance(key, str) and key else None

    def supervisor(self, consumer_id: str) -> str:
        return f"{self._key('supervisors')}.{consumer_id}"

    def running(self, consumer_id: str) -> str:
        """This project's copy of what a supervisor's handler processes run now
        (``supervisor.running``), expiring with its record."""
        return f"{self._key('supervisor-running')}.{consumer_id}"

    def error(self, pid: str) -> str:
        """This project's failure record of a failed or dead pid (``broker.failure``)."""
        return f"{self._key('supervisor-errors')}.{pid}"

    def failures(self, pid: str) -> str:
        """List: this project's history of a pid's failed attempts, newest first (the first
        failure and the last ``FAILURES_KEPT``; ``broker.failure``)."""
        return f"{self._key('supervisor-failures')}.{pid}"

    @property
    def poison_reasons(self) -> str:
        """Hash: SHA1 (hex) of a poison entry's bytes -> ``"<unix s> <why>"``."""
        return self._key("supervisor-poison-reasons")

    @property
    def poison_times(self) -> str:
        """Sorted set: SHA1 (hex) of a poison entry's bytes -> when its reason was kept (unix
        s): the oldest go first once more than ``POISON_REASONS_KEPT`` are kept."""
        return self._key("supervisor-poison-times")

    @property
    def delayed(self) -> str:
        """Sorted set: envelopes of retries waiting for their backoff -> when due (unix s)."""
        return self._key("supervisor-delayed")

    @property
    def supervisor_tokens(self) -> str:
        """Hash: owner-token prefix of each supervisor -> its last renewal and consumer id."""
        return self._key("supervisor-tokens")

    def legacy_consumer(self, consumer_id: str) -> str:
        """The previous format's consumer heartbeat (read by ``check`` only)."""
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
            self.reservations, self.reap_lock, self.reap_cursor, self.supervisor_tokens,
            self.delayed, self.poison_reasons, self.poison_times,
            *(self.stat(name) for name in ("total", "processing", "success", "failed")),
        ]



def glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis glob (SCAN MATCH, ACL key patterns)."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)
