"""The handler process: take deliveries from the ring, call the handler, post outcomes.

No network I/O happens here; the supervisor owns the broker. Outcomes are never dropped:
when the outcome ring is full the loop waits for the supervisor to drain it.

Durability barrier: when the handler module defines ``flush()``, successes are held and
reported DONE only after ``flush()`` returned. It runs when nothing else waits in the
ring, when ``flush_every`` successes are held, and before exit; no timers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from typing import NoReturn

import setproctitle

from worker import protocol
from worker.handler import Handler, HandlerError, load
from worker.message import Message
from worker.process import CHILD_INIT_FAILED, CHILD_ORPHANED, set_parent_death_signal
from worker.ring import Ring

log = logging.getLogger(__name__)

#: Records taken from the ring per read (one release of room per batch).
BATCH = 256

_IDLE_AFTER = 0.05  # seconds of waiting before the title says idle (saves title churn)
_PARENT_CHECK = 1.0  # seconds between checks that the parent is still there
_ROOM_DELAYS = (0.0001, 0.0005, 0.002, 0.01)  # back-off while the outcome ring is full


def run(
    slot: int,
    to_child: Ring,
    to_parent: Ring,
    handler: str,
    *,
    flush_every: int = 100,
    queue: str = "",
    tasks: int = 1,
    timeout: float = 0.0,
) -> NoReturn:
    """The main function of a handler process (called in the forked child).

    An ``async def`` handler runs in ``worker.aio`` with up to ``tasks`` deliveries at once,
    each cancelled after ``timeout`` seconds (0: never); a plain one runs here, one at a
    time, and its timeout is the supervisor's kill.
    """
    parent = os.getppid()
    # Ctrl-C reaches the whole process group: the supervisor decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM ends us at once; the running delivery stays owned and is recovered.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    set_parent_death_signal()
    _configure_logging(slot)
    title = _Title(queue, slot)
    hooks = _load(handler, to_parent)
    if hooks.is_async:
        from worker import aio

        aio.run(hooks, to_child, to_parent, tasks=tasks, flush_every=flush_every,
                timeout=timeout, title=title, parent=parent, spec=handler, slot=slot)
    _init(hooks, to_parent)
    runner = _Runner(to_child, to_parent, hooks, flush_every, title, parent)
    runner.send([protocol.encode_ready(wants_confirm=hooks.on_success is not None)])
    log.info("handler process %d ready (%s)", slot, handler)
    runner.serve()


def _load(spec: str, to_parent: Ring) -> Handler:
    """The loaded handler; on failure report it and exit 3."""
    try:
        return load(spec)
    except HandlerError as error:
        init_failed(str(error), _origin(error.__cause__), to_parent)


def _init(hooks: Handler, to_parent: Ring) -> None:
    """Run a plain ``init()``; on failure report it and exit 3."""
    try:
        if hooks.init is not None:
            hooks.init()
    except Exception as error:
        init_failed(f"init() failed: {_describe(error)}", _origin(error), to_parent)


def init_failed(text: str, origin: str, to_parent: Ring) -> NoReturn:
    """Tell the supervisor why this process cannot start (it halts: every process would
    fail the same way), then exit 3."""
    log.error("%s%s", text, origin)
    _put_all(to_parent, [protocol.encode_init_failed(text)], os.getppid())
    _exit(CHILD_INIT_FAILED)


class _Runner:
    """The delivery loop of one handler process."""

    def __init__(
        self, inbox: Ring, outbox: Ring, hooks: Handler, flush_every: int, title: _Title,
        parent: int,
    ) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._hooks = hooks
        self._flush_every = max(1, flush_every)
        self._title = title
        self._parent = parent
        self._outcomes: list[bytes] = []  # encoded, not yet on the ring
        self._held: list[tuple[int, Message]] = []  # succeeded, waiting for flush()
        self._unconfirmed: dict[int, Message] = {}  # DONE, waiting for CONFIRM

    def serve(self) -> NoReturn:
        inbox = self._inbox
        while True:
            records = inbox.get_many(BATCH)
            if records:
                self._title.set_busy(True)
                for record in records:
                    self._dispatch(record)
                self.send(self._outcomes)
                continue
            if self._held:  # nothing else is waiting: make the held successes durable
                self._flush_held()
                self.send(self._outcomes)
            self._sleep()

    def _dispatch(self, record: bytes) -> None:
        kind, delivery_id, data = protocol.decode(record)
        if kind == protocol.DELIVER:
            attempts, raw = protocol.deliver_data(data)
            self._deliver(delivery_id, raw, attempts)
        elif kind == protocol.CONFIRM:
            self._confirm(delivery_id, bool(data))
        elif kind == protocol.EXIT:
            self._exit()
        else:
            log.warning("ignoring unexpected %s record", protocol.KIND_NAMES[kind])

    def _deliver(self, delivery_id: int, raw: bytes, attempts: int | None) -> None:
        if self._inbox.flag:  # stopping: leave it for the supervisor to release
            self._outcomes.append(protocol.encode_skipped(delivery_id))
            return
        # The supervisor must know a delivery started before any of its side effects,
        # or it might release it (attempts unchanged) after a crash.
        self._outcomes.append(protocol.encode_started(delivery_id))
        self.send(self._outcomes)
        message = None
        try:
            message = Message.from_raw(raw, delivery_id, attempts)
            self._hooks.call(message)
        except Exception as error:
            self._fail(delivery_id, message, error, _describe(error))
            return
        if self._hooks.flush is None:
            self._succeed(delivery_id, message)
            return
        self._held.append((delivery_id, message))
        if len(self._held) >= self._flush_every:
            self._flush_held()

    def _succeed(self, delivery_id: int, message: Message) -> None:
        self._outcomes.append(protocol.encode_done(delivery_id))
        if self._hooks.on_success is not None:
            self._unconfirmed[delivery_id] = message

    def _fail(
        self, delivery_id: int, message: Message | None, error: Exception, text: str
    ) -> None:
        self._outcomes.append(protocol.encode_failed(delivery_id, text))
        job = message.pid if message is not None else "?"
        log.warning("delivery %d (job %s) failed: %s%s", delivery_id, job, text, _origin(error))
        if self._hooks.on_error is None or message is None:
            return
        try:
            self._hooks.on_error(message, error)
        except Exception as hook_error:
            log.error("on_error() failed: %s%s", _describe(hook_error), _origin(hook_error))

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        try:
            self._hooks.flush()  # type: ignore[misc]
        except Exception as error:
            text = f"flush() failed: {_describe(error)}"
            for delivery_id, message in held:
                self._fail(delivery_id, message, error, text)
            return
        for delivery_id, message in held:
            self._succeed(delivery_id, message)

    def _confirm(self, delivery_id: int, committed: bool) -> None:
        message = self._unconfirmed.pop(delivery_id, None)
        if not committed or message is None or self._hooks.on_success is None:
            return
        try:
            self._hooks.on_success(message)
        except Exception as error:
            log.error("on_success() failed for delivery %d: %s%s",
                      delivery_id, _describe(error), _origin(error))

    def _exit(self) -> NoReturn:
        if self._held:
            self._flush_held()
        self.send(self._outcomes)
        log.info("handler process exiting")
        _exit(0)

    def send(self, outcomes: list[bytes]) -> None:
        """Put every outcome on the ring, waiting for room if needed; empties the list."""
        if outcomes:
            _put_all(self._outbox, outcomes, self._parent)
            outcomes.clear()

    def _sleep(self) -> None:
        if self._inbox.wait(_IDLE_AFTER):
            return
        self._title.set_busy(False)
        while not self._inbox.wait(_PARENT_CHECK):
            _exit_if_orphaned(self._parent)


def _put_all(ring: Ring, records: list[bytes], parent: int) -> None:
    """Put every record, in order, waiting for the reader to make room."""
    sent = ring.put_many(records)
    attempt = 0
    while sent < len(records):
        time.sleep(_ROOM_DELAYS[min(attempt, len(_ROOM_DELAYS) - 1)])
        attempt += 1
        _exit_if_orphaned(parent)
        sent += ring.put_many(records[sent:])


def _exit_if_orphaned(parent: int) -> None:
    if os.getppid() != parent:
        log.error("parent process %d is gone; exiting", parent)
        _exit(CHILD_ORPHANED)


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not stop the exit
            stream.flush()
    os._exit(code)


class _Title:
    """The process title, changed only when the busy/idle state changes."""

    def __init__(self, queue: str, slot: int) -> None:
        self._prefix = f"queue-supervisor: {queue} handler {slot}"
        self._busy: bool | None = None
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            setproctitle.setproctitle(f"{self._prefix} {'busy' if busy else 'idle'}")


def _configure_logging(slot: int) -> None:
    """Log to stderr, one line per event, unless the supervisor configured logging."""
    root = logging.getLogger()
    if root.handlers:
        return
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter(
        f"%(asctime)s handler {slot} [%(process)d] %(levelname)s %(name)s: %(message)s"
    ))
    root.addHandler(stream)
    root.setLevel(logging.INFO)


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _origin(error: BaseException | None) -> str:
    """Where the error was raised (the innermost frame), for a one-line log."""
    traceback = error.__traceback__ if error is not None else None
    if traceback is None:
        return ""
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return f" (at {traceback.tb_frame.f_code.co_filename}:{traceback.tb_lineno})"
