"""The supervisor's core in one process: the buffer, the settler and the arbiter.

The arbiter runs for real on real rings against ``broker.memory.MemoryBroker``; handler
processes are played by the test (tests/inprocess.py). The property test at the end drives
all three through any order of handler outcomes, handler deaths, settlement faults,
recoveries by other consumers and a stop, checking after every step that the prefetch bound
holds and every delivery is in exactly one state, and at the end that nothing is lost.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from broker.base import Delivery, Received
from broker.failure import Failure
from broker.memory import MemoryBroker
from supervisor import exits
from supervisor.arbiter import BATCHES_IN_FLIGHT, MAX_BATCH, batch_limit
from supervisor.buffer import AccountingError, Buffer, Entry, State
from supervisor.dispatch import plan
from supervisor.settlement import Settler
from tests.inprocess import Core, InProcessForkServer, completed_buffer, core_config
from worker import protocol
from worker.forkserver import ForkServer, Spawner


def deliveries(count: int, start: int = 1) -> list[Delivery]:
    return [Delivery(f"p{n}", "q", 0, 0, {}, b"", n) for n in range(start, start + count)]


def run(coroutine):
    return asyncio.run(coroutine)


def ids(entries: list[Entry]) -> list[int]:
    return [entry.id for entry in entries]


def entry(buffer: Buffer, entry_id: int) -> Entry:
    return next(entry for entry in buffer if entry.id == entry_id)


# -- the buffer ------------------------------------------------------------------------------


def test_a_delivery_passes_through_every_state_in_its_one_place():
    buffer = Buffer(prefetch=4, handlers=2)
    buffer.add(deliveries(3))
    buffer.check()
    assert [entry.state for entry in buffer] == [State.WAITING] * 3
    buffer.queue(1, 2)  # the ring of handler 1 took two
    assert [entry.place for entry in buffer.in_state(State.QUEUED, 1)] == [1, 1]
    assert buffer.waiting_count == 1
    first = buffer.started(1, 1)
    buffer.check()
    assert first.state is State.RUNNING and buffer.load(1) == 2
    buffer.finished(1, 1, error=None)
    buffer.skipped(1, 2)
    buffer.check()
    completed = buffer.in_state(State.COMPLETED)
    assert ids(completed) == [1, 2] and completed[1].release
    batch = buffer.take_completed(10)
    buffer.check()
    buffer.forget(batch[0])
    buffer.retry_later(batch[1:])
    buffer.check()
    assert buffer.outstanding == 2 and buffer.in_state(State.COMPLETED)[0].settle_failures == 1


def test_a_plain_handlers_mark_starts_it_and_the_queued_ones_before_it_in_order():
    buffer = Buffer(prefetch=5, handlers=1)
    buffer.add(deliveries(4))
    buffer.queue(0, 4)
    assert [entry.number for entry in buffer.in_state(State.QUEUED, 0)] == [1, 2, 3, 4]
    assert buffer.started_up_to(0, 0, at=7.0) == []  # nothing reached yet: nothing changes
    # A DONE read before the mark was: the next queued one finished in order.
    assert buffer.finished(0, 1, error=None, in_order=True).id == 1
    promoted = buffer.started_up_to(0, 3, at=7.0)  # 2 was held for flush(), 3 runs
    buffer.check()
    assert ids(promoted) == [2, 3] and ids(buffer.running_in(0)) == [2, 3]
    assert all(entry.started_at == 7.0 for entry in promoted)
    assert buffer.started_up_to(0, 3, at=8.0) == []  # read twice: its start is known
    assert ids(buffer.in_state(State.QUEUED, 0)) == [4]
    # 3 runs: 4 waits (the head counts as running only while nothing is known to run)
    assert buffer.unstarted(in_order=True) == 1 == buffer.unstarted()
    buffer.finished(0, 2, error=None, in_order=True)
    with pytest.raises(AccountingError):  # neither running nor next: a bug, not a guess
        buffer.finished(0, 1, error=None, in_order=True)
    with pytest.raises(AccountingError):  # an async handler reports STARTED first
        buffer.finished(0, 4, error=None)
    buffer.finished(0, 3, error=None, in_order=True)
    assert buffer.unstarted(in_order=True) == 0 and buffer.unstarted() == 1
    buffer.finished(0, 4, error=None, in_order=True)
    buffer.check()
    assert ids(buffer.in_state(State.COMPLETED)) == [1, 2, 3, 4]


def test_a_plain_handlers_failure_ahead_of_held_successes_starts_them():
    # A plain handler with flush() holds 1 and 2; 3 raises and is FAILED at once, before
    # their DONE; at a stop 4 is SKIPPED, still before their DONE. Reported in ring order,
    # that means 1 and 2 started (the chaos soaks exited 4: 'reported delivery 41, next
    # queued 26').
    buffer = Buffer(prefetch=6, handlers=2)
    buffer.add(deliveries(6))
    buffer.queue(1, 6)
    failed = buffer.finished(1, 3, error="boom", in_order=True)
    buffer.check()
    assert failed.started_at == 0.0  # its start never seen: the outcome is not timed
    assert ids(buffer.running_in(1)) == [1, 2]
    assert all(entry.started_at > 0 for entry in buffer.running_in(1))
    with pytest.raises(AccountingError, match="reported delivery 5, next queued 4"):
        buffer.skipped(1, 5)  # an async handler's process skips in order: no guess
    for entry_id in (4, 5, 6):
        assert buffer.skipped(1, entry_id, in_order=True).release
    buffer.check()
    assert ids(buffer.running_in(1)) == [1, 2]  # the exit's flush() reports them
    for entry_id in (1, 2):
        buffer.finished(1, entry_id, error=None, in_order=True)
    with pytest.raises(AccountingError, match="reported delivery 3, next queued None"):
        buffer.finished(1, 3, error=None, in_order=True)  # reported twice: a bug
    buffer.check()
    assert ids(buffer.in_state(State.COMPLETED)) == [3, 4, 5, 6, 1, 2]


def test_a_run_of_successes_taken_at_once_ends_as_one_by_one_would():
    def played(finish: Callable[[Buffer], None]) -> list[tuple[int, State, int | None]]:
        buffer = Buffer(prefetch=8, handlers=2)
        buffer.add(deliveries(8))
        buffer.queue(0, 5)
        buffer.queue(1, 3)
        buffer.started(1, 6)  # an async handler's process: started, then done
        buffer.started(1, 7)
        finish(buffer)
        buffer.check()
        return [(entry.id, entry.state, entry.place) for entry in buffer.in_state(
            State.COMPLETED)] + [(e.id, e.state, 0) for e in buffer.running_in(0)]

    def one_by_one(buffer: Buffer) -> None:
        for entry_id in (1, 3, 5):  # 2 and 4 held for flush(): they started before 3
            buffer.finished(0, entry_id, None, in_order=True)
        for entry_id in (7, 6):
            buffer.finished(1, entry_id, None)

    def at_once(buffer: Buffer) -> None:
        buffer.finished_many(0, (1, 3, 5), in_order=True)
        buffer.finished_many(1, (7, 6))

    assert played(at_once) == played(one_by_one)
    assert [entry_id for entry_id, *_ in played(at_once)] == [1, 3, 5, 7, 6, 2, 4]
    buffer = Buffer(prefetch=4, handlers=1)
    buffer.add(deliveries(3))
    buffer.queue(0, 3)
    with pytest.raises(AccountingError, match="reported delivery 1, next queued 2"):
        buffer.finished_many(0, (1, 1), in_order=True)  # reported twice: a bug
    with pytest.raises(AccountingError, match="reported delivery 2, not running there"):
        buffer.finished_many(0, (2,))  # an async handler's process reports STARTED first
    assert ids(buffer.in_state(State.COMPLETED)) == [1]


@pytest.mark.slow
def test_outcomes_read_together_are_taken_in_ring_order_whatever_their_kinds():
    async def scenario():
        core, broker, pids = await running_core(4, 4, 1)
        settled: list[tuple[str, str]] = []
        settle = broker.settle

        async def recorded(settlements, on_result=None):
            settled.extend((s.action.value, s.delivery.pid) for s in settlements)
            return await settle(settlements, on_result)

        broker.settle = recorded  # type: ignore[method-assign]
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 4)
        process = core.process(0)
        for _ in range(4):
            process.start_next()
        ring = core.places[0].to_parent
        # Four outcomes published together: one read, DONE runs around a FAILED.
        assert ring.put_many([protocol.encode_done(1, 0.5), protocol.encode_failed(
            2, Failure("RuntimeError", "boom")), protocol.encode_done(3), protocol.encode_done(
            4)]) == 4
        await core.wait_for(lambda: len(settled) == 4)  # the reject then runs again
        assert settled == [("commit", pids[0]), ("reject", pids[1]), ("commit", pids[2]),
                           ("commit", pids[3])]
        assert core.arbiter.places[0].job_finished(0) == 4
        assert await core.stop() == exits.OK

    run(scenario())


def test_outcomes_written_during_a_settle_call_wake_nobody_and_go_in_the_next_call():
    async def scenario():
        core, broker, pids = await running_core(6, 6, 1)
        gate, calls = asyncio.Event(), []
        settle = broker.settle

        async def held(settlements, on_result=None):
            calls.append([settlement.delivery.pid for settlement in settlements])
            await gate.wait()
            return await settle(settlements, on_result)

        broker.settle = held  # type: ignore[method-assign]
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 6)
        process, ring = core.process(0), core.places[0].to_parent
        process.start_next()
        process.finish()
        await core.wait_for(lambda: len(calls) == 1)  # the call under way: held
        assert not ring.asleep  # its return reads the ring: the process wakes nobody
        for _ in range(3):
            process.start_next()
            process.finish()
        await core.settle_down()
        assert core.arbiter.buffer.completed_count == 0  # not read yet
        # A call that hangs leaves them unread no longer than a watch period.
        async with asyncio.timeout(1.0):
            await core.wait_for(lambda: core.arbiter.buffer.completed_count == 3)
        assert not ring.asleep  # the next call follows this one
        gate.set()
        await core.wait_for(lambda: len(calls) == 2)
        assert calls == [pids[:1], pids[1:4]]
        await core.wait_for(lambda: ring.asleep)  # nothing more completed: armed again
        process.work()  # the last two: each read when it is written, as before
        await core.wait_for(lambda: len(broker.committed) == 6)
        assert calls[2:] in ([pids[4:5], pids[5:6]], [pids[4:6]])
        assert await core.stop() == exits.OK

    run(scenario())


def test_a_ring_stays_armed_while_its_outcomes_could_start_a_receive_or_a_dispatch():
    async def scenario():
        core, _, _ = await running_core(4, 4, 1)
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 4)
        arbiter = core.arbiter
        # Checked in one turn of the loop, the receive loop's state set as it could be.
        receiving, room = arbiter.receiving, arbiter.room.is_set()
        arbiter.settle_in_flight, arbiter.receiving = True, 0
        arbiter.room.clear()
        assert arbiter.receive_room() <= 0 and arbiter.reads_after_settling()  # full
        arbiter.buffer.prefetch = 6  # room the receive waits for: running dry would start it
        assert not arbiter.reads_after_settling()
        arbiter.receiving = 2  # a receive under way takes it: outcomes start nothing sooner
        assert arbiter.reads_after_settling()
        arbiter.buffer.add(deliveries(1, start=50))  # one waits for room in a ring
        assert not arbiter.reads_after_settling()
        assert arbiter.buffer.drop(arbiter.buffer.next_waiting(1)[0])
        arbiter.settle_in_flight, arbiter.buffer.prefetch = False, 4
        arbiter.receiving = receiving
        if room:
            arbiter.room.set()
        assert await core.stop() == exits.OK

    run(scenario())


def test_a_handler_reporting_a_delivery_out_of_order_is_a_bug_not_a_guess():
    buffer = Buffer(prefetch=4, handlers=1)
    buffer.add(deliveries(2))
    buffer.queue(0, 2)
    with pytest.raises(AccountingError, match="reported delivery 2, next queued 1"):
        buffer.started(0, 2)
    with pytest.raises(AccountingError, match="not running there"):
        buffer.finished(0, 1, None)


def test_more_than_prefetch_outstanding_is_a_bug():
    buffer = Buffer(prefetch=2, handlers=1)
    with pytest.raises(AccountingError, match="3 deliveries outstanding > prefetch"):
        buffer.add(deliveries(3))


def test_a_dead_handler_fails_the_blamed_and_its_others_wait_again_in_order():
    buffer = Buffer(prefetch=8, handlers=1)
    buffer.add(deliveries(5))
    buffer.queue(0, 5)
    for entry_id in (1, 2, 3):
        buffer.started(0, entry_id)
    buffer.held(0, 1)
    assert ids(buffer.running_in(0)) == [1, 2, 3]
    blamed = [entry(buffer, 3)]
    buffer.handler_gone(0, blamed, "worker lost")
    buffer.check()
    completed, waiting = buffer.in_state(State.COMPLETED), buffer.in_state(State.WAITING)
    assert ids(completed) == [3] and completed[0].error == "worker lost"
    assert ids(waiting) == [1, 2, 4, 5]
    assert not any(entry.held or entry.place is not None for entry in waiting)


def test_a_handler_killed_at_the_stop_deadline_leaves_its_running_ones_owned():
    buffer = Buffer(prefetch=4, handlers=1)
    buffer.add(deliveries(3))
    buffer.queue(0, 3)
    buffer.started(0, 1)
    buffer.handler_gone(0, abandon=True)
    buffer.check()
    assert ids(buffer.in_state(State.ABANDONED)) == [1] and buffer.outstanding == 3
    assert ids(buffer.in_state(State.WAITING)) == [2, 3]
    assert buffer.release_waiting() == 2


def test_only_a_waiting_delivery_can_be_dropped():
    buffer = Buffer(prefetch=4, handlers=1)
    buffer.add(deliveries(2))
    buffer.queue(0, 1)
    queued, waiting = entry(buffer, 1), entry(buffer, 2)
    assert not buffer.drop(queued) and buffer.drop(waiting)
    assert not buffer.drop(waiting)  # twice: already gone
    buffer.check()
    assert buffer.outstanding == 1


def test_check_finds_a_delivery_in_two_places():
    buffer = Buffer(prefetch=4, handlers=1)
    buffer.add(deliveries(1))
    buffer._completed.append(entry(buffer, 1))  # the kind of bug check() is there for
    with pytest.raises(AccountingError, match="is waiting and completed"):
        buffer.check()


#: What only the buffer may touch (its containers) and only a handler place may change (its
#: counters), by the module that owns them.
WALLS = {
    "supervisor/buffer.py": {"entries", "waiting", "completed", "settling", "queued", "running"},
    "supervisor/handlers.py": {"ready", "jobs", "early_deaths"},
}


def breaches(path: Path) -> list[str]:
    """Lines of ``path`` that read the buffer's containers or assign a place's counters."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr.lstrip("_")
        owner = node.value
        on_buffer = (isinstance(owner, ast.Name) and owner.id == "buffer") or (
            isinstance(owner, ast.Attribute) and owner.attr == "buffer")
        if on_buffer and name in WALLS["supervisor/buffer.py"]:
            found.append(f"{path}:{node.lineno} reads buffer.{node.attr}")
        of_self = isinstance(owner, ast.Name) and owner.id == "self"  # its own attribute
        if isinstance(node.ctx, ast.Store) and not of_self and name in WALLS[
            "supervisor/handlers.py"
        ]:
            found.append(f"{path}:{node.lineno} assigns .{node.attr}")
    return found


