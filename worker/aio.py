"""The handler process of an ``async def`` handler: one event loop, several deliveries at once.

The ring protocol is ``worker.runner``'s, per delivery:

- Deliveries start in the order they arrived (the supervisor pairs STARTED and SKIPPED
  with its own queue by order), at most ``tasks`` at once; the rest wait here, not started.
  STARTED is on the ring before the delivery's task first runs, so before any side effect.
- A success is DONE at once, or, when the module defines ``flush()``, HELD at once and DONE
  after a ``flush()`` that began after it returned has returned. One ``flush()`` runs at a
  time, beside the running handlers: what returns meanwhile goes into the next one (a group
  commit). It starts when nothing waits to start here or ``flush_every`` successes are held.
- ``timeout``: the task is cancelled and the delivery FAILED ("handler timeout"). A task that
  does not end (it blocks the loop, or swallows the cancellation) is the supervisor's to
  kill, with the process, after a grace.
- The stop flag: nothing more starts; what waits here is SKIPPED. EXIT (the last record the
  supervisor sends): what came before it runs, then a last ``flush()``, then exit 0.

``init``, ``flush``, ``on_success`` and ``on_error`` may each be ``async def`` or plain; a
plain one runs on the loop (and blocks it while it runs). ``on_success`` and ``on_error``
calls count against ``tasks`` like handler calls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

from worker import protocol
from worker.handler import Handler
from worker.message import Message
from worker.process import CHILD_BROKEN
from worker.ring import Ring
from worker.runner import (
    BATCH,
    _describe,
    _exit,
    _exit_if_orphaned,
    _origin,
    _put_all,
    _Title,
    init_failed,
)

log = logging.getLogger("worker.runner")

TICK = 0.1  # seconds between looks at the stop flag (it comes without a wake-up)
_PARENT_CHECK_TICKS = 10  # ticks between checks that the parent is still there


def run(
    hooks: Handler, inbox: Ring, outbox: Ring, *, tasks: int, flush_every: int,
    timeout: float, title: _Title, parent: int, spec: str, slot: int,
) -> NoReturn:
    """Init on a new event loop, then serve on the same loop until told to exit."""
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    if hooks.init is not None:
        try:
            loop.run_until_complete(call(hooks.init))
        except Exception as error:
            init_failed(f"init() failed: {_describe(error)}", _origin(error), outbox)
    runner = _AsyncRunner(inbox, outbox, hooks, tasks, flush_every, timeout, title, parent)
    runner.send([protocol.encode_ready(wants_confirm=hooks.on_success is not None)])
    log.info("handler process %d ready (%s, up to %d deliveries at once)", slot, spec, tasks)
    loop.run_until_complete(runner.serve())
    _exit(CHILD_BROKEN)  # serve() only ends by exiting the process


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


class _AsyncRunner:
    def __init__(
        self, inbox: Ring, outbox: Ring, hooks: Handler, tasks: int, flush_every: int,
        timeout: float, title: _Title, parent: int,
    ) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._hooks = hooks
        self._capacity = max(1, tasks)
        self._flush_every = max(1, flush_every)
        self._timeout = timeout
        self._title = title
        self._parent = parent
        self._loop = asyncio.get_event_loop()
        self._waiting: deque[tuple[int, int | None, bytes]] = deque()  # not started
        self._tasks: set[asyncio.Task] = set()  # everything that counts against capacity
        self._handling: dict[int, asyncio.Task] = {}  # delivery id -> task in handle()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._late: set[int] = set()  # their timeout expired: cancelled
        self._held: list[tuple[int, Message]] = []  # returned, waiting for flush()
        self._flushing: asyncio.Task | None = None
        self._unconfirmed: dict[int, Message] = {}  # DONE, waiting for CONFIRM
        self._outcomes: list[bytes] = []
        self._pump_scheduled = False
        self._exiting = False

    # -- the loop's callbacks ------------------------------------------------------------

    async def serve(self) -> NoReturn:
        self._loop.add_reader(self._inbox.wake_fd, self._guarded(self._on_wake))
        self._guarded(self._on_wake)()
        ticks = 0
        while True:
            await asyncio.sleep(TICK)
            ticks += 1
            if ticks % _PARENT_CHECK_TICKS == 0:
                _exit_if_orphaned(self._parent)
            if self._inbox.flag and self._waiting:
                self._request_pump()
            if not self._tasks:
                self._title.set_busy(False)

    def _guarded(self, callback: Callable[..., None]) -> Callable[..., None]:
        """Our own callback raising would leave deliveries without an outcome forever:
        exit instead, so the supervisor accounts for them as lost with this process."""

        def run_guarded(*args: Any) -> None:
            try:
                callback(*args)
            except Exception:
                log.exception("handler process bookkeeping failed: exiting")
                _exit(CHILD_BROKEN)

        return run_guarded

    def _on_wake(self) -> None:
        inbox = self._inbox
        inbox.clear_wakeup()
        while True:
            records = inbox.get_many(BATCH)
            for record in records:
                self._dispatch(record)
            if not records and inbox.prepare_sleep():
                break
        self._pump()

    def _dispatch(self, record: bytes) -> None:
        kind, delivery_id, data = protocol.decode(record)
        if kind == protocol.DELIVER:
            attempts, raw = protocol.deliver_data(data)
            self._waiting.append((delivery_id, attempts, raw))
        elif kind == protocol.CONFIRM:
            self._confirm(delivery_id, bool(data))
        elif kind == protocol.EXIT:
            self._exiting = True
        else:
            log.warning("ignoring unexpected %s record", protocol.KIND_NAMES[kind])

    def _request_pump(self) -> None:
        """One pump per loop iteration, however many tasks ended in it (one ring write)."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop.call_soon(self._guarded(self._pump))

    def _pump(self) -> None:
        """Start what may start, flush if due, send the outcomes; exit when asked and done."""
        self._pump_scheduled = False
        if self._inbox.flag:
            while self._waiting:  # stopping: the supervisor releases these
                self._outcomes.append(protocol.encode_skipped(self._waiting.popleft()[0]))
        while self._waiting and len(self._tasks) < self._capacity:
            self._start(*self._waiting.popleft())
        self._maybe_flush()
        # STARTED goes out here, before the new tasks first run (they run after we return).
        self.send(self._outcomes)
        if self._tasks:
            self._title.set_busy(True)
        if (self._exiting and not self._waiting and not self._tasks and not self._held
                and self._flushing is None):
            log.info("handler process exiting")
            _exit(0)

    # -- one delivery --------------------------------------------------------------------

    def _start(self, delivery_id: int, attempts: int | None, raw: bytes) -> None:
        self._outcomes.append(protocol.encode_started(delivery_id))
        task = self._track(self._handle(delivery_id, attempts, raw))
        self._handling[delivery_id] = task
        if self._timeout:
            self._timers[delivery_id] = self._loop.call_later(
                self._timeout, self._expire, delivery_id)

    def _track(self, coroutine: Any) -> asyncio.Task:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("handler process task failed", exc_info=task.exception())
            _exit(CHILD_BROKEN)
        self._request_pump()

    def _expire(self, delivery_id: int) -> None:
        task = self._handling.get(delivery_id)
        if task is None:
            return
        log.warning("delivery %d exceeded handler_timeout %ss: cancelled", delivery_id,
                    self._timeout)
        self._late.add(delivery_id)
        task.cancel()

    async def _handle(self, delivery_id: int, attempts: int | None, raw: bytes) -> None:
        message: Message | None = None
        error: BaseException | None = None
        try:
            message = Message.from_raw(raw, delivery_id, attempts)
            await call(self._hooks.call, message)
        except asyncio.CancelledError as cancelled:  # ours (the timeout) or the handler's
            error = cancelled
        except Exception as raised:
            error = raised
        finally:
            self._handling.pop(delivery_id, None)
            timer = self._timers.pop(delivery_id, None)
            if timer is not None:
                timer.cancel()
        if delivery_id in self._late:  # late even if it swallowed the cancellation
            self._late.discard(delivery_id)
            error = TimeoutError(f"handler timeout after {self._timeout}s")
        if error is not None:
            await self._fail(delivery_id, message, error, _describe(error))
        elif self._hooks.flush is None:
            self._succeed(delivery_id, message)  # type: ignore[arg-type]
        else:
            self._held.append((delivery_id, message))  # type: ignore[arg-type]
            self._outcomes.append(protocol.encode_held(delivery_id))

    def _succeed(self, delivery_id: int, message: Message) -> None:
        self._outcomes.append(protocol.encode_done(delivery_id))
        if self._hooks.on_success is not None:
            self._unconfirmed[delivery_id] = message

    async def _fail(
        self, delivery_id: int, message: Message | None, error: BaseException, text: str
    ) -> None:
        self._outcomes.append(protocol.encode_failed(delivery_id, text))
        self.send(self._outcomes)  # settled without waiting for on_error()
        job = message.pid if message is not None else "?"
        log.warning("delivery %d (job %s) failed: %s%s", delivery_id, job, text, _origin(error))
        if self._hooks.on_error is None or message is None:
            return
        try:
            await call(self._hooks.on_error, message, error)
        except Exception as hook_error:
            log.error("on_error() failed: %s%s", _describe(hook_error), _origin(hook_error))

    # -- the durability barrier ----------------------------------------------------------

    def _maybe_flush(self) -> None:
        if not self._held or self._flushing is not None:
            return
        more_to_start = self._waiting and not self._inbox.flag
        if more_to_start and len(self._held) < self._flush_every:
            return  # gather more successes first, as the one-at-a-time process does
        held, self._held = self._held, []
        self._flushing = self._loop.create_task(self._flush(held))
        self._flushing.add_done_callback(self._flush_done)

    async def _flush(self, held: list[tuple[int, Message]]) -> None:
        try:
            await call(self._hooks.flush)  # type: ignore[arg-type]
        except Exception as error:
            text = f"flush() failed: {_describe(error)}"
            for delivery_id, message in held:
                await self._fail(delivery_id, message, error, text)
            return
        for delivery_id, message in held:
            self._succeed(delivery_id, message)

    def _flush_done(self, task: asyncio.Task) -> None:
        self._flushing = None
        if task.cancelled() or task.exception() is not None:
            log.error("flush bookkeeping failed", exc_info=None if task.cancelled()
                      else task.exception())
            _exit(CHILD_BROKEN)
        self._request_pump()

    # -- after settlement ----------------------------------------------------------------

    def _confirm(self, delivery_id: int, committed: bool) -> None:
        message = self._unconfirmed.pop(delivery_id, None)
        if committed and message is not None and self._hooks.on_success is not None:
            self._track(self._on_success(delivery_id, message))

    async def _on_success(self, delivery_id: int, message: Message) -> None:
        try:
            await call(self._hooks.on_success, message)  # type: ignore[arg-type]
        except Exception as error:
            log.error("on_success() failed for delivery %d: %s%s",
                      delivery_id, _describe(error), _origin(error))

    def send(self, outcomes: list[bytes]) -> None:
        """Put every outcome on the ring, waiting for room if needed; empties the list."""
        if outcomes:
            _put_all(self._outbox, outcomes, self._parent)
            outcomes.clear()
