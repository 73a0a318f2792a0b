"""The take-back (worker.protocol, "Taking back") racing a real handler process's reads.

The test plays the supervisor on the parent's side of a real process's rings: it writes a
round of DELIVER records, lets the process run into them, and cuts at a random moment
(the cut stored, a fence, the mark read), as ``Dispatcher.take_back`` does. Whatever the
interleaving: every delivery gets exactly one outcome; none numbered above the mark read
at the cut ever runs (another process may run it at once); those up to the mark either ran
or come back WITHDRAWN (the process may pass several between the supervisor's store of
the cut and its read of the mark), and what ran of a round comes before what did not.
"""

from __future__ import annotations

import random
import time

import pytest

from broker import envelope
from worker import protocol
from worker.ring import fence

ROUNDS, PER_ROUND = 1000, 12


def spin(seconds: float) -> None:
    """Wait without a system call (the process runs meanwhile on the other core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.slow
@pytest.mark.parametrize(("handler", "tasks"), [
    ("tests.handlers.noop:handle", 1),
    ("tests.handlers.aio:handle", 4),
])
def test_a_cut_at_any_moment_never_lets_a_delivery_run_in_two_places(children, handler, tasks):
    child = children(handler, tasks=tasks)
    assert child.outcomes(1)[0][0] == "READY"
    _, raw = envelope.build("tests", {})
    rng = random.Random(7)
    written, next_id = 0, 1
    outcomes: dict[int, list[str]] = {}
    uncertain = taken = 0
    for _ in range(ROUNDS):
        first_number = written + 1
        numbers = {}
        records = []
        for _ in range(PER_ROUND):
            written += 1
            numbers[next_id] = written
            records.append(protocol.encode_deliver(next_id, raw))
            next_id += 1
        child.send(*records)
        spin(rng.uniform(0, 0.0003))
        child.to_child.mark(written + 1)  # the cut: all written so far ...
        fence()
        reached = child.to_parent.marked  # ... that the process has not reached
        taken += max(0, written - max(reached, first_number - 1))
        got = collect(child, set(numbers), started_too=tasks > 1)
        ran_in_order = []
        for delivery_id in sorted(got, key=numbers.__getitem__):
            kinds = outcomes[delivery_id] = got[delivery_id]
            number = numbers[delivery_id]
            ran = "DONE" in kinds or "FAILED" in kinds
            withdrawn = "WITHDRAWN" in kinds
            assert ran != withdrawn, (delivery_id, number, reached, kinds)  # exactly one
            assert not (withdrawn and "STARTED" in kinds), kinds
            # Beyond the mark read at the cut nothing runs: it may be handed out at once.
            assert ran <= (number <= reached), f"delivery {number} ran, cut off at {reached}"
            uncertain += withdrawn and number <= reached
            ran_in_order.append(ran)
        # Once the process saw the cut it starts nothing written before it: what ran is a
        # prefix of the round.
        assert ran_in_order == sorted(ran_in_order, reverse=True), ran_in_order
    assert len(outcomes) == ROUNDS * PER_ROUND
    assert taken > 0  # the cuts did land before the process reached everything
    print(f"{taken} taken back, {uncertain} withdrawn up to the mark")


def collect(child, ids: set[int], started_too: bool) -> dict[int, list[str]]:
    """Outcomes until every delivery of ``ids`` has one (an async process also reports
    STARTED, which is not one)."""
    got: dict[int, list[str]] = {delivery_id: [] for delivery_id in ids}
    pending = set(ids)
    deadline = time.monotonic() + 30
    while pending:
        assert time.monotonic() < deadline, f"no outcome for {sorted(pending)}"
        records = child.to_parent.get_many(256)
        if not records:
            child.to_parent.wait(0.2)
            continue
        for record in records:
            kind, delivery_id, _ = protocol.decode(record)
            name = protocol.KIND_NAMES[kind]
            got[delivery_id].append(name)
            if name != "STARTED":
                pending.discard(delivery_id)
    assert all(kinds.count("STARTED") <= 1 for kinds in got.values())
    assert started_too or not any("STARTED" in kinds for kinds in got.values())
    return got


def test_the_jobs_only_process_reads_no_cut(children):
    """With one handler process nothing is ever taken back (supervisor.dispatch), so its
    process skips the fence and the read of the cut: it marks and runs."""
    child = children("tests.handlers.noop:handle", alone=True)
    assert child.outcomes(1)[0][0] == "READY"
    child.to_child.mark(1000)  # a cut no supervisor of a single process writes
    sent = child.deliver({}, {})
    assert child.outcomes(2) == [("DONE", delivery_id, None) for delivery_id, _ in sent]
    assert child.to_parent.marked == 2