def test_only_the_buffer_moves_deliveries_and_only_a_place_counts_its_process():
    root = Path(__file__).resolve().parent.parent
    found = [
        breach
        for folder in ("supervisor", "worker", "broker")
        for path in sorted((root / folder).rglob("*.py"))
        if str(path.relative_to(root)) not in WALLS
        for breach in breaches(path)
    ]
    assert not found


# -- the settler -------------------------------------------------------------------------------


async def settler_with(
    count: int, replay_uncertain: bool = True, early: bool = True, **faults: int
) -> tuple[Settler, Buffer, list, MemoryBroker]:
    """A settler over ``count`` completed successes, on a broker with ``faults`` to come
    that tells each result as it is made (``early``, as JetStream) or all at once (as Redis):
    (settler, buffer, the confirmations it made, broker)."""
    broker = MemoryBroker(replay_uncertain=replay_uncertain, early_results=early)
    for name, value in faults.items():
        setattr(broker.faults, name, value)
    buffer = await completed_buffer(broker, count)
    confirmed: list = []
    settler = Settler(broker, buffer, lambda entry, ok: confirmed.append((entry.id, ok)))
    return settler, buffer, confirmed, broker


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_a_confirmed_commit_is_forgotten_and_confirmed(early):
    async def scenario():
        settler, buffer, confirmed, broker = await settler_with(3, early=early)
        assert await settler.settle(buffer.take_completed(10))
        assert buffer.outstanding == 0 and sorted(confirmed) == [(1, True), (2, True), (3, True)]
        assert sum(broker.committed.values()) == 3

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_a_failed_settle_call_keeps_everything_outstanding_to_settle_again(early):
    async def scenario():
        settler, buffer, confirmed, broker = await settler_with(3, early=early, settle_errors=1)
        assert not await settler.settle(buffer.take_completed(10))
        buffer.check()
        assert buffer.completed_count == 3 and not confirmed and not broker.committed
        assert await settler.settle(buffer.take_completed(10))
        assert buffer.outstanding == 0 and sum(broker.committed.values()) == 3

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_one_unapplied_result_does_not_hold_back_the_others(early):
    async def scenario():
        settler, buffer, _, _ = await settler_with(3, early=early, unapplied=1)
        assert not await settler.settle(buffer.take_completed(10))
        assert ids(buffer.in_state(State.COMPLETED)) == [1] and buffer.outstanding == 1

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_a_lost_reply_is_replayed_and_the_replay_finds_it_done(early):
    async def scenario():
        settler, buffer, confirmed, broker = await settler_with(
            1, early=early, uncertain_applied=1)
        assert not await settler.settle(buffer.take_completed(10))
        assert buffer.outstanding == 1  # not known to be applied: kept
        assert await settler.settle(buffer.take_completed(10))  # answered stale: forgotten
        assert buffer.outstanding == 0 and confirmed == [(1, False)]
        assert sum(broker.committed.values()) == 1  # applied once, by the first call

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_without_replay_a_lost_reply_is_left_to_the_broker(early):
    async def scenario():
        settler, buffer, _, broker = await settler_with(
            1, replay_uncertain=False, early=early, uncertain_unapplied=1
        )
        assert await settler.settle(buffer.take_completed(10))
        assert buffer.outstanding == 0 and not broker.committed
        assert len(broker.owned) == 1  # the broker redelivers it after its ack wait

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_a_delivery_another_consumer_recovered_is_stale_and_forgotten(early):
    async def scenario():
        settler, buffer, confirmed, broker = await settler_with(2, early=early)
        broker.recover(entry(buffer, 1).delivery.pid)
        assert await settler.settle(buffer.take_completed(10))
        assert buffer.outstanding == 0 and sorted(confirmed) == [(1, False), (2, True)]
        assert len(broker.ready) == 1 and sum(broker.committed.values()) == 1

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_a_mixed_batch_is_settled_and_counted_per_action(early):
    async def scenario():
        settler, buffer, confirmed, broker = await settler_with(5, early=early)
        batch = buffer.take_completed(10)
        batch[1].error = "boom"  # rejected: retried by the broker
        batch[2].release = True
        broker.recover(batch[3].delivery.pid)  # stale
        assert await settler.settle(batch)
        assert buffer.outstanding == 0
        assert sorted(confirmed) == [(1, True), (2, False), (3, False), (4, False), (5, True)]
        counts = settler.metrics.counts
        assert (counts["commit"], counts["reject"], counts["release"], counts["stale"]) == (
            2, 1, 1, 1)
        assert sum(broker.committed.values()) == 2 and len(broker.ready) == 3

    run(scenario())


