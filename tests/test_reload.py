"""SIGHUP's reload of the handler code in the supervisor's core (supervisor.reload): processes
are replaced only once the new code imported and has the shape the job was set up for, one
import at a time, never during a stop. The played fork server (tests/inprocess.py) ends
each import as the test says; tests/test_sighup.py does it all with real processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

import pytest

from broker.memory import MemoryBroker
from supervisor import exits
from tests.handlers import noop
from tests.inprocess import Core, core_config
from worker.handler import Shape

#: The played handler: tests.handlers.noop, a plain def without hooks.
PLAIN = Shape("tests.handlers.noop:handle", False, (), "/srv/jobs/noop.py", 0.0)


def run(coroutine):
    return asyncio.run(coroutine)


async def running(messages: int = 4) -> tuple[Core, MemoryBroker, list[str]]:
    """Two played handler processes holding ``messages`` deliveries, none finished."""
    broker = MemoryBroker()
    pids = await broker.publish_many("jobs", [{"n": n} for n in range(messages)])
    core = Core(core_config(prefetch=max(messages, 2), coroutines=2), broker)
    await core.start()
    await core.wait_for(lambda: core.arbiter.buffer.load(0) + core.arbiter.buffer.load(1)
                        == messages)
    return core, broker, pids


def retiring(core: Core) -> list[bool]:
    return [place.retiring for place in core.places]


@pytest.mark.slow
def test_processes_are_replaced_after_their_work_once_the_import_succeeded(caplog):
    async def scenario():
        core, broker, pids = await running()
        old = [core.process(0), core.process(1)]
        core.arbiter.pool.handle_reload_signal()
        assert core.server.loads == [2]
        await core.settle_down()
        assert retiring(core) == [False, False]  # importing: the processes keep consuming
        core.server.loaded(2, dataclasses.replace(PLAIN, modified=1e9, version="2.1").encode())
        await core.wait_for(lambda: retiring(core) == [True, True])
        assert core.server.adopted == [2]
        for process in old:  # each finishes what it holds, then exits when asked
            process.work()
        await core.wait_for(lambda: all(process.exit_if_asked() or not process.alive
                                        for process in old))
        await core.wait_for(lambda: core.server.spawned == 4 and len(core.server.living()) == 2)
        assert {core.server.generation_of[p.pid] for p in core.server.living()} == {2}
        await core.wait_for(lambda: len(broker.committed) == len(pids))
        assert await core.stop() == exits.OK

    with caplog.at_level(logging.INFO, logger="supervisor"):
        run(scenario())
    assert ("handler reloaded: tests.handlers.noop:handle from /srv/jobs/noop.py (modified "
            "2001-09-09 01:46:40 UTC, version 2.1); replacing 2 handler processes, each after "
            "its current work") in caplog.messages


@pytest.mark.slow
@pytest.mark.parametrize(("change", "reason"), [
    (None, "handler reload failed: SyntaxError: invalid syntax (noop.py, line 3)"),
    ({"is_async": True}, "is now an async def (it was a plain def)"),
    ({"hooks": ("on_success",)}, "now defines on_success(), which this job was started "
                                 "without"),
    ({"hooks": ("flush",)}, "now defines flush(), which this job was started without"),
])
def test_a_failed_or_refused_reload_keeps_every_process(caplog, change, reason):
    async def scenario() -> str:
        core, broker, pids = await running()
        running_code = core.arbiter.pool.code.source()
        core.arbiter.pool.handle_reload_signal()
        if change is None:
            core.server.load_failed(2, "SyntaxError: invalid syntax (noop.py, line 3)")
        else:
            core.server.loaded(2, dataclasses.replace(PLAIN, **change).encode())
        await core.wait_for(lambda: core.arbiter.pool.code.loading is None)
        await core.settle_down()
        assert retiring(core) == [False, False] and core.server.adopted == []
        assert core.server.discarded == ([] if change is None else [2])
        for process in core.server.living():
            process.work()
        await core.wait_for(lambda: len(broker.committed) == len(pids))
        assert core.server.spawned == 2  # nothing was replaced
        core.arbiter.pool.handle_reload_signal()  # the next SIGHUP tries again
        assert core.server.loads == [2, 3]
        assert await core.stop() == exits.OK
        return running_code

    with caplog.at_level(logging.INFO, logger="supervisor"):
        running_code = run(scenario())
    [line] = [m for m in caplog.messages if m.startswith("handler reload")]
    assert reason in line
    assert line.endswith("; the handler processes keep running the code loaded before: "
                         f"{running_code}")
    assert running_code.startswith(f"tests.handlers.noop:handle from {noop.__file__} (modified ")


def test_init_and_on_error_may_come_and_go():
    assert PLAIN.change_problem(dataclasses.replace(PLAIN, hooks=("init", "on_error"))) is None
    with_hooks = dataclasses.replace(PLAIN, hooks=("init", "on_error"))
    assert with_hooks.change_problem(PLAIN) is None
    flushing = dataclasses.replace(PLAIN, hooks=("flush",))
    assert "no longer defines flush(), which this job was started with" in (
        flushing.change_problem(PLAIN) or "")


@pytest.mark.slow
def test_a_sighup_during_an_import_asks_for_one_more_after_it():
    async def scenario():
        core, _, _ = await running()
        core.arbiter.pool.handle_reload_signal()
        core.arbiter.pool.handle_reload_signal()
        core.arbiter.pool.handle_reload_signal()
        assert core.server.loads == [2]  # one import at a time
        core.server.loaded(2, PLAIN.encode())
        await core.wait_for(lambda: core.server.loads == [2, 3])  # the SIGHUPs since: one
        assert core.server.adopted == [2]
        core.server.loaded(3, PLAIN.encode())
        await core.wait_for(lambda: core.server.adopted == [2, 3])
        await core.settle_down()
        assert core.server.loads == [2, 3]
        assert await core.stop() == exits.OK

    run(scenario())


@pytest.mark.slow
def test_a_process_forked_from_the_old_code_during_the_import_is_replaced_too():
    async def scenario():
        core, _, _ = await running(0)
        core.arbiter.pool.handle_reload_signal()
        # Its replacement is asked of the old code; the import's success is read before
        # the replacement's start.
        core.process(0).die(-signal.SIGKILL)
        core.server.loaded(2, PLAIN.encode())
        await core.wait_for(lambda: core.server.adopted == [2])
        await core.wait_for(lambda: core.server.spawned == 3)
        late = core.process(0)
        assert core.server.generation_of[late.pid] == 1
        await core.wait_for(lambda: core.places[0].pid == late.pid)
        assert core.places[0].retiring  # no work for it: it is replaced too

        def old_ones_exit() -> bool:
            server = core.server
            old = [p for p in server.living() if server.generation_of[p.pid] == 1]
            return all([process.exit_if_asked() for process in old])

        await core.wait_for(old_ones_exit)
        await core.wait_for(lambda: len(core.server.living()) == 2)
        assert {core.server.generation_of[p.pid] for p in core.server.living()} == {2}
        assert await core.stop() == exits.OK

    run(scenario())


def test_no_reload_during_a_stop(caplog):
    async def scenario():
        core, _, _ = await running(0)
        core.arbiter.pool.handle_reload_signal()
        core.arbiter.handle_stop_signal(signal.SIGTERM)
        core.arbiter.pool.handle_reload_signal()  # ignored
        core.server.loaded(2, PLAIN.encode())  # the import under way ends during the stop
        assert await core.stop() == exits.OK
        assert core.server.loads == [2]
        assert core.server.discarded == [2] and core.server.adopted == []

    with caplog.at_level(logging.INFO, logger="supervisor"):
        run(scenario())
    assert "SIGHUP received while stopping: ignored" in caplog.messages
    assert "the reload's import ended during the stop: not used" in caplog.messages


def test_the_report_of_any_handler_fits_one_atomic_pipe_write():
    from worker.forkserver import DETAIL_LIMIT

    strange = "\udc80é" * 5000  # a path undecodable as UTF-8, and long
    shape = Shape("é" * 5000 + ":handle", True, ("init", "flush", "on_success", "on_error"),
                  "/srv/" + strange + ".py", 1e9, strange)
    report = shape.encode()
    assert len(report.encode()) <= DETAIL_LIMIT
    decoded = Shape.decode(report)
    assert decoded.file is not None and decoded.file.startswith("/srv/\udc80é")
    assert decoded.file.endswith("é.py") and "..." in decoded.file
    assert (decoded.is_async, decoded.hooks) == (True, shape.hooks)
