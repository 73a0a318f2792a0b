"""Fair hand-out in the supervisor's core (supervisor.dispatch), with played processes.

A process that starts nothing for ``stall_after`` while holding deliveries it has not
started gives them back, through the real rings' cut and mark (worker.protocol, "Taking
back"), and another process runs them; nothing is lost, nothing runs twice, the ledger's
``check()`` holds after every step. The dispatcher's clock only moves when a test says so
(``Core.advance``), so "stalled" is the test's decision, never the machine's speed.
The real processes, racing for real, are in tests/test_fair_dispatch_e2e.py.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from broker.memory import MemoryBroker
from supervisor import dispatch, exits
from supervisor.buffer import State
from supervisor.dispatch import RING_BUDGET, STALL_JOBS, STALL_MIN, Pace, plan
from tests.inprocess import Core, core_config

NOOP, AIO, FLUSHING = ("tests.handlers.noop:handle", "tests.handlers.aio:handle",
                       "tests.handlers.flushing:handle")


def run(coroutine):
    return asyncio.run(coroutine)


async def fair_core(
    messages: int, prefetch: int, coroutines: int, handler: str = NOOP, tasks: int = 1
) -> tuple[Core, MemoryBroker, list[str]]:
    broker = MemoryBroker()
    pids = await broker.publish_many("jobs", [{"n": n} for n in range(messages)])
    config = core_config(prefetch=prefetch, coroutines=coroutines, handler=handler,
                         tasks_per_process=tasks)
    core = Core(config, broker)
    await core.start()
    return core, broker, pids


async def two_with_five_each(messages: int = 10) -> tuple[Core, MemoryBroker, list[str]]:
    """Two plain handler processes, prefetch 10: each ring holds five once received."""
    core, broker, pids = await fair_core(messages, prefetch=10, coroutines=2)
    buffer = core.arbiter.buffer
    await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [5, 5])
    return core, broker, pids


async def stops_with_each_run_once(core: Core, broker: MemoryBroker, pids: list[str]) -> None:
    assert await core.stop() == exits.OK
    assert all(broker.runs[pid] == 1 for pid in pids)  # nothing ran twice


def ids(entries) -> list[int]:
    return [entry.id for entry in entries]


async def drain(core: Core, until, *processes) -> None:
    """Let ``processes`` run whatever they are given until ``until()`` holds."""
    async with asyncio.timeout(10):
        while not until():
            for process in processes:
                process.work()
            await core.settle_down(2)
            core.arbiter.buffer.check()


def test_a_plain_handler_stalled_on_a_long_job_gives_back_what_it_has_not_started():
    async def scenario():
        core, broker, pids = await two_with_five_each()
        buffer = core.arbiter.buffer
        slow, fast = core.process(0), core.process(1)
        slow.start_next()  # a long job: it does not return while the others run
        (long_job,) = slow.running
        behind = ids(buffer.in_state(State.QUEUED, 0))[1:]
        fast.work()  # the other runs all it has: it is idle now
        await core.settle_down()
        assert buffer.load(0) == 5  # nothing is stalled while the clock stands still
        core.advance(1.0)  # a second without a start
        await core.settle_down()
        buffer.check()
        assert ids(buffer.running_in(0)) == [long_job] and buffer.load(0) == 1
        assert ids(buffer.in_state(State.QUEUED, 1)) == behind  # in their order
        pids += await broker.publish_many("jobs", [{"n": n} for n in range(20)])
        await drain(core, lambda: len(broker.committed) == 29, fast)
        assert buffer.load(0) == 1  # stalled: it got nothing more meanwhile
        # The long job returns; the process reads its ring: the four are not its own any
        # more, it reports them withdrawn and runs none of them.
        slow.finish()
        slow.work()
        assert slow.withdrawn == behind
        await drain(core, lambda: len(broker.committed) == 30, slow, fast)
        assert await core.stop() == exits.OK
        assert set(broker.committed) == set(pids) and not broker.owned
        assert all(broker.runs[pid] == 1 for pid in pids)  # nothing ran twice
        assert core.arbiter.dispatcher.taken_back == 4
        assert core.arbiter.dispatcher.on_taken_back == core.arbiter.metrics.taken_back

    run(scenario())


def test_the_delivery_reached_as_the_cut_comes_runs_in_one_process_only():
    """The race the protocol decides: the process marks the next delivery reached, the
    supervisor writes its cut and reads the mark, the process reads the cut. The reached
    one stays with the process until it reports WITHDRAWN, then goes to the other."""
    async def scenario():
        core, broker, pids = await two_with_five_each()
        buffer, dispatcher = core.arbiter.buffer, core.arbiter.dispatcher
        slow, fast = core.process(0), core.process(1)
        slow.start_next()
        slow.finish()  # the first job was long but ends: its DONE waits to be read
        first, reached, *rest = ids(buffer.in_state(State.QUEUED, 0))
        core.now += 1.0
        dispatcher.look(core.now)  # the supervisor sees no move of its mark: stalled
        slow.reach()  # meanwhile the process reaches the next (its mark moves)
        assert dispatcher.take_back(core.places[0], core.now) == 3  # the cut, then the mark
        buffer.check()
        assert ids(buffer.running_in(0)) == [first, reached]  # reached: maybe running
        assert ids(buffer.in_state(State.WAITING)) == rest
        slow.decide()  # the process reads the cut: it starts nothing taken back
        assert slow.withdrawn == [reached] and not slow.running
        await core.settle_down()
        buffer.check()
        # Its mark moved: not stalled after all, it may be given work again (numbered past
        # the cut); what it reads of before the cut it withdraws.
        await drain(core, lambda: len(broker.committed) == 10, slow, fast)
        assert slow.withdrawn[:4] == [reached, *rest]
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def test_a_delivery_started_before_the_cut_stays_with_its_process():
    async def scenario():
        core, broker, pids = await two_with_five_each()
        buffer, dispatcher = core.arbiter.buffer, core.arbiter.dispatcher
        slow, fast = core.process(0), core.process(1)
        started, *rest = ids(buffer.in_state(State.QUEUED, 0))
        core.now += 1.0
        dispatcher.look(core.now)  # stalled as far as the supervisor saw
        slow.start_next()  # the process reached and started it before the cut was written
        assert dispatcher.take_back(core.places[0], core.now) == 4
        assert ids(buffer.running_in(0)) == [started] and slow.running == [started]
        assert ids(buffer.in_state(State.WAITING)) == rest
        slow.finish()
        await drain(core, lambda: len(broker.committed) == 10, slow, fast)
        assert slow.withdrawn[:4] == rest
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


@pytest.mark.slow
def test_an_async_process_with_every_slot_busy_gives_back_its_queue_one_with_a_free_slot_not():
    async def scenario():
        core, broker, pids = await fair_core(8, prefetch=8, coroutines=2, handler=AIO,
                                             tasks=2)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [4, 4])
        busy, other = core.process(0), core.process(1)
        busy.start_next()
        busy.start_next()  # both task slots run long jobs
        await core.settle_down()
        behind = ids(buffer.in_state(State.QUEUED, 0))
        assert len(behind) == 2 and buffer.running_count(0) == 2
        other.work()  # the other runs all it had: idle now
        await core.settle_down()
        core.advance(1.0)
        await core.settle_down()
        buffer.check()
        assert buffer.queued_count(0) == 0 and ids(buffer.in_state(State.QUEUED, 1)) == behind
        await drain(core, lambda: len(broker.committed) == 6, other)
        busy.finish()  # one slot frees: not saturated, it may take work again
        busy.work()
        assert busy.withdrawn == behind
        await drain(core, lambda: len(broker.committed) == 7, other)
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def test_an_async_process_running_long_in_one_slot_of_two_still_gets_work():
    async def scenario():
        core, broker, _ = await fair_core(4, prefetch=4, coroutines=2, handler=AIO, tasks=2)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [2, 2])
        one, other = core.process(0), core.process(1)
        one.start_next()
        one.start_next()
        one.finish(which=1)  # one slot runs long, the other is free
        other.work()
        await core.settle_down()
        core.advance(1.0)
        await broker.publish_many("jobs", [{"n": 10}, {"n": 11}])
        await core.wait_for(lambda: buffer.load(0) == 2)  # it was given more
        assert core.arbiter.dispatcher.taken_back == 0
        for process in (one, other):
            process.work()
        one.finish()
        assert await core.stop() == exits.OK

    run(scenario())


def test_a_flush_slice_whose_process_is_stalled_goes_to_another_process_in_one_slice():
    async def scenario():
        core, broker, pids = await fair_core(32, prefetch=32, coroutines=2, handler=FLUSHING)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [16, 16])
        stuck, other = core.process(0), core.process(1)
        stuck.start_next()  # the first of its slice hangs
        behind = ids(buffer.in_state(State.QUEUED, 0))[1:]
        other.work()  # its slice done: idle
        await core.settle_down()
        core.advance(1.0)
        await core.settle_down()
        buffer.check()
        # The 15 the stuck one never started: one slice, in their order, in one ring.
        assert buffer.load(0) == 1 and ids(buffer.in_state(State.QUEUED, 1)) == behind
        await drain(core, lambda: len(broker.committed) == 31, other)
        stuck.finish()
        stuck.work()
        assert stuck.withdrawn == behind
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def passing_as_the_cut_comes(monkeypatch, process, count: int) -> None:
    """The race of the cut (worker.protocol, "Taking back") at its widest: the supervisor
    stores the cut, and before it reads the mark (a loaded machine preempts it there) the
    played ``process`` reaches ``count`` deliveries of its ring, each marked before the cut
    is read, so each is withdrawn while the supervisor will read the mark as past it."""
    real = dispatch.fence

    def preempted() -> None:
        real()
        for _ in range(count):
            process.start_next()
        monkeypatch.setattr(dispatch, "fence", real)

    monkeypatch.setattr(dispatch, "fence", preempted)


def test_deliveries_withdrawn_as_the_cut_comes_wait_again_in_their_order(monkeypatch):
    """A stalled process passes its whole ring between the supervisor's cut and its read
    of the mark: nothing is taken back, everything comes back WITHDRAWN, one record each.
    They wait again in their order: put back one by one at the head of the waiting line,
    they came back reversed, the slice's head last, and a head that hangs (why the
    process looked stalled) then ran after the rest, which a handler with ``flush()``
    holds for a flush that never comes, with their room in prefetch."""
    async def scenario():
        core, broker, pids = await fair_core(10, prefetch=10, coroutines=2, handler=FLUSHING)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [10, 0])
        stalled, other = core.process(0), core.process(1)
        order = ids(buffer.in_state(State.QUEUED, 0))
        passing_as_the_cut_comes(monkeypatch, stalled, 10)
        core.advance(1.0)  # stalled as the supervisor looked; it passed them all meanwhile
        assert stalled.withdrawn == order and not stalled.running
        assert core.arbiter.dispatcher.taken_back == 0  # its mark was past them all
        await core.settle_down()
        buffer.check()
        queued = [ids(buffer.in_state(State.QUEUED, place)) for place in (0, 1)]
        assert order in queued  # one slice again, in its order
        await drain(core, lambda: len(broker.committed) == 10, stalled, other)
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def test_a_flush_slice_head_withdrawn_as_the_cut_comes_starts_a_slice_of_its_own(monkeypatch):
    """The stalled process reaches the head of its slice as the cut comes: the rest is
    taken back and handed on as a slice, the head comes back WITHDRAWN after it. It must
    not be queued behind that slice (where a head that hangs would hold the successes the
    slice keeps for ``flush()``): it goes to the process that holds nothing, here the one
    that withdrew it."""
    async def scenario():
        core, broker, pids = await fair_core(10, prefetch=10, coroutines=2, handler=FLUSHING)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [10, 0])
        stalled, other = core.process(0), core.process(1)
        head, *rest = ids(buffer.in_state(State.QUEUED, 0))
        passing_as_the_cut_comes(monkeypatch, stalled, 1)
        core.advance(1.0)  # stalled as the supervisor looked: the rest is taken back
        assert stalled.withdrawn == [head] and not stalled.running
        assert ids(buffer.in_state(State.QUEUED, 1)) == rest  # in one slice, in order
        await core.settle_down()
        buffer.check()
        assert ids(buffer.in_state(State.QUEUED, 1)) == rest  # nothing behind the slice
        assert ids(buffer.in_state(State.QUEUED, 0)) == [head]  # a slice of its own
        await drain(core, lambda: len(broker.committed) == 10, stalled, other)
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def test_a_flush_slice_head_taken_back_again_waits_for_a_process_that_holds_nothing(
    monkeypatch,
):
    """The head withdrawn as the cut came goes back to the process that withdrew it, which
    (descheduled, say) does not reach it in time and is stalled again: taken back, the head
    waits while the only other process runs its slice (not behind the successes that
    slice holds for its ``flush()``), and goes on once a process holds nothing."""
    async def scenario():
        core, broker, pids = await fair_core(10, prefetch=10, coroutines=2, handler=FLUSHING)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: [buffer.load(0), buffer.load(1)] == [10, 0])
        stalled, other = core.process(0), core.process(1)
        head, *rest = ids(buffer.in_state(State.QUEUED, 0))
        passing_as_the_cut_comes(monkeypatch, stalled, 1)
        core.advance(1.0)
        await core.settle_down()
        assert ids(buffer.in_state(State.QUEUED, 0)) == [head]
        other.start_next()  # the other runs its slice
        core.advance(1.0)  # the first has not reached the head again: taken back once more
        await core.settle_down()
        buffer.check()
        assert ids(buffer.in_state(State.WAITING)) == [head]  # waits: nobody holds nothing
        assert ids(buffer.running_in(1)) + ids(buffer.in_state(State.QUEUED, 1)) == rest
        other.finish()
        other.work()  # its slice done (and flushed): it holds nothing now
        await core.settle_down()
        queued = [ids(buffer.in_state(State.QUEUED, place)) for place in (0, 1)]
        assert sorted(queued) == [[], [head]]  # alone, in a process that held nothing
        await drain(core, lambda: len(broker.committed) == 10, stalled, other)
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def test_one_handler_process_keeps_its_ring_however_long_its_job_runs():
    async def scenario():
        core, broker, _ = await fair_core(10, prefetch=10, coroutines=1)
        buffer = core.arbiter.buffer
        await core.wait_for(lambda: buffer.load(0) == 10)
        core.process(0).start_next()
        core.advance(3600.0)
        await core.settle_down()
        assert buffer.load(0) == 10 and core.arbiter.dispatcher.taken_back == 0
        core.process(0).finish()
        await drain(core, lambda: len(broker.committed) == 10, core.process(0))
        assert await core.stop() == exits.OK

    run(scenario())


def test_a_process_killed_after_a_take_back_loses_nothing_and_runs_nothing_twice():
    async def scenario():
        core, broker, pids = await two_with_five_each()
        buffer = core.arbiter.buffer
        slow, fast = core.process(0), core.process(1)
        slow.start_next()
        (long_job,) = slow.running
        fast.work()
        await core.settle_down()
        core.advance(1.0)
        await core.settle_down()
        assert buffer.taken_back_count(0) == 4
        slow.die(-9)  # before it read the cut's deliveries: its ring goes with it
        await core.wait_for(lambda: core.process(0) is not slow)
        buffer.check()
        assert buffer.taken_back_count(0) == 0
        # The long job takes the blame (an attempt); the rest runs once, somewhere.
        await drain(core, lambda: len(broker.committed) == 10, core.process(0), fast)
        assert await core.stop() == exits.OK
        long_pid = next(pid for pid in pids if broker.runs[pid] == 2)
        assert [pid for pid in pids if broker.runs[pid] != 1] == [long_pid]
        assert not slow.withdrawn and long_job not in core.process(0).withdrawn

    run(scenario())


def test_a_stop_releases_what_comes_back_withdrawn():
    async def scenario():
        core, broker, pids = await two_with_five_each()
        dispatcher = core.arbiter.dispatcher
        slow, fast = core.process(0), core.process(1)
        slow.start_next()
        slow.finish()
        core.now += 1.0
        dispatcher.look(core.now)
        slow.reach()  # the uncertain one, reported WITHDRAWN during the stop
        dispatcher.take_back(core.places[0], core.now)
        fast.work()
        assert await core.stop() == exits.OK  # the played processes read their rings
        assert slow.withdrawn and not broker.owned
        assert set(broker.committed) | {m.pid for m in broker.ready} == set(pids)
        assert all(broker.runs[pid] <= 1 for pid in pids)

    run(scenario())


def test_rings_are_as_shallow_as_the_pace_of_jobs_asks():
    """Half-second jobs: once their pace is known a ring holds only the running one, so
    nothing waits behind a job in one process while another could run it (hand-out on
    completion); what prefetch holds beyond waits in the supervisor, for whoever is free."""
    async def scenario():
        core, _, _ = await fair_core(40, prefetch=10, coroutines=2)
        buffer, dispatcher = core.arbiter.buffer, core.arbiter.dispatcher
        await core.wait_for(lambda: buffer.outstanding == 10)
        assert dispatcher.depth() == 5  # nothing timed yet: prefetch's fair share
        for process in core.server.living():
            process.start_next()
            process.finish(seconds=0.5)
        await core.settle_down()
        assert math.isclose(dispatcher.pace.typical, 0.5)
        assert dispatcher.depth() == 1
        for _ in range(6):
            for process in core.server.living():
                process.start_next()
                process.finish(seconds=0.5)
            await core.settle_down()
            buffer.check()
        assert [buffer.load(0), buffer.load(1)] == [1, 1] and buffer.waiting_count == 8
        assert await core.stop() == exits.OK

    run(scenario())


def test_a_ring_filled_beyond_the_pace_gives_back_to_an_idle_process():
    """Filled before the pace was known (prefetch's share each), then the jobs turn out
    slow: when one process has nothing to run, the other's surplus is taken back and
    shared (the surplus one keeps what the pace allows)."""
    async def scenario():
        core, broker, pids = await two_with_five_each()
        buffer, dispatcher = core.arbiter.buffer, core.arbiter.dispatcher
        busy, idle = core.process(0), core.process(1)
        busy.start_next()
        for _ in range(5):
            idle.start_next()
            idle.finish(seconds=0.5)
        await core.settle_down()
        buffer.check()
        assert dispatcher.depth() == 1 and dispatcher.taken_back == 4
        assert buffer.load(0) == 1 and buffer.load(1) == 1  # one each, three wait
        assert buffer.waiting_count == 3
        await drain(core, lambda: len(broker.committed) == 9, idle)
        busy.finish()
        await drain(core, lambda: len(broker.committed) == 10, busy, idle)
        await stops_with_each_run_once(core, broker, pids)

    run(scenario())


def test_the_pace_keeps_its_head_among_rare_slow_jobs_and_follows_a_new_workload():
    pace, now = Pace(), 0.0
    for batch in range(100):
        now += 1.0
        pace.observe([0.5 if batch % 10 == 0 and index == 0 else 0.001 for index in range(10)],
                     now)
    assert 0.0009 < pace.typical < 0.0011  # one job in 100 took 500 times as long
    for _ in range(60):
        now += 1.0
        pace.observe([0.1], now)
    assert 0.09 < pace.typical < 0.11
    pace.observe([5.0], now + 0.001)  # within SAMPLE_EVERY of the last sample: not taken
    assert pace.typical < 0.11


def test_depth_and_stall_follow_the_pace():
    assert STALL_MIN * 1000 >= 10 and STALL_JOBS >= 2  # sane constants, not measured here
    assert RING_BUDGET < STALL_MIN


def test_plan_spreads_or_fills():
    assert plan([0, 0, 0, 0], 2, 8, fill=False) == [2, 2, 2, 2]
    assert plan([1, 0, 0, 0], 2, 5, fill=False) == [1, 2, 1, 1]
    assert plan([0, 0, 0, 0], 16, 40, fill=True) == [16, 16, 8, 0]