def test_a_batch_whose_commits_and_releases_all_applied_is_settled_per_action():
    async def scenario():
        settler, buffer, confirmed, _ = await settler_with(4, early=False)
        batch = buffer.take_completed(10)
        batch[1].release = True
        assert await settler.settle(batch)
        buffer.check()
        assert buffer.outstanding == 0
        assert sorted(confirmed) == [(1, True), (2, False), (3, True), (4, True)]
        counts = settler.metrics.counts
        assert (counts["commit"], counts["release"]) == (3, 1)

    run(scenario())


@pytest.mark.parametrize("early", [True, False], ids=["early", "at-once"])
def test_a_settler_without_a_listener_confirms_nothing_and_settles_all(early):
    async def scenario():
        _, buffer, _, broker = await settler_with(3, early=early)
        # No handler defines on_success: the arbiter gives no confirm callback.
        quiet = Settler(broker, buffer, None)
        batch = buffer.take_completed(10)
        batch[0].error = "boom"
        assert await quiet.settle(batch)
        assert buffer.outstanding == 0 and sum(broker.committed.values()) == 2

    run(scenario())


# -- the arbiter ---------------------------------------------------------------------------------


def test_the_played_fork_server_and_the_real_one_are_both_spawners():
    """The arbiter knows a fork server only as a ``Spawner``; the one these tests play must
    stay one (mypy checks the signatures in tests/inprocess.py, this the members)."""
    played = InProcessForkServer([])
    try:
        assert isinstance(played, Spawner)
        assert isinstance(ForkServer(sys.exit), Spawner)  # never started
    finally:
        played.close()



