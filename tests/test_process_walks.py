"""Process walks treat a process that ends mid-walk as gone (issue 39.6).

A clean-clone CI run failed ``test_bench_stop`` with ``psutil.ZombieProcess`` from the
``cmdline()`` of a child that exited between ``children()`` and the read. Here that moment
is made to last: a process that lists a child and then reads it, with the child already a
zombie (exited, its parent not reaping it) or already reaped. The product's walks
(``drain`` and ``status`` through ``ops.drain.find_supervisors``, the dashboard's process
view ``dashboard.local.describe``) and the support helpers the tests and benchmarks walk
with must all say "gone" and go on.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from supervisor.dashboard import local
from supervisor.ops import drain
from support import processes

QUEUE = "walks"

#: A stand-in for a supervisor: titled as one, with a child that exits at once and is never
#: reaped (a zombie until this process ends) and a live "handler" child; prints their pids.
FAKE_SUPERVISOR = textwrap.dedent("""
    import os, sys, time
    import setproctitle
    queue = sys.argv[1]
    setproctitle.setproctitle(f"queue-supervisor: {queue} running [fake]")
    zombie = os.fork()
    if zombie == 0:
        os._exit(0)
    handler = os.fork()
    if handler == 0:
        setproctitle.setproctitle(f"queue-supervisor: {queue} handler 0 idle")
        time.sleep(600)
        os._exit(0)
    print(zombie, handler, flush=True)
    time.sleep(600)
""")


def wait_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"{pid} did not exit"
        time.sleep(0.05)


@pytest.fixture
def fake_supervisor():
    process = subprocess.Popen([sys.executable, "-c", FAKE_SUPERVISOR, QUEUE],
                               stdout=subprocess.PIPE, text=True)
    handler = process.pid  # until the real one is known
    try:
        assert process.stdout is not None
        zombie, handler = map(int, process.stdout.readline().split())
        wait_zombie(zombie)
        deadline = time.monotonic() + 10
        while "handler 0 idle" not in processes.title(psutil.Process(handler)):
            assert time.monotonic() < deadline, "the handler never took its title"
            time.sleep(0.05)
        yield process, zombie, handler
    finally:
        for pid in (handler, process.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.kill(psutil.Process(pid))
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_a_zombie_listed_in_a_walk_is_read_as_gone(fake_supervisor):
    """The flake itself: the zombie is listed with the others, and reading its command line
    raises; the helpers read it as gone."""
    parent, zombie, handler = fake_supervisor
    listed = {process.pid: process for process in processes.family(parent.pid)}
    assert set(listed) == {parent.pid, zombie, handler}
    with pytest.raises(psutil.ZombieProcess):
        listed[zombie].cmdline()
    assert processes.title(listed[zombie]) == ""
    assert processes.gone(listed[zombie]) and not processes.gone(listed[handler])
    # (setproctitle pads a title with spaces to the length of the original command line)
    assert processes.title(listed[handler]).strip() == f"queue-supervisor: {QUEUE} handler 0 idle"
    processes.kill(listed[zombie])  # a signal to a zombie: nothing to do, no error


def test_the_product_walks_skip_a_child_that_ended(fake_supervisor):
    """``drain``/``status`` find the supervisor, the dashboard's process view lists its live
    handler, a zombie beside it notwithstanding; then the handler ends (killed, a zombie)
    after the walk listed it and before it read it: the view goes on without it."""
    parent, _zombie, handler = fake_supervisor
    record = f"{socket.gethostname()} {parent.pid}"
    found, elsewhere = drain.find_supervisors(QUEUE, [record, "elsewhere 1"])
    assert [process.pid for process in found] == [parent.pid] and elsewhere == ["elsewhere 1"]
    seen = local.describe(QUEUE, record)
    assert seen is not None and [h.strip() for h in seen["handlers"]] == ["handler 0 idle"]
    assert seen["title"].strip() == "running [fake]"

    listed = processes.family(parent.pid)
    processes.kill(psutil.Process(handler))
    wait_zombie(handler)
    assert [processes.title(p) for p in listed if p.pid == handler] == [""]
    seen = local.describe(QUEUE, record)
    assert seen is not None and seen["handlers"] == []


def test_a_process_reaped_after_the_listing_is_gone_too():
    """NoSuchProcess rather than a zombie: the child was listed, then exited and was reaped
    before it was read."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        [listed] = [p for p in psutil.Process().children() if p.pid == child.pid]
    finally:
        child.kill()
        child.wait(10)
    with pytest.raises(psutil.NoSuchProcess):
        listed.cmdline()
    assert processes.title(listed) == "" and processes.name(listed) == ""
    assert processes.gone(listed)
    processes.kill(listed)
    assert processes.family(child.pid) == []
    assert drain.find_supervisors(QUEUE, [f"{socket.gethostname()} {child.pid}"]) == ([], [])
