"""Early results told several at once (``Early.many``, as the NATS broker does for the acks
one read confirmed): each delivery ends exactly as if told one at a time, with one
forget, count and progress for the lot."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from broker.base import APPLIED, Outcome, Result, ResultCallback, Settlement
from broker.memory import MemoryBroker
from supervisor.settlement import Settler
from tests.inprocess import completed_buffer


class Together(MemoryBroker):
    """Tells the first ``together`` results in one ``many`` call (when the callback has
    one), then each of the rest alone, before the call returns."""

    def __init__(self, together: int, result: Result = APPLIED) -> None:
        super().__init__(replay_uncertain=False)
        self.together = together
        self.result = result
        self.many_calls: list[list[int]] = []

    async def settle(
        self, settlements: Sequence[Settlement], on_result: ResultCallback | None = None
    ) -> list[Result]:
        results = [self.result] * len(settlements)
        many = getattr(on_result, "many", None)
        first = list(range(min(self.together, len(settlements))))
        assert on_result is not None
        if many is not None:
            self.many_calls.append(first)
            many(first, self.result)
        else:
            for index in first:
                on_result(index, self.result)
        for index in range(len(first), len(settlements)):
            on_result(index, self.result)
        return results


async def settled(broker: Together, count: int, release: int = -1, reject: int = -1):
    buffer = await completed_buffer(broker, count, failed=reject)
    confirmed: list[tuple[int, bool]] = []
    progress: list[int] = []
    settler = Settler(broker, buffer, lambda entry, ok: confirmed.append((entry.id, ok)),
                      progress=lambda: progress.append(1))
    batch = buffer.take_completed(count)
    if release >= 0:
        batch[release].release = True
    ok = await settler.settle(batch)
    buffer.check()
    return ok, buffer, confirmed, progress, settler


def test_confirmations_told_together_settle_each_and_tell_progress_once():
    async def scenario():
        broker = Together(together=4)
        ok, buffer, confirmed, progress, settler = await settled(broker, 5, release=2)
        assert ok and buffer.outstanding == 0
        assert broker.many_calls == [[0, 1, 2, 3]]  # the settler takes them together
        assert sorted(confirmed) == [(1, True), (2, True), (3, False), (4, True), (5, True)]
        assert (settler.metrics.counts["commit"], settler.metrics.counts["release"]) == (4, 1)
        assert len(progress) == 2  # once for the four, once for the last alone

    asyncio.run(scenario())


def test_a_reject_among_them_is_settled_as_alone():
    async def scenario():
        broker = Together(together=3)
        ok, buffer, confirmed, _, settler = await settled(broker, 3, reject=1)
        assert ok and buffer.outstanding == 0
        assert sorted(confirmed) == [(1, True), (2, False), (3, True)]
        assert (settler.metrics.counts["commit"], settler.metrics.counts["reject"]) == (2, 1)

    asyncio.run(scenario())


def test_uncertain_results_told_together_are_left_to_the_broker_each():
    async def scenario():
        broker = Together(together=3, result=Result(Outcome.UNCERTAIN, "no reply"))
        ok, buffer, confirmed, _, settler = await settled(broker, 3)
        assert ok and buffer.outstanding == 0  # never replayed on this broker
        assert sorted(confirmed) == [(1, False), (2, False), (3, False)]
        assert settler.metrics.counts["uncertain"] == 3
        assert settler.metrics.counts["commit"] == 0

    asyncio.run(scenario())
