"""Which JetStream deliveries this broker holds, so a superseded one is never NAKed or TERMed.

A message can reach us twice: a delivery whose renewal failed is redelivered after the ack
wait, perhaps to us again. The older delivery's NAK or TERM would then act on the newer
one, so it is reported stale instead. Only deliveries still held are tracked: an entry goes
as soon as its delivery is settled (whatever the outcome, uncertain included), dead-lettered,
released or found superseded. Memory is bounded by what is outstanding, however many
settlements a long-running process makes.
"""

from __future__ import annotations


class Holdings:
    """Per stream sequence: the newest delivery count seen and the delivery counts held."""

    __slots__ = ("_seqs",)

    def __init__(self) -> None:
        self._seqs: dict[int, tuple[int, set[int]]] = {}

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

    def drop(self, seq: int, delivered: int) -> None:
        """This delivery is finished with (idempotent)."""
        entry = self._seqs.get(seq)
        if entry is None:
            return
        entry[1].discard(delivered)
        if not entry[1]:
            del self._seqs[seq]

    def clear(self) -> None:
        self._seqs.clear()

    def __len__(self) -> int:
        return len(self._seqs)
