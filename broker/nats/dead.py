"""Dead letters of a JetStream queue: how one is written, and the burial of the messages the
server's max-deliveries advisories name.

A dead letter is the message's bytes as they arrived, on the queue's dead subject, with
``Nats-Msg-Id: <stream>:<seq>`` (a second burial of the same message within the duplicate
window is dropped by the server), the ``Queue-*`` headers saying why, and the failure record
in ``NATS_HEADER`` (queue 5 ignores them all). The broker buries what runs out of attempts
or cannot be decoded; the operator commands' re-drive (``broker.nats.admin``) reads the same
headers and names its publishes with the same pid token (``header_token``).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from nats.aio.msg import Msg

from broker.base import BrokerError
from broker.failure import NATS_HEADER, Failure
from broker.nats import api
from broker.nats.setup import QueueNames

log = logging.getLogger("broker.nats")

CONTENT_TYPE = "Content-Type"
#: Our supervisors' header naming why a message was dead-lettered.
REASON_HEADER = "Queue-Reason"
#: The deliveries it had when it was dead-lettered (absent when unknown).
ATTEMPTS_HEADER = "Queue-Attempts"
#: Advisories kept for the next burial pass at most (they are rare; this bounds memory).
MAX_EXHAUSTED = 10_000
#: The failure record in a dead letter's header (NATS_HEADER) takes at most this many bytes
#: (ASCII JSON, no line breaks), less when the message leaves less of the server's
#: max_payload (headers count against it): the traceback gives way first.
MAX_FAILURE_HEADER = 16384
#: Bytes of a header block besides its lines ("NATS/1.0\r\n" ... "\r\n"), and slack.
HEADER_BLOCK = 64

#: A JetStream publish, PubAck awaited (subject, data, headers).
Publish = Callable[[str, bytes, dict[str, str]], Awaitable[None]]
#: A JetStream API request (subject, body) and its decoded answer.
Request = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class Burial:
    """Writes one queue's dead letters, through its broker's publish and API calls, and
    keeps the messages the advisories named until a pass buries them."""

    def __init__(self, names: QueueNames, publish: Publish, request: Request,
                 max_payload: Callable[[], Awaitable[int]]) -> None:
        self._names = names
        self._publish = publish
        self._request = request
        self._max_payload = max_payload
        self._exhausted: collections.deque[int] = collections.deque(maxlen=MAX_EXHAUSTED)
        self._burying: asyncio.Future[None] | None = None  # see announced

    def on_advisory(self, msg: Msg) -> None:
        try:
            seq = orjson.loads(msg.data).get("stream_seq")
        except (orjson.JSONDecodeError, AttributeError):
            seq = None
        if isinstance(seq, int) and seq > 0:
            self._exhausted.append(seq)

    def announced(self) -> asyncio.Future[None] | None:
        """The pass over what the advisories named, started unless one runs. Queue 5 drains
        them on every receive; here a receive starts the pass and does not wait for it."""
        if self._burying is None or self._burying.done():
            if not self._exhausted:
                return None
            self._burying = asyncio.ensure_future(self._bury_exhausted_all())
            self._burying.add_done_callback(_log_burial_failure)
        return self._burying

    async def close(self, timeout: float) -> None:
        if self._burying is not None and not self._burying.done():
            # A burial cut short leaves a copy in dead and the original in work: let it end.
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._burying), timeout)
            self._burying.cancel()

    async def _bury_exhausted_all(self) -> None:
        for _ in range(len(self._exhausted)):
            seq = self._exhausted.popleft()
            try:
                await self.bury_exhausted(seq)
            except BrokerError as error:
                log.warning("stream seq %d ran out of deliveries; not dead-lettered yet, "
                            "tried again at the next pass: %s", seq, error)
                self._exhausted.append(seq)
                break

    async def bury_exhausted(self, seq: int) -> None:
        """Copy the stored message to the dead stream (confirmed), then delete it."""
        stream = self._names.stream
        found = await self._request(api.stream_msg_get(stream), {"seq": seq})
        if "error" in found:
            return  # acknowledged, deleted or buried by another worker since the advisory
        stored = found["message"]
        raw = base64.b64decode(stored.get("data") or "")
        content_type = stored_header(stored, CONTENT_TYPE)
        reason = "max deliveries exceeded (server advisory)"
        failure = Failure(error="MaxDeliveriesExceeded", outcome="dead", at=time.time(),
                          message=f"stream seq {seq} of {stream} ran out of deliveries while no "
                                  f"worker held it (each run ended unsettled: a killed worker, "
                                  f"or a release); reported by the server's advisory")
        await self.dead_letter(raw, seq, reason, content_type=content_type, failure=failure)
        deleted = await self._request(api.stream_msg_delete(stream), {"seq": seq})
        if "error" in deleted and deleted["error"].get("code") != 404:
            raise BrokerError(f"dead-lettered, but not deleted: {deleted['error']}")
        log.warning("stream seq %d ran out of deliveries while nobody held it: moved to %s",
                    seq, self._names.dead_stream)

    async def dead_letter(
        self, raw: bytes, seq: int, reason: str, *, delivered: int = 0,
        content_type: str | None = None, failure: Failure | None = None,
    ) -> None:
        """The bytes as they arrived, on the dead subject. Queue 5 copies the Content-Type
        when it parks a message (``content_type``: the original's, when it is kept); the id
        makes a repeated dead-lettering of the same message a no-op (duplicate window); the
        Queue-* headers say why, and NATS_HEADER holds the failure record (queue 5 ignores
        them all)."""
        headers = {"Nats-Msg-Id": f"{self._names.stream}:{seq}"}
        if content_type is not None:
            headers[CONTENT_TYPE] = content_type
        if delivered:
            headers[ATTEMPTS_HEADER] = str(delivered)
        if reason:
            headers[REASON_HEADER] = header_value(reason)
        if failure is not None:
            record = await self._failure_header(failure, raw, headers)
            if record is not None:
                headers[NATS_HEADER] = record
        await self._publish(self._names.dead_subject, raw, headers)

    async def _failure_header(
        self, failure: Failure, raw: bytes, headers: dict[str, str]
    ) -> str | None:
        """The failure record as one header value, in what the server's max_payload leaves
        beside the message and the other headers (a larger message would be refused, and
        the connection with it). None (logged) when not even the error class fits."""
        max_payload = await self._max_payload()
        used = len(raw) + HEADER_BLOCK + sum(len(k) + len(v) + 4 for k, v in headers.items())
        room = min(MAX_FAILURE_HEADER, max_payload - used - len(NATS_HEADER) - 4)
        try:
            return failure.encode_within(room, ascii=True).decode("ascii")
        except ValueError:
            log.warning("stream seq %d dead-lettered without its failure record (%s): the "
                        "message leaves no room for it under the server's max_payload",
                        receipt_seq(headers), failure.summary)
            return None


def _log_burial_failure(task: asyncio.Future[None]) -> None:
    """A pass no maintain() awaited must not fail unseen."""
    if not task.cancelled() and task.exception() is not None:
        log.error("burying exhausted deliveries failed; tried again at the next pass: %r",
                  task.exception())


def stored_header(stored: dict[str, Any], name: str) -> str | None:
    """One header of a message read with STREAM.MSG.GET (NATS/1.0 header block, base64)."""
    block = base64.b64decode(stored.get("hdrs") or "").decode("utf-8", "replace")
    for line in block.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def parse_headers(block: bytes) -> dict[str, str]:
    """A ``NATS/1.0`` header block as UTF-8 (the first value of a repeated name)."""
    headers: dict[str, str] = {}
    for line in block.decode("utf-8", "replace").split("\r\n")[1:]:
        name, colon, value = line.partition(":")
        if colon and name.strip():
            headers.setdefault(name.strip(), value.strip())
    return headers


def header_token(pid: str) -> str:
    """The pid as queue 5 puts it in a message id, unless it could not be a header value
    (control characters, spaces, too long): then a digest that is still one per pid."""
    if 0 < len(pid) <= 256 and pid.isascii() and pid.isprintable() and " " not in pid:
        return pid
    return "sha256-" + hashlib.sha256(pid.encode("utf-8", "surrogatepass")).hexdigest()


def receipt_seq(headers: dict[str, str]) -> str:
    """The stream seq a dead letter's id names ("<stream>:<seq>"), for a log line."""
    return headers.get("Nats-Msg-Id", "").rpartition(":")[2] or "?"


def header_value(text: str) -> str:
    return " ".join(text.split())[:1024]
