"""What the operator commands and the dashboard read and write of a NATS JetStream queue: the
admin connection, the queue's figures (stream, dead stream, consumer) and its dead letters.

Nothing is created here (unlike the broker's connect, which creates what is missing): a
stream or consumer that does not exist is reported as absent. Bounded: an unreachable
server is one quick try (nats-py alone would try 60 times, 2 s apart), a silent one (a port
that accepts and never speaks) ``CONNECT_TIMEOUT``; either ends in a ``BrokerError`` naming
the server (with a hint when a TLS server seems to want a client certificate).

The dead stream ``Q_<NAME>_DEAD`` (subject ``q.<name>.dead``) is JetStream's one place for
jobs that stopped retrying: the supervisor (``broker.nats.dead``) and a queue-5 PHP worker
publish them to the dead subject. Messages are read one by one with
``STREAM.MSG.GET`` (next by subject from a sequence), oldest first; a job's "pid" is its
envelope's. The failure record is the ``broker.failure.NATS_HEADER`` header when the
supervisor that buried it wrote one (a PHP worker writes none; the ``Queue-Reason`` header
of older supervisors is shown instead).

``retry`` is queue 5's dead-to-work move: publish the envelope, unchanged, to the work
subject and wait for the stream's acknowledgement, *then* delete the dead letter. Killed in
between, the job is in both streams: at worst it runs twice, it is never lost. The publish
carries ``Nats-Msg-Id: <pid>.redrive.<dead seq>``, so a second retry of the same dead letter
within the work stream's duplicate window (120 s) is dropped by the server: only a retry
repeated after that window, of a dead letter whose delete was lost, runs the job twice.
The new message starts at attempt 1 (JetStream counts deliveries), as ``--reset-attempts``.

Naming a pid scans the dead stream (one request per message), as does ``--all``. The
operator commands (``supervisor.ops``) and the dashboard print what these read.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from nats.js.errors import APIError, NotFoundError

from broker import envelope, errors
from broker.base import BrokerError
from broker.failure import NATS_HEADER
from broker.nats import api, presence
from broker.nats import tls as nats_tls
from broker.nats.conn import quiet_error, refusal
from broker.nats.dead import (
    ATTEMPTS_HEADER,
    CONTENT_TYPE,
    REASON_HEADER,
    header_token,
    parse_headers,
)
from broker.nats.setup import IDENTITY, QueueNames, identity, read_consumer_policy
from broker.nats.tls import tls_options
from broker.stopped import Job, read_failure
from broker.tls import TlsSettings
from broker.urls import redact

#: Seconds for one server to accept the connection and say INFO.
CONNECT_TIMEOUT = 3.0
#: Seconds for a whole status read: connecting (each server of a list) and three API calls.
STATUS_TIMEOUT = 10.0
#: Seconds for each JetStream API call and publish.
REQUEST_TIMEOUT = 5.0
#: JetStream's error code for STREAM.MSG.DELETE of a sequence that holds no message.
NO_MESSAGE_FOUND = 10057


@dataclass(slots=True)
class Letter:
    job: Job
    headers: dict[str, str]


@dataclass(slots=True)
class Moved:
    """What a delete or retry did, by pid (``seq:N`` for a dead letter without one)."""

    done: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # named or selected, gone meanwhile
    malformed: list[str] = field(default_factory=list)  # retry: no envelope to publish
    duplicates: int = 0  # retry: the work stream already had this re-drive (msg id)

    def as_dict(self, done: str) -> dict[str, Any]:
        """As Redis reports it (``done``: "moved" or "deleted"), plus what NATS adds."""
        return {done: len(self.done), "pids": self.done, "missing": self.missing,
                "malformed": len(self.malformed), "undecodable": self.malformed,
                "duplicates": self.duplicates}


class DeadStream:
    """The queue's dead stream, on one connection."""

    def __init__(self, client: Any, names: QueueNames) -> None:
        self.client, self.names = client, names
        self.js = client.jetstream(timeout=REQUEST_TIMEOUT)

    async def info(self) -> Any:
        try:
            return await self.js.stream_info(self.names.dead_stream)
        except NotFoundError:
            return None

    async def total(self) -> int:
        info = await self.info()
        return info.state.messages if info else 0

    async def letters(self, limit: int | None = None, after: int = 0
                      ) -> AsyncIterator[Letter]:
        """Oldest first (from the first sequence past ``after``: a page), up to ``limit``,
        and only those stored when this began."""
        info = await self.info()
        if info is None:
            return
        seq, last, count = max(info.state.first_seq, after + 1), info.state.last_seq, 0
        while seq <= last and (limit is None or count < limit):
            letter = await self.get(seq, nearest=True)
            if letter is None or (letter.job.seq or 0) > last:
                return
            yield letter
            count += 1
            seq = (letter.job.seq or seq) + 1

    async def get(self, seq: int, nearest: bool = False) -> Letter | None:
        """The dead letter at ``seq`` (``nearest``: the first from there), or None.

        A plain STREAM.MSG.GET, its headers parsed here: nats-py's parser (an email parser)
        mangles header values that are not ASCII, as a failure record's message may be."""
        body: dict[str, Any] = {"seq": seq}
        if nearest:
            body["next_by_subj"] = self.names.dead_subject
        reply = await self.client.request(api.stream_msg_get(self.names.dead_stream),
                                          orjson.dumps(body), timeout=REQUEST_TIMEOUT)
        try:
            answer = orjson.loads(reply.data)
        except orjson.JSONDecodeError:
            raise BrokerError(f"unexpected JetStream reply reading {self.names.dead_stream} "
                              f"seq {seq}: {reply.data[:200]!r}") from None
        error = answer.get("error")
        if error and error.get("code") == 404:
            return None
        if error:
            raise BrokerError(f"reading {self.names.dead_stream} seq {seq}: "
                              f"{error.get('description')} (code {error.get('code')})")
        return _letter(answer["message"])

    async def find(self, selectors: Sequence[str], depth: int | None = None
                   ) -> tuple[list[Letter], list[str]]:
        """The dead letters named by pid (every copy) or ``seq:N``; the selectors that
        named none. A pid is looked for in the oldest ``depth`` letters (None: all)."""
        seqs = {int(s[4:]) for s in selectors if is_seq(s)}
        pids = {s for s in selectors if not is_seq(s)}
        found: list[Letter] = []
        for seq in sorted(seqs):
            letter = await self.get(seq)
            if letter is not None:
                found.append(letter)
        if pids:
            async for letter in self.letters(depth):
                if letter.job.pid in pids and letter.job.seq not in seqs:
                    found.append(letter)
        # a letter found by seq:N is named by it even when it has a pid
        named = ({f"seq:{letter.job.seq}" for letter in found}
                 | {letter.job.pid for letter in found})
        return found, [s for s in selectors if s not in named]

    async def delete(self, letter: Letter) -> bool:
        """Delete it; False if it was gone already (deleted or re-driven by someone else)."""
        try:
            return bool(await self.js.delete_msg(self.names.dead_stream, letter.job.seq))
        except NotFoundError:
            return False
        except APIError as error:  # the server answers a deleted sequence with a 500
            if error.err_code == NO_MESSAGE_FOUND:
                return False
            raise

    async def redrive(self, letter: Letter) -> bool | None:
        """Publish it to the work subject (acknowledged), then delete the dead letter.
        None: it was gone before the publish; False: the server had the re-drive already
        (a duplicate id: another retry of it within the duplicate window)."""
        if await self.get(letter.job.seq or 0) is None:
            return None  # deleted or re-driven meanwhile: nothing to publish
        ack = await self.publish(letter)
        await self.delete(letter)
        return not ack.duplicate

    async def publish(self, letter: Letter) -> Any:
        headers = {"Nats-Msg-Id": f"{header_token(letter.job.pid)}.redrive.{letter.job.seq}",
                   CONTENT_TYPE: letter.headers.get(CONTENT_TYPE, "application/json")}
        return await self.js.publish(self.names.subject, letter.job.raw or b"",
                                     timeout=REQUEST_TIMEOUT, stream=self.names.stream,
                                     headers=headers)


