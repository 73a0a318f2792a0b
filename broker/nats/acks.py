"""Acks of many deliveries as one write: typed requests, each confirmed by its own reply.

Each ack is what nats-py's ``ack_sync`` sends: the body (``+ACK``, ``+WPI`` ...) published
to the delivery's ack subject with a reply subject of our inbox, so the server's answer
confirms it. Never AckAll, never an ack without a reply. A batch's requests leave in one
socket write (``Connection.request_batch``); their replies come back on the one inbox
subscription and are matched by token, in any order. Each result is reported as soon as
its own reply is in, so a lost reply holds back nothing after it; the confirmations one
read brought may be reported together (``on_confirmed``).

The result of one try, as the one-at-a-time path (``Requester.request``) reads it:

- a reply: OK, or ERROR ``NO_RESPONDERS`` for a 503 (nobody serves the consumer, so
  nobody applied it: certain);
- no reply in time, or the connection closed after the write: UNCERTAIN (it may have
  been applied; never replayed, JetStream redelivers it if it was not);
- never written (the connection was already closed): ERROR.

The caller tries the ERRORs again the one-at-a-time way (its backoff for a 503).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import orjson
from nats.aio.msg import Msg

from broker.base import Outcome, Result
from broker.nats.conn import Connection, ConnectionLost, RequestTimeout

#: The ack-family bodies (JetStream's AckAck, AckNak, AckTerm, AckProgress).
ACK, NAK, TERM, WPI = b"+ACK", b"-NAK", b"+TERM", b"+WPI"
#: An ack answered 503: nobody serves the consumer, so nobody applied it (certain).
NO_RESPONDERS = ("no responder: the consumer has no leader now (a JetStream cluster electing "
                 "one); not applied")
_OK = Result(Outcome.OK)
_NO_RESPONDERS = Result(Outcome.ERROR, NO_RESPONDERS)


def nak_after(delay: float) -> bytes:
    """A NAK asking for redelivery after ``delay`` s (at once for 0)."""
    if delay <= 0:
        return NAK
    return NAK + b" " + orjson.dumps({"delay": int(delay * 1e9)})


def reply_result(answer: Msg) -> Result:
    """What the server's reply to an ack says."""
    headers = answer.headers
    if headers and headers.get("Status") == "503":
        return _NO_RESPONDERS
    return _OK


def error_result(error: BaseException) -> Result:
    """What a request that got no reply may have done."""
    if isinstance(error, ConnectionLost):
        return Result(Outcome.UNCERTAIN if error.sent else Outcome.ERROR, str(error))
    if isinstance(error, RequestTimeout):
        return Result(Outcome.UNCERTAIN, str(error))
    raise error


async def request_all(
    conn: Connection, subjects: Sequence[str], body: bytes, timeout: float,
    on_result: Callable[[int, Result], None], tail: bytes = b"",
    on_confirmed: Callable[[list[int]], None] | None = None,
) -> bool:
    """One try of ``body`` to every subject, in one write: ``on_result(i, result)`` for
    each as its reply (or its timeout, or the connection's end) comes, every one before
    this returns. ``on_confirmed(indices)``, when given, takes the plain confirmations
    (OK, each) instead, those of one read of the socket in one call. ``tail`` is written
    after the requests, in the same write (a pull request: see ``Puller.ahead``). Returns
    whether a request timed out (the connection is suspect)."""
    if not subjects:
        return False
    left = len(subjects)
    reported = [False] * left
    timed_out = False
    finished: asyncio.Future[None] = conn.loop.create_future()  # (no getpid() per call)

    def done(index: int, outcome: Msg | BaseException) -> None:
        nonlocal left, timed_out
        reported[index] = True
        if isinstance(outcome, BaseException):
            timed_out = timed_out or isinstance(outcome, RequestTimeout)
            on_result(index, error_result(outcome))
        else:
            on_result(index, reply_result(outcome))
        left -= 1
        if left == 0 and not finished.done():
            finished.set_result(None)

    def confirmed(indices: list[int]) -> None:
        nonlocal left
        for index in indices:
            reported[index] = True
        try:
            if on_confirmed is not None:  # (always: only passed on when given)
                on_confirmed(indices)
        finally:  # counted even if it raised: this call ends rather than waits for ever
            left -= len(indices)
            if left == 0 and not finished.done():
                finished.set_result(None)

    try:
        slots = await conn.request_batch([(subject, body) for subject in subjects],
                                         timeout=timeout, on_reply=done, tail=tail,
                                         on_bare=confirmed if on_confirmed else None)
    except ConnectionLost as error:
        unsent = error_result(error)
        for index in range(len(subjects)):
            if not reported[index]:  # (closed while queued: already reported uncertain)
                on_result(index, unsent)
        return False
    try:
        await finished
    finally:
        for slot in slots:
            slot.cancel()  # only those still waiting: when this call was cancelled
    return timed_out
