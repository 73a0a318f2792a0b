"""What every handler process does, whichever loop runs its handler.

``worker.sync`` runs a plain ``def`` handler one delivery at a time, ``worker.aio`` an
``async def`` one on an event loop; both build on ``Runner`` here: the set-up after fork,
the records on the rings (dispatch of what the supervisor sends, the outcomes sent back),
the success and confirmation bookkeeping and the ways out of the process. This module
imports neither of them.

No network I/O happens in a handler process; the supervisor owns the broker. Outcomes are
never dropped: when the outcome ring is full the process waits for the supervisor to drain it.

Durability barrier: when the handler module defines ``flush()``, successes are held and
reported DONE only after a ``flush()`` that began after they returned has returned.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from broker.errors import describe
from broker.failure import Failure
from worker import protocol, tracebacks
from worker.handler import Handler
from worker.message import Message
from worker.process import (
    CHILD_BROKEN,
    CHILD_INIT_FAILED,
    CHILD_ORPHANED,
    set_parent_death_signal,
)
from worker.ring import Ring, fence
from worker.titles import Title

# One logger name for every handler process line, whichever loop runs it: operators filter
# the logs on it.
log = logging.getLogger("worker.runner")

#: Records taken from the ring per read (one release of room per batch).
BATCH = 256

#: init() failing on the network is tried again after 1, 2, 4 ... seconds, at most 30 apart.
INIT_RETRY_FIRST = 1.0
INIT_RETRY_CAP = 30.0
#: OSError numbers of a network that is not up yet (at boot), besides ConnectionError's.
_NETWORK_ERRNOS = frozenset((errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN,
                             errno.ENETDOWN, errno.EADDRNOTAVAIL))

_ROOM_DELAYS = (0.0001, 0.0005, 0.002, 0.01)  # back-off while the outcome ring is full


def prepare_process(place: int) -> int:
    """Set up a freshly forked handler process; returns the parent's pid, to watch."""
    parent = os.getppid()
    # Ctrl-C reaches the whole process group: the supervisor decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So does a terminal's hang-up: the supervisor reloads us on SIGHUP by itself.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # SIGTERM ends us at once; the running delivery stays owned and is recovered.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    set_parent_death_signal()
    _configure_logging(place)
    return parent


