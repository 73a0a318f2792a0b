"""supervisor.eager: a coroutine's first step in the caller's turn, the rest as a task."""

from __future__ import annotations

import asyncio

import pytest

from supervisor import eager


async def test_the_first_step_runs_at_once_and_the_task_the_rest():
    steps: list[str] = []
    reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def call() -> None:
        steps.append("sent")
        steps.append(await reply)
        await asyncio.sleep(0)  # a bare yield, as the task meets it
        steps.append("done")

    task = eager.start(call())
    assert steps == ["sent"] and task is not None  # before any turn of the loop
    reply.set_result("replied")
    await task
    assert steps == ["sent", "replied", "done"]


async def test_a_cancel_reaches_the_coroutine_where_it_waits():
    reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    ended: list[str] = []

    async def call() -> None:
        try:
            await reply
        except asyncio.CancelledError:
            ended.append("cancelled where it waited")
            raise

    task = eager.start(call())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["cancelled where it waited"] and reply.cancelled()


async def test_a_cancel_the_coroutine_handles_lets_it_go_on():
    first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    second: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def call() -> str:
        try:
            await first
        except asyncio.CancelledError:
            return await second  # it keeps going, as a plain task's coroutine may
        return "not cancelled"

    task = eager.start(call())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    second.set_result("after the cancel")
    assert await task == "after the cancel"


async def test_what_ends_or_fails_in_its_first_step_needs_no_task():
    async def quick() -> None:
        return None

    async def broken() -> None:
        raise RuntimeError("at once")

    assert eager.start(quick()) is None
    with pytest.raises(RuntimeError, match="at once"):
        eager.start(broken())
