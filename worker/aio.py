"""The handler process of an ``async def`` handler: one event loop, several deliveries at once.

The ring protocol is ``worker.base``'s, per delivery:

- Deliveries start in the order they arrived (the supervisor pairs STARTED and SKIPPED
  with its own queue by order), at most ``tasks`` at once; the rest wait here, not started.
  STARTED is on the ring before the delivery's task first runs, so before any side effect.
  One the supervisor took back while it waited here (all task slots busy) is reported
  WITHDRAWN when its turn comes, and never starts (``Runner._taken_back``).
- A success is DONE at once, or, when the module defines ``flush()``, HELD at once and DONE
  after a ``flush()`` that began after it returned has returned. One ``flush()`` runs at a
  time, beside the running handlers: what returns meanwhile goes into the next one (a group
  commit). It starts when nothing waits to start here or ``flush_every`` successes are held.
- ``timeout``: the task is cancelled and the delivery FAILED ("handler timeout"). A task that
  does not end (it blocks the loop, or swallows the cancellation) is the supervisor's to
  kill, with the process, after a grace.
- The stop request (``Ring.stop_requested``): nothing more starts; what waits here is
  SKIPPED. EXIT (the last record the supervisor sends): what came before it runs, then a
  last ``flush()``, then exit 0.

``init``, ``flush``, ``on_success`` and ``on_error`` may each be ``async def`` or plain; a
plain one runs on the loop (and blocks it while it runs). ``on_success`` and ``on_error``
calls count against ``tasks`` like handler calls.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

from broker.failure import Failure
from worker import protocol, tracebacks
from worker.base import BATCH, Runner, exit_if_orphaned, exit_process, failure_of, log
from worker.handler import Handler
from worker.message import Message
from worker.process import CHILD_BROKEN
from worker.ring import Ring

TICK = 0.1  # seconds between looks at the stop request (it comes without a wake-up)
_PARENT_CHECK_TICKS = 10  # ticks between checks that the parent is still there


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def call(function: Callable[..., Any], *args: Any) -> Any:
    """Call a hook that may be ``async def`` or plain."""
    result = function(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


class AsyncRunner(Runner):
    """The delivery loop of one handler process running an ``async def`` handler: up to
    ``tasks`` deliveries at once, each cancelled after ``timeout`` seconds (0: never)."""

    def __init__(
        self, place: int, inbox: Ring, outbox: Ring, handler: Handler, *, parent: int,
        queue: str, flush_every: int, tasks: int, timeout: float, alone: bool = False,
    ) -> None:
        super().__init__(place, inbox, outbox, handler, parent=parent, queue=queue,
                         flush_every=flush_every, alone=alone)
        self._capacity = max(1, tasks)
        self._timeout = timeout
        self._loop = _new_loop()
        asyncio.set_event_loop(self._loop)
        #: Read, not started: (delivery id, attempts, raw, plain, number in the ring).
        self._waiting: deque[tuple[int, int | None, bytes, bool, int]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()  # everything that counts against capacity
        self._handling: dict[int, asyncio.Task[Any]] = {}  # delivery id -> task in handle()
        self._jobs: dict[int, Message] = {}  # decoded, in handle(): for the title
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._late: set[int] = set()  # their timeout expired: cancelled
        self._flushing: asyncio.Task[Any] | None = None
        self._pump_scheduled = False
        self._exiting = False

    def run(self) -> NoReturn:
        """Init on the process's event loop, then serve on it until told to exit."""
        init = self._handler.init
        if init is not None:
            self._init_until_ready(lambda: self._loop.run_until_complete(call(init)))
        self._ready(f"{self._handler.spec}, up to {self._capacity} deliveries at once")
        self._loop.run_until_complete(self.serve())
        exit_process(CHILD_BROKEN)  # serve() only ends by exiting the process

    # -- the loop's callbacks ------------------------------------------------------------

    async def serve(self) -> NoReturn:
        self._loop.add_reader(self._inbox.wake_fd, self._guarded(self._on_wake))
        self._guarded(self._on_wake)()
        ticks = 0
        while True:
            await asyncio.sleep(TICK)
            ticks += 1
            if ticks % _PARENT_CHECK_TICKS == 0:
                exit_if_orphaned(self._parent)
            if self._inbox.stop_requested and self._waiting:
                self._request_pump()
            self._show_jobs()

    def _show_jobs(self) -> None:
        """The title: how many run, and the oldest (``worker.titles``); idle when none."""
        handling, known = self._handling, None
        if handling:
            oldest = next(iter(handling))
            message, began = self._jobs.get(oldest), self._began.get(oldest)
            if message is not None and began is not None:
                known = (message.pid, message.attempts,
                         time.time() - (time.monotonic() - began))
        self._title.jobs(len(handling), known, bool(self._tasks))

    def _guarded(self, callback: Callable[..., None]) -> Callable[..., None]:
        """Our own callback raising would leave deliveries without an outcome forever:
        exit instead, so the supervisor accounts for them as lost with this process."""

        def run_guarded(*args: Any) -> None:
            try:
                callback(*args)
            except Exception:
                log.exception("handler process bookkeeping failed: exiting")
                exit_process(CHILD_BROKEN)

        return run_guarded

    def _on_wake(self) -> None:
        inbox = self._inbox
        inbox.clear_wakeup()
        while True:
            records = inbox.get_many(BATCH)
            for record in records:
                self.dispatch(record)
            if not records and inbox.prepare_sleep():
                break
        self._pump()

    def deliver(
        self, delivery_id: int, attempts: int | None, raw: bytes, plain: bool = False
    ) -> None:
        # Started by _pump, in order; the number is the ring's (see Runner._taken_back).
        self._waiting.append((delivery_id, attempts, raw, plain, self._received))

    def exit_asked(self) -> None:
        self._exiting = True

    def _request_pump(self) -> None:
        """One pump per loop iteration, however many tasks ended in it (one ring write)."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop.call_soon(self._guarded(self._pump))

    def _pump(self) -> None:
        """Start what may start, flush if due, send the outcomes; exit when asked and done."""
        self._pump_scheduled = False
        waiting = self._waiting
        if self._inbox.stop_requested:
            while waiting:  # stopping: the supervisor releases these
                delivery_id, *_, number = waiting.popleft()
                if not self._taken_back(delivery_id, number):
                    self._outcomes.append(protocol.encode_skipped(delivery_id))
        while waiting and len(self._tasks) < self._capacity:
            delivery_id, attempts, raw, plain, number = waiting.popleft()
            if not self._taken_back(delivery_id, number):  # else another process runs it
                self._start(delivery_id, attempts, raw, plain)
        self._maybe_flush()
        # STARTED goes out here, before the new tasks first run (they run after we return).
        self.send(self._outcomes)
        if self._tasks:
            self._title.set_busy(True)
        if (self._exiting and not self._waiting and not self._tasks and not self._held
                and self._flushing is None):
            self._exit_done()

    # -- one delivery --------------------------------------------------------------------

    def _start(self, delivery_id: int, attempts: int | None, raw: bytes, plain: bool) -> None:
        self._outcomes.append(protocol.encode_started(delivery_id))
        self._begin(delivery_id)
        task = self._track(self._handle(delivery_id, attempts, raw, plain))
        self._handling[delivery_id] = task
        if self._timeout:
            self._timers[delivery_id] = self._loop.call_later(
                self._timeout, self._expire, delivery_id)

    def _track(self, coroutine: Any) -> asyncio.Task[Any]:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("handler process task failed", exc_info=task.exception())
            exit_process(CHILD_BROKEN)
        self._request_pump()

    def _expire(self, delivery_id: int) -> None:
        task = self._handling.get(delivery_id)
        if task is None:
            return
        log.warning("delivery %d exceeded handler_timeout %ss: cancelled", delivery_id,
                    self._timeout)
        self._late.add(delivery_id)
        task.cancel()

    async def _handle(
        self, delivery_id: int, attempts: int | None, raw: bytes, plain: bool
    ) -> None:
        message: Message | None = None
        error: BaseException | None = None
        try:
            message = self._jobs[delivery_id] = Message.from_raw(raw, delivery_id, attempts,
                                                                 plain)
            await call(self._handler.call, message)
        except asyncio.CancelledError as cancelled:  # ours (the timeout) or the handler's
            error = cancelled
        except Exception as raised:
            error = raised
        except BaseException as raised:  # sys.exit(), KeyboardInterrupt: the process ends
            self._handler_exited(delivery_id, message, raised)
        finally:
            self._handling.pop(delivery_id, None)
            self._jobs.pop(delivery_id, None)
            timer = self._timers.pop(delivery_id, None)
            if timer is not None:
                timer.cancel()
        failure = None if error is None else failure_of(error)
        if delivery_id in self._late:  # late even if it swallowed the cancellation
            self._late.discard(delivery_id)
            timeout = TimeoutError(f"handler timeout after {self._timeout}s")
            # Where the handler was when it was cancelled (its await), if the cancellation
            # came out of it; on_error still gets a TimeoutError.
            failure = failure_of(error or timeout, kind="HandlerTimeout",
                                 beside=(tracebacks.ASYNCIO,)).replace(message=str(timeout))
            error = timeout
        if error is not None and failure is not None:
            await self._fail(delivery_id, message, error, failure)
        elif self._handler.flush is None:
            self._succeed(delivery_id, message)  # type: ignore[arg-type]
        else:
            self._returned[delivery_id] = self._elapsed(delivery_id)  # its DONE waits
            self._held.append((delivery_id, message))  # type: ignore[arg-type]
            self._outcomes.append(protocol.encode_held(delivery_id))

    async def _fail(
        self, delivery_id: int, message: Message | None, error: BaseException, failure: Failure
    ) -> None:
        self._failed(delivery_id, message, failure)
        self.send(self._outcomes)  # settled without waiting for on_error()
        if self._handler.on_error is None or message is None:
            return
        try:
            await call(self._handler.on_error, message, error)
        except Exception as hook_error:
            self._on_error_failed(hook_error)

    # -- the durability barrier ----------------------------------------------------------

    def _maybe_flush(self) -> None:
        if not self._held or self._flushing is not None:
            return
        more_to_start = self._waiting and not self._inbox.stop_requested
        if more_to_start and len(self._held) < self._flush_every:
            return  # gather more successes first, as the one-at-a-time process does
        held, self._held = self._held, []
        self._flushing = self._loop.create_task(self._flush(held))
        self._flushing.add_done_callback(self._flush_done)

    async def _flush(self, held: list[tuple[int, Message]]) -> None:
        try:
            await call(self._handler.flush)  # type: ignore[arg-type]
        except Exception as error:
            failure = failure_of(error, "flush() failed")
            for delivery_id, message in held:
                await self._fail(delivery_id, message, error, failure)
            return
        for delivery_id, message in held:
            self._succeed(delivery_id, message)

    def _flush_done(self, task: asyncio.Task[Any]) -> None:
        self._flushing = None
        if task.cancelled() or task.exception() is not None:
            log.error("flush bookkeeping failed", exc_info=None if task.cancelled()
                      else task.exception())
            exit_process(CHILD_BROKEN)
        self._request_pump()

    # -- after settlement ----------------------------------------------------------------

    def confirm(self, delivery_id: int, committed: bool) -> None:
        message = self._confirmed(delivery_id, committed)
        if message is not None:
            self._track(self._on_success(delivery_id, message))

    async def _on_success(self, delivery_id: int, message: Message) -> None:
        try:
            await call(self._handler.on_success, message)  # type: ignore[arg-type]
        except Exception as error:
            self._on_success_failed(delivery_id, error)