class Runner:
    """The part of a handler process's loop that does not depend on how the handler runs.

    A subclass implements ``run`` (init, ready, serve until told to exit) and what each
    record the supervisor sends means for it: ``deliver``, ``confirm``, ``exit_asked``.
    """

    def __init__(
        self, place: int, inbox: Ring, outbox: Ring, handler: Handler, *, parent: int,
        queue: str, flush_every: int, alone: bool = False,
    ) -> None:
        self._place = place
        self._inbox = inbox
        self._outbox = outbox
        self._handler = handler
        self._parent = parent
        self._title = Title(queue, place)
        self._flush_every = max(1, flush_every)
        self._outcomes: list[bytes] = []  # encoded, not yet on the ring
        self._held: list[tuple[int, Message]] = []  # returned, waiting for flush()
        self._unconfirmed: dict[int, Message] = {}  # DONE, waiting for CONFIRM
        self._began: dict[int, float] = {}  # started, no outcome yet: when (monotonic)
        #: Returned, held for flush(): the handler's own seconds (its DONE carries them,
        #: not the wait for flush(), which depends on what else the flush covers).
        self._returned: dict[int, float] = {}
        #: DELIVER records read so far: the number of the last one (see protocol, "Taking
        #: back"); the supervisor counts the same records, so no number travels.
        self._received = 0
        #: The job's only handler process: nothing is ever taken back from it (a single
        #: process keeps its deep ring, supervisor.dispatch), so it reads no cut.
        self._alone = alone
        self.serving = False  # READY sent: an exit from now on is never a failed init()
        # A FAILED record must fit the outcome ring (a small one in tests), header included.
        self._failure_limit = min(protocol.MAX_FAILURE_BYTES,
                                  outbox.capacity // 2 - Ring.RECORD_HEADER - 9)

    def run(self) -> NoReturn:
        raise NotImplementedError

    def deliver(
        self, delivery_id: int, attempts: int | None, raw: bytes, plain: bool = False
    ) -> None:
        raise NotImplementedError

    def confirm(self, delivery_id: int, committed: bool) -> None:
        raise NotImplementedError

    def exit_asked(self) -> None:
        raise NotImplementedError

    # -- records in --------------------------------------------------------------------------

    def dispatch(self, record: bytes) -> None:
        if record[0] == protocol.DELIVER:  # the one kind per job: its head in one unpack
            self._received += 1
            _, delivery_id, flags, attempts = protocol.unpack_deliver(record)
            self.deliver(delivery_id, attempts if flags & protocol.KNOWN else None,
                         record[protocol.DELIVER_OVERHEAD:], bool(flags & protocol.PLAIN))
            return
        kind, delivery_id, data = protocol.decode(record)
        if kind == protocol.CONFIRM:
            self.confirm(delivery_id, bool(data))
        elif kind == protocol.EXIT:
            self.exit_asked()
        else:
            log.warning("ignoring unexpected %s record", protocol.KIND_NAMES[kind])

    def _taken_back(self, delivery_id: int, number: int) -> bool:
        """Reach delivery ``number`` of the ring before starting or skipping it: mark it,
        then read the supervisor's cut. True (WITHDRAWN goes out with the next send) when
        the supervisor took it back to hand it to another process: it must not start here.
        The mark is stored before the cut is read, and the supervisor stores the cut
        before it reads the mark (protocol, "Taking back"): one fence each way."""
        self._outbox.mark(number)
        if self._alone:
            return False
        fence()
        if number >= self._inbox.marked:
            return False
        self._outcomes.append(protocol.encode_withdrawn(delivery_id, number))
        return True

    # -- outcomes ----------------------------------------------------------------------------

    def send(self, outcomes: list[bytes]) -> None:
        """Put every outcome on the ring, waiting for room if needed; empties the list."""
        if outcomes:
            put_all(self._outbox, outcomes, self._parent)
            outcomes.clear()

    def _ready(self, detail: str) -> None:
        self.send([protocol.encode_ready()])
        self.serving = True
        log.info("handler process %d ready (%s)", self._place, detail)

    def _begin(self, delivery_id: int) -> None:
        """The handler starts on this delivery now (its outcome says how long it took)."""
        self._began[delivery_id] = time.monotonic()

    def _elapsed(self, delivery_id: int) -> float:
        began = self._began.pop(delivery_id, None)
        return 0.0 if began is None else time.monotonic() - began

    def _succeed(self, delivery_id: int, message: Message, seconds: float | None = None) -> None:
        """DONE goes out with the next send, with the handler's ``seconds`` (by default
        what it took until it returned: since ``_begin``, or as noted when it was held)."""
        if seconds is None:
            seconds = self._returned.pop(delivery_id, None)
        if seconds is None:
            seconds = self._elapsed(delivery_id)
        self._outcomes.append(protocol.encode_done(delivery_id, seconds))
        if self._handler.on_success is not None:
            self._unconfirmed[delivery_id] = message

    def _failed(self, delivery_id: int, message: Message | None, failure: Failure) -> None:
        """FAILED goes out with the next send; the caller then runs ``on_error`` its way.
        The supervisor logs the run's outcome once it is settled (retrying, failed, dead):
        this line is for debugging the handler process."""
        # How long it ran (a held one: until it returned), for the record and the figures.
        began, seconds = self._began.pop(delivery_id, None), self._returned.pop(delivery_id, None)
        if seconds is None and began is not None:
            seconds = time.monotonic() - began
        if seconds is not None:
            failure = failure.replace(seconds=round(seconds, 6))
        self._outcomes.append(protocol.encode_failed(delivery_id, failure, self._failure_limit))
        job = message.pid if message is not None else "?"
        log.debug("delivery %d (job %s) failed: %s (%s)", delivery_id, job, failure.summary,
                  failure.where)

    def _handler_exited(
        self, delivery_id: int, message: Message | None, error: BaseException
    ) -> NoReturn:
        """The handler raised what is not an Exception (``sys.exit()``, KeyboardInterrupt,
        a framework's own BaseException): the run failed with it, and this process exits
        to be replaced, with our code for it (a lost worker), never the handler's:
        ``sys.exit(3)`` in one job read as a failed init() and halted the supervisor."""
        failure = failure_of(error)
        self._failed(delivery_id, message, failure)
        self.send(self._outcomes)
        job = message.pid if message is not None else "?"
        log.error("job %s: the handler raised %s, which is not an Exception: the run "
                  "counts as failed and handler process %d exits (the supervisor starts "
                  "another)", job, failure.summary, self._place)
        exit_process(CHILD_BROKEN)

    def escaped(self, error: BaseException) -> NoReturn:
        """What left the loop (a handler's ``sys.exit()`` in flush(), on_error() or
        on_success(), KeyboardInterrupt ...). Before READY it is init()'s, and ends the
        process as before; once serving, the process exits as a lost worker, so that
        no exit code a handler chose reads as a failed init() (which halts)."""
        if not self.serving:
            raise error
        log.error("handler process %d: %s escaped its loop: exiting (the supervisor "
                  "starts another)", self._place, failure_of(error).summary)
        exit_process(CHILD_BROKEN)

    def _on_error_failed(self, error: Exception) -> None:
        log.error("on_error() failed: %s%s", describe(error), origin(error))

    def _confirmed(self, delivery_id: int, committed: bool) -> Message | None:
        """The message whose ``on_success()`` is due now that its settlement is known."""
        message = self._unconfirmed.pop(delivery_id, None)
        if not committed or self._handler.on_success is None:
            return None
        return message

    def _on_success_failed(self, delivery_id: int, error: Exception) -> None:
        log.error("on_success() failed for delivery %d: %s%s",
                  delivery_id, describe(error), origin(error))

    # -- init ----------------------------------------------------------------------------------

    def _init_until_ready(self, attempt: Callable[[], object]) -> None:
        """Run init() (``attempt``). One failing on the network (a database not up yet at
        boot) heals by itself: tried again after 1, 2, 4 ... 30 s, each failure a warning,
        while the supervisor gives this process no work. Anything else halts (exit 3)."""
        failures = 0
        while True:
            try:
                attempt()
                return
            except Exception as error:
                if not heals(error):
                    self._init_failed(error)
                failures += 1
                delay = min(INIT_RETRY_FIRST * 2 ** (failures - 1), INIT_RETRY_CAP)
                log.warning("init() failed (%d in a row): %s%s; retrying in %g s, no work "
                            "until it succeeds", failures, describe(error), origin(error),
                            delay)
                self._pause(delay)

    def _pause(self, seconds: float) -> None:
        """Wait before init() again, leaving at once if the supervisor asks us to exit (it
        stops or reloads) or is gone: nothing else is sent to a process not ready."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            exit_if_orphaned(self._parent)
            asked = self._inbox.stop_requested
            if self._inbox.wait(min(remaining, 1.0)):
                asked = asked or any(protocol.decode(record)[0] == protocol.EXIT
                                     for record in self._inbox.get_many(BATCH))
            if asked:
                log.info("handler process exiting before its init() succeeded")
                exit_process(0)

    # -- ways out ----------------------------------------------------------------------------

    def _init_failed(self, error: Exception) -> NoReturn:
        """Tell the supervisor why this process cannot start (it halts: every process would
        fail the same way), then exit 3."""
        text = f"init() failed: {describe(error)}"
        log.error("%s%s", text, origin(error))
        put_all(self._outbox, [protocol.encode_init_failed(text)], self._parent)
        exit_process(CHILD_INIT_FAILED)

    def _exit_done(self) -> NoReturn:
        """EXIT was the last record and everything before it is reported: exit 0."""
        self.send(self._outcomes)
        log.info("handler process exiting")
        exit_process(0)


def put_all(ring: Ring, records: list[bytes], parent: int) -> None:
    """Put every record, in order, waiting for the reader to make room."""
    sent = ring.put_many(records)
    attempt = 0
    while sent < len(records):
        time.sleep(_ROOM_DELAYS[min(attempt, len(_ROOM_DELAYS) - 1)])
        attempt += 1
        exit_if_orphaned(parent)
        sent += ring.put_many(records[sent:])


def exit_if_orphaned(parent: int) -> None:
    if os.getppid() != parent:
        log.error("parent process %d is gone; exiting", parent)
        exit_process(CHILD_ORPHANED)


def exit_process(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not stop the exit
            stream.flush()
    os._exit(code)


def _configure_logging(place: int) -> None:
    """Log to stderr, one line per event, unless the supervisor configured logging."""
    root = logging.getLogger()
    if root.handlers:
        return
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter(
        f"%(asctime)s handler {place} [%(process)d] %(levelname)s %(name)s: %(message)s"
    ))
    root.addHandler(stream)
    root.setLevel(logging.INFO)


def heals(error: BaseException) -> bool:
    """init() failed on the network (refused, reset, timed out, a name or route not there
    yet), here or in an error raised from one: trying again later can succeed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if isinstance(current, OSError) and current.errno in _NETWORK_ERRNOS:
            return True
        # Only an explicit ``raise ... from``: an error raised while handling a refused
        # connection (a helper process that exited with an error) says nothing of the network.
        current = current.__cause__
    return False


def failure_of(
    error: BaseException, context: str = "", kind: str = "", beside: tuple[str, ...] = ()
) -> Failure:
    """What an operator reads of a failed run: the exception's class (qualified outside
    builtins), its message (``context`` first, e.g. "flush() failed"), the innermost frame
    and the formatted traceback (its end kept). ``kind`` names the class instead (a
    timeout reads "HandlerTimeout", not the CancelledError that carried it out); ``beside``:
    folders whose frames ``where`` looks past (see ``tracebacks.where``).
    Never raises, whatever the exception's ``__str__`` does."""
    cls = type(error)
    name = kind or (cls.__qualname__ if cls.__module__ == "builtins"
                    else f"{cls.__module__}.{cls.__qualname__}")
    try:
        text = str(error)
    except Exception as broken:  # a handler's exception whose __str__ raises
        text = f"<str() raised {type(broken).__name__}>"
    if context:
        text = f"{context}: {text}" if text else context
    return Failure(error=name, message=text, where=tracebacks.where(error, beside),
                   traceback=tracebacks.format_failure(error)).bounded()


def origin(error: BaseException | None) -> str:
    """Where the error was raised (the innermost frame), for a one-line log."""
    traceback = error.__traceback__ if error is not None else None
    if traceback is None:
        return ""
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return f" (at {traceback.tb_frame.f_code.co_filename}:{traceback.tb_lineno})"