async def retry(stream: DeadStream, letter: Letter, report: Moved, dry_run: bool = False
                ) -> None:
    """``dead retry``'s step for one dead letter (the dashboard's retry too): re-driven, or
    counted as malformed (no pid: no handler could take it either) or missing."""
    named = name(letter.job)
    if not letter.job.pid:
        report.malformed.append(named)
        return
    if dry_run:
        report.done.append(named)
        return
    outcome = await stream.redrive(letter)
    if outcome is None:
        report.missing.append(named)
        return
    report.done.append(named)
    report.duplicates += outcome is False


async def remove(stream: DeadStream, letter: Letter, report: Moved, dry_run: bool = False
                 ) -> None:
    """``dead delete``'s step for one dead letter (the dashboard's delete too)."""
    gone = not dry_run and not await stream.delete(letter)
    (report.missing if gone else report.done).append(name(letter.job))


@contextlib.asynccontextmanager
async def dead_stream(url: str, tls: TlsSettings, queue: str, command: str
                      ) -> AsyncIterator[DeadStream]:
    async with connected(url, tls, f"queue-supervisor {command} {queue}") as client:
        yield DeadStream(client, QueueNames.of(queue))


def is_seq(selector: str) -> bool:
    return selector.startswith("seq:") and selector[4:].isdecimal()