async def running_core(
    messages: int, prefetch: int, coroutines: int, broker: MemoryBroker | None = None
) -> tuple[Core, MemoryBroker, list[str]]:
    """An arbiter running with ``messages`` published: (core, broker, their pids)."""
    broker = broker or MemoryBroker()
    pids = await broker.publish_many("jobs", [{"n": n} for n in range(messages)])
    core = Core(core_config(prefetch=prefetch, coroutines=coroutines), broker)
    await core.start()
    return core, broker, pids


def test_every_message_runs_and_is_committed_within_the_prefetch_bound():
    async def scenario():
        core, broker, pids = await running_core(200, 10, 2)
        peak = 0
        async with asyncio.timeout(10):
            while len(broker.committed) < len(pids):
                for process in core.server.living():
                    process.start_next()
                    process.finish()
                await core.settle_down(2)
                core.arbiter.buffer.check()
                peak = max(peak, core.arbiter.buffer.outstanding)
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids) and not broker.owned
        assert 0 < peak <= 10

    run(scenario())


def test_each_delivery_tells_its_handler_process_whether_the_envelope_is_plain():
    # What the broker's decode at the claim read by its fast path goes out flagged plain
    # (the handler process reads it with orjson alone); what PHP's typing coerced does not.
    async def scenario():
        broker = MemoryBroker()
        broker.push_raw(b'{"pid":12,"queue":"jobs","timestamp":"5","payload":{"a":1}}')
        core, broker, _ = await running_core(1, 10, 1, broker)
        process = core.process(0)
        await core.wait_for(lambda: process.read() or len(process.plain) == 2)
        assert list(process.plain.values()) == [False, True]
        assert await core.stop() == exits.OK

    run(scenario())


@pytest.mark.parametrize("concurrency", [1, 3])
def test_settlement_calls_run_in_the_loop_or_in_tasks_by_the_brokers_concurrency(concurrency):
    """One call at a time (Redis): the settle loop makes the call itself, no task per batch;
    several (JetStream): each call is a task of its own. Everything is committed either way."""
    async def scenario():
        broker = MemoryBroker(settle_concurrency=concurrency)
        core, broker, pids = await running_core(60, 10, 1, broker)
        tasks = 0
        async with asyncio.timeout(10):
            while len(broker.committed) < len(pids):
                for process in core.server.living():
                    process.start_next()
                    process.finish()
                await asyncio.sleep(0)
                tasks = max(tasks, len(core.arbiter.settling))
                await core.settle_down(2)
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids)
        assert (tasks == 0) == (concurrency == 1)

    run(scenario())


def test_with_calls_in_tasks_the_outcome_read_starts_the_settle_call_itself():
    """Where settle calls run in tasks (JetStream), the read of a job's outcome starts the
    call, up to its first wait, without the settle loop: waking that loop to make a task,
    then the task's first turn, came after whatever the event loop had queued, per job at
    prefetch 1. Everything is still committed, one call per job."""
    async def scenario():
        broker = MemoryBroker(settle_concurrency=3)
        core, broker, pids = await running_core(20, 1, 1, broker)
        arbiter = core.arbiter
        wakes = 0
        wake = arbiter.settle_wanted.set

        def counted() -> None:
            nonlocal wakes
            wakes += 1
            wake()

        arbiter.settle_wanted.set = counted  # type: ignore[method-assign]
        # The call itself starts in that read, not a turn later (its acks leave at once).
        started_in_the_read: list[bool] = []
        read = arbiter.outcomes.handle_outcomes

        def reading(place) -> None:
            calls = broker.calls["settle"]
            read(place)
            started_in_the_read.append(broker.calls["settle"] == calls + 1)

        handler = core.process(0)
        asyncio.get_running_loop().add_reader(  # replaces the arbiter's reader of the ring
            handler.place.to_parent.wake_fd, arbiter.guarded(reading), handler.place)
        async with asyncio.timeout(10):
            while len(broker.committed) < len(pids):
                handler.start_next()
                handler.finish()
                await core.settle_down(2)
        assert wakes == 0
        assert started_in_the_read.count(True) == len(pids)
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids)

    run(scenario())


