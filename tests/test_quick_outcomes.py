"""A handler process's quick jobs wake the supervisor once per batch, not once per job.

The real ``SyncRunner`` on two in-memory rings: the supervisor's side is played by reading
the outcome ring and counting its wake-ups (``worker.sync.QUICK`` is patched so that "quick"
does not depend on the machine's speed)."""

from __future__ import annotations

import mmap
import os
import time
import types

import pytest

from broker import envelope
from worker import protocol, sync
from worker.handler import Handler
from worker.ring import Ring


def ring() -> Ring:
    memory = mmap.mmap(-1, Ring.nbytes(256, 256))
    return Ring(memoryview(memory), 256, 256, os.eventfd(0, os.EFD_NONBLOCK))


def wakeups(ring: Ring) -> int:
    try:
        return os.eventfd_read(ring.wake_fd)
    except BlockingIOError:
        return 0


def runner(call) -> tuple[sync.SyncRunner, Ring]:
    handler = Handler("tests:quick", types.ModuleType("quick"), call, None, None, None, None)
    inbox, outbox = ring(), ring()
    return sync.SyncRunner(0, inbox, outbox, handler, parent=os.getppid(), queue="q",
                           flush_every=1), outbox


def batch(runner: sync.SyncRunner, count: int) -> None:
    """What ``serve`` does with a batch it read: each delivery, then the outcomes left."""
    raw = envelope.build("q", {"n": 1})[1]
    for delivery_id in range(1, count + 1):
        runner.dispatch(protocol.encode_deliver(delivery_id, raw))
    runner.send(runner._outcomes)


def done_ids(outbox: Ring) -> list[int]:
    return [protocol.decode(record)[1] for record in outbox.get_many(100)]


def test_a_batch_of_quick_jobs_wakes_the_sleeping_supervisor_once(monkeypatch) -> None:
    monkeypatch.setattr(sync, "QUICK", 3600.0)  # every job is quick
    woken: list[int] = []
    read: list[int] = []

    def supervisor_reads_between_jobs(message) -> None:
        """As a supervisor that reads as soon as it is woken would: then sleeps again."""
        woken.append(wakeups(outbox))
        outbox.clear_wakeup()
        read.extend(done_ids(outbox))
        assert outbox.prepare_sleep()

    process, outbox = runner(supervisor_reads_between_jobs)
    assert outbox.prepare_sleep()
    batch(process, 5)
    assert woken == [0, 0, 0, 0, 0]  # no job's DONE woke it while the batch ran ...
    assert wakeups(outbox) == 1  # ... the batch's end did, once
    assert read + done_ids(outbox) == [1, 2, 3, 4, 5]  # every DONE, in order


def test_a_slow_job_or_a_failure_tells_its_outcome_at_once(monkeypatch) -> None:
    monkeypatch.setattr(sync, "QUICK", 0.0)  # every job is slow
    process, outbox = runner(lambda message: None)
    raw = envelope.build("q", {"n": 1})[1]
    assert outbox.prepare_sleep()
    process.dispatch(protocol.encode_deliver(1, raw))
    process.dispatch(protocol.encode_deliver(2, raw))  # job 1's DONE goes out before it
    assert wakeups(outbox) == 1
    outbox.clear_wakeup()
    assert done_ids(outbox) == [1]

    monkeypatch.setattr(sync, "QUICK", 3600.0)
    calls = iter([ValueError("boom"), None])

    def fails_first(message) -> None:
        if (error := next(calls)) is not None:
            raise error

    process, outbox = runner(fails_first)
    assert outbox.prepare_sleep()
    process.dispatch(protocol.encode_deliver(1, raw))
    process.dispatch(protocol.encode_deliver(2, raw))  # job 1's FAILED: told at once
    assert wakeups(outbox) == 1
    outbox.clear_wakeup()
    assert [protocol.decode(record)[0] for record in outbox.get_many(10)] == [protocol.FAILED]


@pytest.mark.parametrize("quick", [True, False])
def test_a_quick_jobs_outcome_is_on_the_ring_before_the_next_job_runs(monkeypatch, quick):
    """Written without a wake-up, but written: a crash in the next job loses nothing, and
    the supervisor's watch loop reads it within a period (test_core)."""
    monkeypatch.setattr(sync, "QUICK", 3600.0 if quick else 0.0)
    seen: list[list[int]] = []
    process, outbox = None, None

    def look(message) -> None:
        seen.append(done_ids(outbox))
        time.sleep(0)

    process, outbox = runner(look)
    batch(process, 3)
    assert seen == [[], [1], [2]]
