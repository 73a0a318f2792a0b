"""The handler process of a plain ``def`` handler: one delivery at a time.

Its timeout is the supervisor's kill. With ``flush()``, held successes are flushed when
nothing else waits in the ring, when ``flush_every`` of them are held, and before exit;
no timers.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from broker.failure import Failure
from worker import protocol
from worker.base import BATCH, Runner, exit_if_orphaned, failure_of
from worker.message import Message
from worker.titles import Watched

_IDLE_AFTER = 0.05  # seconds of waiting before the title says idle (saves title churn)
_PARENT_CHECK = 1.0  # seconds between checks that the parent is still there


class SyncRunner(Runner):
    """The delivery loop of one handler process running a plain ``def`` handler."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        #: What it runs, for its title's thread (noted per job, written every TICK).
        self._watched = Watched(self._title)

    def run(self) -> NoReturn:
        if self._handler.init is not None:
            self._init_until_ready(self._handler.init)
        self._ready(self._handler.spec)
        self._watched.start()  # the title's writer from now on
        self.serve()

    def serve(self) -> NoReturn:
        inbox, dispatch, watched = self._inbox, self.dispatch, self._watched
        while True:
            records = inbox.get_many(BATCH)
            if records:
                if watched.state is False:
                    watched.state = True
                for record in records:
                    dispatch(record)
                if not (inbox.stop_requested and inbox.waiting):
                    # Stopping, the skips of what is still in the ring go out with these,
                    # in one write: the supervisor releases them in one call, in order.
                    self.send(self._outcomes)
                continue
            if self._held:  # nothing else is waiting: make the held successes durable
                self._flush_held()
                self.send(self._outcomes)
            self._sleep()

    def deliver(
        self, delivery_id: int, attempts: int | None, raw: bytes, plain: bool = False
    ) -> None:
        if self._inbox.stop_requested:  # stopping: leave it for the supervisor to release
            if not self._taken_back(delivery_id, self._received):
                self._outcomes.append(protocol.encode_skipped(delivery_id))
            return
        # Outcomes so far go out before the handler runs (it may take long).
        outcomes = self._outcomes
        if outcomes:  # the last job's DONE, usually: one record, put at once
            if len(outcomes) == 1 and self._outbox.put(outcomes[0]):
                outcomes.clear()
            else:
                self.send(outcomes)
        # The mark (one store, no record) tells the supervisor this delivery is reached
        # before any of its side effects, or it might release it (attempts unchanged) after
        # a crash, or hand it to another process: see ``_taken_back``.
        if self._taken_back(delivery_id, self._received):
            return
        began = time.monotonic()
        message = None
        handler = self._handler
        try:
            message = Message.from_raw(raw, delivery_id, attempts, plain)
            self._watched.state = (message.pid, message.attempts, began)  # titles.Watched
            handler.call(message)
        except Exception as error:
            self._began[delivery_id] = began  # the failure is timed too (Runner._failed)
            self._fail(delivery_id, message, error, failure_of(error))
            return
        except BaseException as error:  # sys.exit(), KeyboardInterrupt: the process ends
            self._handler_exited(delivery_id, message, error)
        if handler.flush is None:
            # DONE carries the handler's seconds (for the supervisor's histogram).
            self._succeed(delivery_id, message, time.monotonic() - began)
            return
        # Its DONE comes after flush(), with the handler's own time (Runner._returned).
        self._returned[delivery_id] = time.monotonic() - began
        self._held.append((delivery_id, message))
        if len(self._held) >= self._flush_every:
            self._flush_held()

    def confirm(self, delivery_id: int, committed: bool) -> None:
        message = self._confirmed(delivery_id, committed)
        if message is None:
            return
        try:
            self._handler.on_success(message)  # type: ignore[misc]
        except Exception as error:
            self._on_success_failed(delivery_id, error)

    def exit_asked(self) -> NoReturn:
        if self._held:
            self._flush_held()
        self._exit_done()

    def _fail(
        self, delivery_id: int, message: Message | None, error: Exception, failure: Failure
    ) -> None:
        self._failed(delivery_id, message, failure)
        if self._handler.on_error is None or message is None:
            return
        try:
            self._handler.on_error(message, error)
        except Exception as hook_error:
            self._on_error_failed(hook_error)

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        try:
            self._handler.flush()  # type: ignore[misc]
        except Exception as error:
            failure = failure_of(error, "flush() failed")
            for delivery_id, message in held:
                self._fail(delivery_id, message, error, failure)
            return
        for delivery_id, message in held:
            self._succeed(delivery_id, message)

    def _sleep(self) -> None:
        if self._inbox.wait(_IDLE_AFTER):
            return
        self._watched.state = False
        while not self._inbox.wait(_PARENT_CHECK):
            exit_if_orphaned(self._parent)