@dataclasses.dataclass
class PushingBroker(MemoryBroker):
    """Tells when messages arrived, as the NATS broker does after a read that brought
    pulled messages; ``receive_nowait`` hands them out without a wait."""

    arrival: Callable[[], None] | None = None
    taken: int = 0

    def on_arrival(self, callback: Callable[[], None]) -> None:
        self.arrival = callback

    def receive_nowait(self, max_messages: int) -> Received | None:
        if not self.ready:
            return None
        self.taken += 1
        receiving = self.receive(max_messages, 0.0)
        try:
            receiving.send(None)  # something is ready: it ends without a wait
        except StopIteration as done:
            return done.value
        raise AssertionError("receive waited")


def test_arrivals_are_taken_and_dispatched_in_the_turn_the_broker_tells_them():
    """NATS reads the pulled message in the same read as the ack that made room for it:
    the arbiter takes it there and hands it to the handler, instead of waking the receive
    loop for a receive of its own (a turn of the event loop more, per job at prefetch 1)."""
    async def scenario():
        broker = PushingBroker(settle_concurrency=3)
        core, broker, pids = await running_core(12, 1, 1, broker)
        arbiter = core.arbiter
        await core.wait_for(lambda: arbiter.buffer.outstanding == 1)
        receives = broker.calls["receive"]
        opened = arbiter.opened

        def opened_then_arrived() -> None:  # the ack's reply, then the pulled message
            opened()
            assert broker.arrival is not None
            broker.arrival()

        arbiter.opened = opened_then_arrived  # type: ignore[method-assign]
        handler = core.process(0)
        async with asyncio.timeout(10):
            while len(broker.committed) < len(pids):
                handler.start_next()
                handler.finish()
                await core.settle_down(2)
                arbiter.buffer.check()
        assert broker.taken == len(pids) - 1
        assert broker.calls["receive"] - receives == len(pids) - 1  # receive_nowait's own
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids)

    run(scenario())


def test_arrivals_are_left_to_a_receive_in_flight():
    """A receive under way fills the room it saw: arrivals taken meanwhile would push the
    outstanding deliveries past prefetch, so they wait for it."""
    async def scenario():
        broker = PushingBroker(settle_concurrency=3)
        core, broker, _ = await running_core(0, 1, 1, broker)
        arbiter = core.arbiter
        await core.wait_for(lambda: arbiter.receiving)  # waiting on an empty queue
        await broker.publish_many("jobs", [{"n": 1}, {"n": 2}])  # wakes it at the next turn
        assert broker.arrival is not None
        broker.arrival()  # this turn: the receive is still under way
        assert broker.taken == 0 and arbiter.buffer.outstanding == 0
        await core.wait_for(lambda: arbiter.buffer.outstanding == 1)
        await core.settle_down()
        assert broker.taken == 0 and arbiter.buffer.outstanding == 1
        arbiter.buffer.check()
        assert await core.stop(work=False) == exits.OK

    run(scenario())


async def finish_settled(core, broker, jobs: int) -> None:
    """Handler 0 runs and finishes ``jobs`` deliveries; back once they are settled."""
    handler = core.process(0)
    for _ in range(jobs):
        handler.start_next()
        handler.finish()
    settled = sum(broker.committed.values()) + jobs
    await core.wait_for(lambda: sum(broker.committed.values()) == settled)
    await core.settle_down()


def test_a_slow_handler_is_refilled_a_batch_at_a_time_not_a_job_at_a_time():
    async def scenario():
        core, broker, _ = await running_core(300, 100, 1)
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 100)
        receives = broker.calls["receive"]

        async def finish(jobs: int) -> None:
            await finish_settled(core, broker, jobs)

        await finish(24)  # 24 free of 100: less than a quarter, and 76 still to start
        assert broker.calls["receive"] == receives and core.arbiter.buffer.outstanding == 76
        await finish(1)  # a quarter free: one receive fills it
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 100)
        assert broker.calls["receive"] == receives + 1
        assert await core.stop(work=False) == exits.OK

    run(scenario())


def test_dispatch_spreads_to_the_least_loaded_and_fills_for_a_handler_with_flush():
    # Spread: each next delivery to the least loaded, the first on a tie, up to the depth.
    assert plan([0, 0, 0, 0], 2, 8, fill=False) == [2, 2, 2, 2]
    assert plan([1, 0, 0, 0], 2, 5, fill=False) == [1, 2, 1, 1]
    assert plan([2, 2], 2, 3, fill=False) == [0, 0]
    # Fill: the most loaded with room first (the first on a tie), up to the depth, then
    # the next, so what each process flushes together stays one batch.
    assert plan([0, 0, 0, 0], 16, 8, fill=True) == [8, 0, 0, 0]
    assert plan([0, 0, 0, 0], 16, 40, fill=True) == [16, 16, 8, 0]
    assert plan([3, 10, 0, 16], 16, 12, fill=True) == [6, 6, 0, 0]
    assert plan([4, 0, 4, 0], 16, 14, fill=True) == [12, 0, 2, 0]
    assert plan([16, 16], 16, 5, fill=True) == [0, 0]
    # One handler: a slice up to the depth either way.
    assert plan([3], 4, 5, fill=False) == plan([3], 4, 5, fill=True) == [1]


@pytest.mark.parametrize(("handler", "loads"), [
    ("tests.handlers.noop:handle", [2, 2, 2, 2]),  # without flush(): spread
    ("tests.handlers.flushing:handle", [8, 0, 0, 0]),  # flush(): one batch, one process
])
def test_a_small_prefetch_for_a_handler_with_flush_goes_to_one_process(handler, loads):
    """Prefetch 8 over 4 processes: with flush() each would get 2 and flush them alone (one
    write and sync of the store each); now one process gets the 8 and flushes them at once,
    up to FLUSH_BATCH. Settled, the next batch goes to one process again."""
    async def scenario():
        broker = MemoryBroker()
        pids = await broker.publish_many("jobs", [{"n": n} for n in range(24)])
        core = Core(core_config(prefetch=8, coroutines=4, handler=handler), broker)
        await core.start()
        buffer = core.arbiter.buffer
        for batch in range(3):
            await core.wait_for(lambda: buffer.outstanding == 8 and not buffer.waiting_count)
            buffer.check()
            assert [buffer.load(index) for index in range(4)] == loads, batch
            for process in core.server.living():
                process.work()
            await core.wait_for(lambda settled=8 * (batch + 1):
                                sum(broker.committed.values()) == settled)
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids)

    run(scenario())


