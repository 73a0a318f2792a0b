"""A coroutine started in the caller's turn of the event loop, the rest of it run as a task.

``asyncio.create_task`` runs nothing until the loop's next turn, behind every callback
already queued. Python 3.12's eager tasks run the first step at once; this project runs on
3.11 too, so ``start`` does that by hand: it runs the coroutine up to its first wait, then
makes a task that waits for the same thing and goes on with the coroutine from there.
A cancel of that task reaches the coroutine where it waits, as with a plain task.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
from typing import Any


def start(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
    """Run ``coro`` now up to its first wait; the task that runs the rest, or None when it
    ended in that first step. What the first step raises is raised here."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_rest(coro, waiting))


@types.coroutine
def _rest(coro: Coroutine[Any, Any, Any], waiting: Any) -> Generator[Any, Any, Any]:
    """The task's part: wait for what the first step waited for (a future, or None for a
    bare yield), then go on with the coroutine. What the task is thrown meanwhile (a
    cancel) is thrown into the coroutine, where it waits."""
    while True:
        try:
            yield waiting
        except BaseException as error:
            try:
                waiting = coro.throw(error)
            except StopIteration as ended:
                return ended.value
            continue
        break
    return (yield from coro)
