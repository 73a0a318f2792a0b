"""The main function of a handler process: prepare the process, pick the loop, run it.

The handler comes loaded (``worker.handler.load``, by the handler server that forked this
process: worker.forkserver): the process inherits it through fork and imports nothing more.
``worker.base`` holds what both loops share; ``worker.sync`` runs a plain ``def`` handler
one delivery at a time, ``worker.aio`` an ``async def`` one on an event loop.
"""

from __future__ import annotations

from typing import NoReturn

from worker.aio import AsyncRunner
from worker.base import Runner, prepare_process
from worker.handler import Handler
from worker.ring import Ring
from worker.sync import SyncRunner


def run(
    place: int,
    to_child: Ring,
    to_parent: Ring,
    handler: Handler,
    *,
    flush_every: int = 100,
    queue: str = "",
    tasks: int = 1,
    timeout: float = 0.0,
    alone: bool = False,
) -> NoReturn:
    """Called in the forked child. An ``async def`` handler runs up to ``tasks`` deliveries
    at once, each cancelled after ``timeout`` seconds (0: never); a plain one runs one at
    a time, and its timeout is the supervisor's kill. ``alone``: the job's only handler
    process, from which nothing is ever taken back (it reads no cut: Runner._taken_back)."""
    parent = prepare_process(place)
    runner: Runner
    if handler.is_async:
        runner = AsyncRunner(place, to_child, to_parent, handler, parent=parent, queue=queue,
                             flush_every=flush_every, alone=alone, tasks=tasks, timeout=timeout)
    else:
        runner = SyncRunner(place, to_child, to_parent, handler, parent=parent, queue=queue,
                            flush_every=flush_every, alone=alone)
    try:
        runner.run()
    except BaseException as error:  # what a handler raised that is not an Exception
        runner.escaped(error)