async def core_noting_reserve_ahead():
    """A core whose prefetch (100) is full and settled, its broker given a ``reserve_ahead``
    that notes the room each settle call asks to reserve ahead (the list returned)."""
    core, broker, _ = await running_core(300, 100, 1)
    await core.wait_for(lambda: core.arbiter.buffer.outstanding == 100)
    await core.settle_down()
    asked: list[int] = []

    def reserve_ahead(room: int) -> bool:
        asked.append(room)
        return True

    core.arbiter.reserve_ahead = reserve_ahead
    return core, broker, asked


def noting_receives(broker: MemoryBroker) -> list[int]:
    """The room each of the broker's receives from now on asks for (the list returned)."""
    rooms: list[int] = []
    receive = broker.receive

    async def receive_noted(room: int, timeout: float):  # noqa: ASYNC109 - as Broker.receive
        rooms.append(room)
        return await receive(room, timeout)

    broker.receive = receive_noted  # type: ignore[method-assign]
    return rooms


def test_a_settle_call_that_makes_room_for_a_receive_asks_the_broker_to_reserve_it_ahead():
    """A broker with ``reserve_ahead`` reserves, in a settle call's write, the room that
    call frees, when the receive loop sleeps waiting for it: asked for exactly the room the
    next receive takes (never more), and only when a receive will be due."""
    async def scenario():
        core, broker, asked = await core_noting_reserve_ahead()
        arbiter = core.arbiter
        rooms = noting_receives(broker)

        async def finish(jobs: int) -> None:
            await finish_settled(core, broker, jobs)

        await finish(24)  # less than a quarter free: no receive due, nothing reserved
        assert asked == [] and rooms == []
        await finish(1)  # a quarter: the receive after it takes what was reserved
        await core.wait_for(lambda: arbiter.buffer.outstanding == 100)
        assert asked == [25] and rooms == [25]
        assert await core.stop(work=False) == exits.OK

    run(scenario())


def test_a_settle_call_during_a_receive_reserves_ahead_only_what_that_receive_left():
    """The receive under way may take all the room free now: a settle call during it asks
    to reserve ahead only the room it frees beyond that, and the next receive waits for the
    call, then asks for exactly that."""
    async def scenario():
        core, broker, asked = await core_noting_reserve_ahead()
        arbiter = core.arbiter
        rooms: list[int] = []
        gate = asyncio.Event()
        receive = broker.receive

        async def receive_held(room: int, timeout: float):  # noqa: ASYNC109 - as Broker.receive
            rooms.append(room)
            await gate.wait()
            return await receive(room, timeout)

        broker.receive = receive_held  # type: ignore[method-assign]

        async def finish(jobs: int) -> None:
            await finish_settled(core, broker, jobs)

        await finish(30)  # the loop slept: the room freed, reserved ahead, then received
        await core.wait_for(lambda: arbiter.receiving == 30)
        await finish(30)  # while that receive is under way: only the 30 it did not ask for
        assert asked == [30, 30]
        gate.set()
        await core.wait_for(lambda: arbiter.buffer.outstanding == 100)
        assert rooms == [30, 30]
        assert await core.stop(work=False) == exits.OK

    run(scenario())


def test_after_a_settle_call_that_reserved_ahead_its_claim_goes_before_the_next_settle_call():
    """The receive that claims what a settle call reserved ahead runs as soon as the call
    returns, before the outcomes that completed during the call are read and settled: Redis
    then runs the claim while the supervisor builds the next settle call, where the claim
    used to wait behind it."""
    async def scenario():
        core, broker, asked = await core_noting_reserve_ahead()
        calls: list[str] = []
        held = asyncio.Event()
        settle, receive = broker.settle, broker.receive

        async def settle_held(settlements, on_result=None):
            calls.append(f"settle {len(settlements)}")
            await held.wait()
            return await settle(settlements, on_result)

        async def receive_noted(room: int, timeout: float):  # noqa: ASYNC109 - as Broker.receive
            calls.append(f"receive {room}")
            return await receive(room, timeout)

        broker.settle = settle_held  # type: ignore[method-assign]
        broker.receive = receive_noted  # type: ignore[method-assign]
        handler = core.process(0)

        def finish(jobs: int) -> None:
            for _ in range(jobs):
                handler.start_next()
                handler.finish()

        finish(25)  # a quarter of prefetch: its settle call reserves that room ahead
        await core.wait_for(lambda: calls == ["settle 25"])
        assert asked == [25]
        finish(5)  # completed while the call is under way
        await core.settle_down()
        held.set()
        await core.wait_for(lambda: len(calls) == 3)
        assert calls == ["settle 25", "receive 25", "settle 5"]
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 95)
        assert await core.stop(work=False) == exits.OK

    run(scenario())


def test_a_settle_call_that_reserved_ahead_costs_no_extra_turn_when_no_outcome_waits():
    """At prefetch 1 the one job was in the call: nothing waits to be read after it, so the
    settle loop does not give the receive loop a turn of its own (it would cost one turn of
    the event loop per job); it waits for the next completion, which does the same."""
    async def scenario():
        core, broker, _ = await running_core(10, 1, 1)
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 1)
        core.arbiter.reserve_ahead = lambda room: True
        yields = 0
        sleep = asyncio.sleep

        async def counted(delay: float, *args):
            nonlocal yields
            if delay == 0 and sys._getframe(1).f_code.co_name == "settle_loop":
                yields += 1
            return await sleep(delay, *args)

        asyncio.sleep = counted  # type: ignore[assignment]
        try:
            for jobs in range(1, 4):
                await finish_settled(core, broker, 1)
                await core.wait_for(lambda: core.arbiter.buffer.outstanding == 1)
                assert sum(broker.committed.values()) == jobs
        finally:
            asyncio.sleep = sleep  # type: ignore[assignment]
        assert yields == 0
        assert await core.stop(work=False) == exits.OK

    run(scenario())