def name(job: Job) -> str:
    """How the output names a dead letter: its pid, else its sequence."""
    return job.pid or f"seq:{job.seq}"


def _letter(stored: dict[str, Any]) -> Letter:
    """A STREAM.MSG.GET answer's message: data and headers base64, time RFC 3339."""
    raw = base64.b64decode(stored.get("data") or "")
    headers = parse_headers(base64.b64decode(stored.get("hdrs") or ""))
    try:
        pid = envelope.decode_nats(raw, None)["pid"]
    except (envelope.MalformedEnvelope, ValueError):
        pid = ""
    failure, note = read_failure(headers[NATS_HEADER].encode()
                                 if NATS_HEADER in headers else None)
    if failure is None and not note and headers.get(REASON_HEADER):
        note = headers[REASON_HEADER]
    attempts = headers.get(ATTEMPTS_HEADER, "")
    return Letter(Job(pid=pid, raw=raw, size=len(raw), failure=failure, failure_note=note,
                      seq=stored.get("seq"), stored_at=_unix(stored.get("time")),
                      deliveries=int(attempts) if attempts.isdecimal() else None), headers)


def _unix(stamp: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp() if stamp else None
    except (TypeError, ValueError):
        return None


# -- the admin connection ---------------------------------------------------------------------


async def connect(url: str, tls: TlsSettings, name: str) -> Any:
    """A nats-py client of ``url`` (the caller closes it): one quick try per server, a
    ``BrokerError`` saying where and why when none answers."""
    options = tls_options(url, tls)
    try:
        return await nats_tls.connect(
            url, connect_timeout=CONNECT_TIMEOUT, allow_reconnect=False,
            # nats-py retries a refused server 60 times 2 s apart, reconnects or not.
            max_reconnect_attempts=1, reconnect_time_wait=0.1,
            name=name, error_cb=quiet_error, **options,
        )
    except Exception as error:  # whatever nats-py raises: say where, and why if we know
        refused = refusal(url, error)
        if refused is not None:
            raise refused from error
        hint = tls.hint(error) if options else ""
        raise BrokerError(
            f"cannot reach NATS at {redact(url)}: {_describe(error)}{hint}"
        ) from error


@contextlib.asynccontextmanager
async def connected(url: str, tls: TlsSettings, name: str) -> AsyncIterator[Any]:
    """``connect``, closed afterwards."""
    client = await connect(url, tls, name)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def answering_within(url: str, seconds: float) -> AsyncIterator[None]:
    """The body, given ``seconds`` in all: longer ends in a ``BrokerError`` naming the server."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise BrokerError(f"NATS at {redact(url)} did not answer within {seconds:g}s") from None


def silent_jetstream(url: str) -> BrokerError:
    return BrokerError(f"NATS at {redact(url)} took the connection, but its "
                       f"JetStream API did not answer within {CONNECT_TIMEOUT:g}s (no "
                       f"JetStream on that server, or a cluster without a leader)")


def _describe(error: BaseException) -> str:
    """As everywhere (``broker.errors.describe``), but a connect timeout says how long."""
    if isinstance(error, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT:g}s"
    return errors.describe(error)


# -- the queue's figures ----------------------------------------------------------------------


@dataclass(slots=True)
class QueueInfo:
    """What JetStream says of one queue: its stream, dead stream and consumer info (each
    None when absent)."""

    names: QueueNames
    work: Any
    dead: Any
    consumer: Any

    def counts(self, max_attempts: int) -> dict[str, Any]:
        """What ``status`` and the dashboard show of the queue."""
        work, dead, consumer = self.work, self.dead, self.consumer
        return {
            "stream": self.names.stream if work else None,
            "messages": work.state.messages if work else 0,
            "ready": consumer.num_pending if consumer else 0,
            "processing": consumer.num_ack_pending if consumer else 0,
            "redelivered": consumer.num_redelivered if consumer else 0,
            "waiting_pulls": consumer.num_waiting if consumer else 0,
            "dead": dead.state.messages if dead else 0,
            "consumer": _consumer_settings(consumer, max_attempts),
        }

    @property
    def acknowledged(self) -> int:
        """The consumer's acknowledged deliveries so far (its ack floor)."""
        consumer = self.consumer
        return consumer.ack_floor.consumer_seq if consumer and consumer.ack_floor else 0


async def read_queue(js: Any, names: QueueNames) -> QueueInfo:
    """The stream, dead stream and consumer info, in that order (absent: None)."""
    work = await stream_info(js, names.stream)
    dead = await stream_info(js, names.dead_stream)
    return QueueInfo(names, work, dead, await consumer_info(js, names))


async def queue_status(client: Any, url: str, queue: str, namespace: str,
                       max_attempts: int) -> dict[str, Any]:
    """What ``status`` shows of the queue (JetStream's part of it)."""
    names = QueueNames.of(queue)
    try:
        js = client.jetstream(timeout=CONNECT_TIMEOUT)
        info = await read_queue(js, names)
        earlier = await earlier_stream(js, queue, namespace)
    except TimeoutError:
        raise silent_jetstream(url) from None
    return {"queue": queue, "broker": "nats", **info.counts(max_attempts),
            "earlier_stream": earlier}


async def alive(url: str, tls: TlsSettings, queue: str, max_attempts: int,
                wait: float = presence.WAIT) -> tuple[list[str], dict[str, Any]]:
    """For ``check`` and ``drain``: the supervisors of ours that answered (``"host pid"``,
    ``broker.nats.presence``) and the consumer's figures, which count every worker."""
    async with answering_within(url, STATUS_TIMEOUT + wait):
        names = QueueNames.of(queue)
        async with connected(url, tls, f"queue-supervisor check {queue}") as client:
            answered = await presence.ask(client, names.stream, wait)
            try:
                js = client.jetstream(timeout=CONNECT_TIMEOUT)
                figures = (await read_queue(js, names)).counts(max_attempts)
            except TimeoutError:
                raise silent_jetstream(url) from None
        return answered, figures


async def earlier_stream(js: Any, queue: str, namespace: str) -> dict[str, Any] | None:
    """This queue's stream under the name an earlier release gave a non-ASCII queue (a
    start refuses while it exists): its name and message count, else None."""
    old = QueueNames.legacy(queue)
    info = await stream_info(js, old.stream) if old else None
    if old is None or info is None:
        return None
    if (info.config.metadata or {}).get(IDENTITY) != identity(namespace, queue):
        return None  # another queue's own stream ("caf_" has Q_CAF_)
    return {"name": old.stream, "messages": info.state.messages}


async def stream_info(js: Any, name: str) -> Any:
    try:
        return await js.stream_info(name)
    except NotFoundError:
        return None


async def consumer_info(js: Any, names: QueueNames) -> Any:
    try:
        return await js.consumer_info(names.stream, names.consumer)
    except NotFoundError:
        return None


def _consumer_settings(consumer: Any, max_attempts: int) -> dict[str, Any] | None:
    if consumer is None:
        return None
    budget, spare = read_consumer_policy(
        {"max_deliver": consumer.config.max_deliver, "metadata": consumer.config.metadata},
        max_attempts)
    return {
        "name": consumer.name,
        "ack_wait": consumer.config.ack_wait,
        "max_deliver": consumer.config.max_deliver,
        "attempts": budget,  # as the supervisor reads the consumer (queue 5's rules)
        "spare_delivery": spare,
    }
