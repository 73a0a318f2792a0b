"""Which JetStream deliveries this broker holds, so a superseded one is never NAKed or TERMed.

A message can reach us twice: a delivery whose renewal failed is redelivered after the ack
wait, perhaps to us again. The older delivery's NAK or TERM would then act on the newer
one, so it is reported stale instead. Only deliveries still held are tracked: an entry goes
as soon as its delivery is settled (whatever the outcome, uncertain included), dead-lettered,
released or found superseded. Memory is bounded by what is outstanding, however many
settlements a long-running process makes.

It also remembers, for a held delivery whose renewals fail, when the first failed one
began: once longer ago than the ack wait, the server has certainly let that delivery go
(its timer was last reset before that renewal was sent), and a release must not republish
a copy of a message it delivers again anyway (see ``broker.nats.release``).
"""

from __future__ import annotations


class Holdings:
    """Per stream sequence: the newest delivery count seen and the delivery counts held."""

    __slots__ = ("_seqs", "_unrenewed")

    def __init__(self) -> None:
        self._seqs: dict[int, tuple[int, set[int]]] = {}
        #: (seq, delivered) -> when its first renewal that failed (since the last confirmed
        #: one) began; only deliveries whose renewals fail are here.
        self._unrenewed: dict[tuple[int, int], float] = {}

    def add(self, seq: int, delivered: int) -> None:
        entry = self._seqs.get(seq)
        if entry is None:
            self._seqs[seq] = (delivered, {delivered})
        else:
            newest, held = entry
            held.add(delivered)
            if delivered > newest:
                self._seqs[seq] = (delivered, held)

    def owns(self, seq: int, delivered: int) -> bool:
        """Held, and no newer delivery of the same message reached us."""
        entry = self._seqs.get(seq)
        return entry is not None and entry[0] == delivered and delivered in entry[1]

    def renewed(self, seq: int, delivered: int, ok: bool, began: float) -> None:
        """A renewal that began at ``began`` (monotonic) was confirmed (``ok``), or not."""
        if ok:
            if self._unrenewed:  # empty unless renewals failed: no lookup per renewal
                self._unrenewed.pop((seq, delivered), None)
        elif seq in self._seqs:
            self._unrenewed.setdefault((seq, delivered), began)

    def unrenewed_since(self, seq: int, delivered: int) -> float | None:
        """When the first of this delivery's failing renewals began; None if none failed
        since the last confirmed one."""
        return self._unrenewed.get((seq, delivered))

    def drop(self, seq: int, delivered: int) -> None:
        """This delivery is finished with (idempotent)."""
        if self._unrenewed:
            self._unrenewed.pop((seq, delivered), None)
        entry = self._seqs.get(seq)
        if entry is None:
            return
        entry[1].discard(delivered)
        if not entry[1]:
            del self._seqs[seq]

    def clear(self) -> None:
        self._seqs.clear()
        self._unrenewed.clear()

    def __len__(self) -> int:
        return len(self._seqs)