@pytest.mark.parametrize(("prefetch", "reserves_ahead", "limit"), [
    (100, True, -(-100 // BATCHES_IN_FLIGHT)),
    (1, True, 1),
    (2, True, 1),
    (8, True, -(-8 // BATCHES_IN_FLIGHT)),
    (5000, True, MAX_BATCH),
    (100, False, MAX_BATCH),
    (1, False, MAX_BATCH),
])
def test_a_receive_takes_a_share_of_prefetch_where_settle_calls_reserve_ahead(
    prefetch, reserves_ahead, limit,
):
    assert batch_limit(prefetch, reserves_ahead) == limit


def test_a_broker_that_reserves_ahead_is_received_from_in_batches_no_larger_than_the_limit():
    """Filling prefetch 100 from a broker whose settle calls reserve ahead: every receive asks
    for at most ``batch_limit`` (the next receive takes the rest)."""
    async def scenario():
        broker = MemoryBroker()
        broker.reserves_ahead = True  # type: ignore[attr-defined]
        rooms = noting_receives(broker)
        core, broker, _ = await running_core(300, 100, 1, broker)
        limit = batch_limit(100, True)
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 100)
        assert rooms[:2] == [limit, 100 - limit]
        for _ in range(3):
            await finish_settled(core, broker, 50)
            await core.wait_for(lambda: core.arbiter.buffer.outstanding == 100)
        assert max(rooms) == limit
        assert await core.stop(work=False) == exits.OK

    run(scenario())


def test_at_prefetch_1_the_receive_loop_wakes_only_when_a_receive_is_due():
    """Every read of a job's outcomes (its start, its end) and its settlement each woke the
    receive loop, which found prefetch still full until the settlement: a turn of the event
    loop per wake-up, per job at prefetch 1. Now it sleeps once per job (prefetch full after
    the receive) and wakes once (the settlement freed the room)."""
    async def scenario():
        core, broker, pids = await running_core(40, 1, 1)
        arbiter = core.arbiter
        due = arbiter.receive_due
        answers: list[bool] = []

        def counted() -> bool:
            answers.append(due())
            return answers[-1]

        arbiter.receive_due = counted
        handler = core.process(0)
        async with asyncio.timeout(10):
            while len(broker.committed) < len(pids):
                handler.start_next()
                await core.settle_down(2)  # the start is read on its own
                handler.finish()
                await core.settle_down(2)
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids)
        assert answers.count(False) <= len(pids) + 2, answers.count(False)

    run(scenario())


@pytest.mark.slow
def test_handlers_about_to_run_dry_are_refilled_whatever_the_room():
    async def scenario():
        core, _, _ = await running_core(150, 100, 1)
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 100)
        handler = core.process(0)
        for _ in range(100):
            handler.start_next()  # all started (waiting for flush(), say)
        handler.finish()
        # One free, 99 running, none left to start: without a refill the handler would idle.
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: buffer.unstarted() == 1 and buffer.outstanding == 100)
        assert await core.stop(work=False) == exits.OK

    run(scenario())


def test_a_dead_handler_blames_its_newest_delivery_and_reruns_the_rest():
    async def scenario():
        broker = MemoryBroker(max_attempts=1)  # a blamed delivery is dead at once
        pids = await broker.publish_many("jobs", [{"n": n} for n in range(6)])
        core = Core(core_config(prefetch=6, coroutines=1), broker)
        await core.start()
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 6)
        first = core.process(0)
        first.start_next()
        first.start_next()  # plain handlers run one at a time: the first one had returned
        await core.wait_for(lambda: len(core.arbiter.buffer.running_in(0)) == 2)
        blamed_pid = core.arbiter.buffer.running_in(0)[-1].delivery.pid
        first.die(-signal.SIGKILL)
        await core.wait_for(lambda: core.server.spawned == 2 and core.process(0).alive)
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 5)
        core.arbiter.buffer.check()
        assert core.process(0).work() == 5
        await core.wait_for(lambda: len(broker.committed) == 5)
        assert await core.stop() == exits.OK
        assert broker.dead == [blamed_pid] and pids[1] == blamed_pid
        assert set(broker.committed) == set(pids) - {blamed_pid}

    run(scenario())


def test_a_plain_handler_killed_mid_job_is_blamed_by_its_mark_without_a_start_record():
    async def scenario():
        broker = MemoryBroker(max_attempts=1)  # a blamed delivery is dead at once
        pids = await broker.publish_many("jobs", [{"n": n} for n in range(3)])
        core = Core(core_config(prefetch=3, coroutines=1), broker)
        await core.start()
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 3)
        first = core.process(0)
        first.start_next()
        first.finish()  # the first returned
        first.start_next()  # the second is in its handler
        first.read()  # the third was read from the ring, not started
        await core.wait_for(lambda: len(broker.committed) == 1)
        first.die(-signal.SIGKILL)
        await core.wait_for(lambda: core.server.spawned == 2 and core.process(0).alive)
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 1)
        core.arbiter.buffer.check()
        assert first.posted == ["DONE"]  # one record per delivery, no STARTED
        assert core.process(0).work() == 1
        await core.wait_for(lambda: len(broker.committed) == 2)
        assert await core.stop() == exits.OK
        assert broker.dead == [pids[1]]
        assert set(broker.committed) == {pids[0], pids[2]}  # the third ran again: not blamed

    run(scenario())


def test_a_plain_handler_that_died_between_jobs_blames_nothing():
    async def scenario():
        broker = MemoryBroker(max_attempts=1)
        pids = await broker.publish_many("jobs", [{"n": n} for n in range(2)])
        core = Core(core_config(prefetch=2, coroutines=1), broker)
        await core.start()
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 2)
        first = core.process(0)
        first.start_next()
        first.finish()  # returned; its mark still names it, the second was never started
        first.die(-signal.SIGKILL)
        await core.wait_for(lambda: core.server.spawned == 2 and core.process(0).alive)
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 1)
        assert core.process(0).work() == 1
        await core.wait_for(lambda: len(broker.committed) == 2)
        assert await core.stop() == exits.OK
        assert broker.dead == [] and sorted(broker.committed) == sorted(pids)

    run(scenario())


def test_a_broker_refusing_settlements_for_a_while_loses_nothing():
    async def scenario():
        broker = MemoryBroker()
        broker.faults.settle_errors = 3
        core, broker, pids = await running_core(30, 10, 2, broker)
        async with asyncio.timeout(10):
            while len(broker.committed) < 30:
                for process in core.server.living():
                    process.work()
                await asyncio.sleep(0.005)
                core.arbiter.buffer.check()
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids)
        assert broker.calls["settle"] >= 4

    run(scenario())


def test_a_stop_releases_what_never_started_with_its_attempts_unchanged():
    async def scenario():
        core, broker, pids = await running_core(30, 10, 2)
        await core.wait_for(lambda: core.arbiter.buffer.outstanding == 10)
        assert await core.stop(work=False) == exits.OK  # the handlers skip what they hold
        assert sorted(message.pid for message in broker.ready) == sorted(pids)
        assert not broker.committed and not broker.owned
        assert all(message.attempts == 0 for message in broker.ready)

    run(scenario())


@pytest.mark.slow
def test_handlers_still_running_at_the_deadline_are_killed_and_their_work_recovered():
    async def scenario():
        core, broker, _ = await running_core(4, 4, 2)
        await core.wait_for(lambda: core.arbiter.buffer.load(0) + core.arbiter.buffer.load(1) == 4)
        for process in core.server.living():
            process.start_next()  # and never return
        await core.wait_for(lambda: core.arbiter.buffer.busy() == (2, 2))
        assert await core.stop(work=False) == exits.OK
        assert core.server.spawned == 2  # nobody replaced at a stop
        # The two started were handed to recovery (an attempt each); the two queued released.
        assert sorted(message.attempts for message in broker.ready) == [0, 0, 1, 1]
        assert not broker.owned and broker.calls["abandon"] == 1

    run(scenario())


@pytest.mark.slow
def test_a_handler_answering_out_of_order_stops_the_supervisor_for_a_restart():
    async def scenario():
        core, broker, _ = await running_core(2, 2, 1)
        await core.wait_for(lambda: core.arbiter.buffer.load(0) == 2)
        core.process(0).post(protocol.encode_started(2))  # the ring holds 1 first
        assert await core.stop() == exits.BROKEN
        assert not broker.owned and len(broker.ready) == 2

    run(scenario())


# -- any order of events -------------------------------------------------------------------------

HANDLERS = 2
PREFETCH = 6

actions = st.one_of(
    st.tuples(st.just("publish"), st.integers(1, 8)),
    st.tuples(st.just("start"), st.integers(0, HANDLERS - 1)),
    # a start in two halves, a take-back between them possible (worker.protocol)
    st.tuples(st.just("reach"), st.integers(0, HANDLERS - 1)),
    st.tuples(st.just("decide"), st.integers(0, HANDLERS - 1)),
    # the dispatcher's clock moves: a process that started nothing since is stalled
    st.tuples(st.just("stall"), st.sampled_from([0.01, 1.0])),
    st.tuples(st.just("finish"), st.integers(0, HANDLERS - 1), st.booleans(), st.integers(0, 3)),
    st.tuples(st.just("hold"), st.integers(0, HANDLERS - 1), st.integers(0, 3)),
    st.tuples(st.just("die"), st.integers(0, HANDLERS - 1), st.sampled_from([-9, -15, 1, 0])),
    st.tuples(st.just("settle_error"), st.integers(1, 2)),
    st.tuples(st.just("unapplied"), st.integers(1, 3)),
    st.tuples(st.just("uncertain_applied"), st.integers(1, 3)),
    st.tuples(st.just("uncertain_unapplied"), st.integers(1, 3)),
    st.tuples(st.just("receive_error"), st.integers(1, 2)),
    st.tuples(st.just("recover"), st.integers(0, PREFETCH)),
    st.tuples(st.just("turns"), st.integers(1, 30)),
)


async def play(steps: list[tuple], work_at_stop: bool, handler: str) -> None:
    broker = MemoryBroker(max_attempts=3)
    tasks = PREFETCH // HANDLERS if handler.endswith("aio:handle") else 1
    config = core_config(PREFETCH, HANDLERS, shutdown_deadline=0.3, handler=handler,
                         tasks_per_process=tasks)
    core = Core(config, broker)
    published: list[str] = []
    await core.start()
    buffer = core.arbiter.buffer
    for step in steps:
        kind, *args = step
        acts = kind in ("start", "reach", "decide", "finish", "hold", "die")
        process = core.server.processes.get(args[0]) if acts else None
        if kind == "publish":
            published += await broker.publish_many("jobs", [{"n": n} for n in range(args[0])])
        elif kind == "start" and process:
            process.start_next()
        elif kind == "reach" and process:
            process.reach()
        elif kind == "decide" and process:
            process.decide()
        elif kind == "stall":
            core.advance(args[0])
        elif kind == "finish" and process:
            process.finish(ok=args[1], which=args[2])
        elif kind == "hold" and process and core.server.concurrent:  # plain ones never do
            process.hold(which=args[1])
        elif kind == "die" and process:
            process.die(args[1])
        elif kind == "recover" and broker.owned:
            broker.recover(sorted(broker.owned)[args[0] % len(broker.owned)])
        elif kind == "turns":
            await core.settle_down(args[0])
        elif kind in ("settle_error", "receive_error"):
            setattr(broker.faults, kind + "s", args[0])
        elif kind in ("unapplied", "uncertain_applied", "uncertain_unapplied"):
            setattr(broker.faults, kind, args[0])
        await core.settle_down(3)
        buffer.check()
        assert buffer.outstanding <= PREFETCH
    code = await core.stop(work=work_at_stop)
    note(f"exit {code}, broker calls {dict(broker.calls)}")
    assert code == exits.OK
    # Nothing lost: every message is finished for good, or back in the queue, never held.
    assert not broker.owned
    assert set(published) == broker.settled | {message.pid for message in broker.ready}
    # What the broker redelivers is only what the supervisor gave up (released, recovered).
    assert all(broker.runs[pid] >= 1 for pid in broker.settled)


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(steps=st.lists(actions, max_size=40), work_at_stop=st.booleans())
@pytest.mark.parametrize("handler", ["tests.handlers.noop:handle", "tests.handlers.aio:handle",
                                     "tests.handlers.flushing:handle"])
def test_any_order_of_outcomes_deaths_faults_and_a_stop_keeps_the_accounting(
    handler, steps, work_at_stop
):
    """Plain handlers (one delivery at a time) and async ones (several, reporting HELD);
    with flush(), dispatch fills one process before the next instead of spreading."""
    asyncio.run(play(steps, work_at_stop, handler))


def test_the_first_renewal_comes_before_the_first_receive():
    """On Redis the first renewal registers the supervisor's owner-token prefix: a delivery
    claimed before it would not be known for ours, and a kill right then would leave it to
    queue 5's rule (recovery_age, 25 h by default) instead of the next sweep."""

    class Ordered(MemoryBroker):
        def __init__(self) -> None:
            super().__init__()
            self.order: list[str] = []

        async def extend(self, deliveries):
            self.order.append("extend")
            await asyncio.sleep(0.05)  # a slow first renewal must still come first
            return await super().extend(deliveries)

        async def receive(self, max_messages, block_timeout):
            self.order.append("receive")
            return await super().receive(max_messages, block_timeout)

    async def scenario():
        broker = Ordered()
        core, _, _ = await running_core(3, 3, 1, broker)
        await core.wait_for(lambda: "receive" in broker.order)
        assert broker.order[0] == "extend"
        assert await core.stop() == exits.OK

    run(scenario())
