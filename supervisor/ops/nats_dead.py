"""``failed`` / ``dead`` on NATS: the dead stream ``Q_<NAME>_DEAD`` (subject ``q.<name>.dead``).

JetStream has one place for jobs that stopped retrying: the supervisor (and a queue-5 PHP
worker) publishes them to the dead subject. Messages are read one by one with
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

Naming a pid scans the dead stream (one request per message), as does ``--all``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from nats.js.errors import APIError, NotFoundError

from broker import envelope
from broker.base import BrokerError
from broker.failure import NATS_HEADER
from broker.nats import api
from broker.nats.dead import header_token
from broker.nats.setup import QueueNames
from supervisor.config import Config
from supervisor.ops.jobs import Job, read_failure
from supervisor.ops.nats_status import connected

#: Seconds for each JetStream API call and publish.
REQUEST_TIMEOUT = 5.0
#: Our supervisors' header naming why a message was dead-lettered (``broker.nats.broker``).
REASON_HEADER = "Queue-Reason"
ATTEMPTS_HEADER = "Queue-Attempts"
CONTENT_TYPE = "Content-Type"
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
        named = {name(letter.job) for letter in found} | {letter.job.pid for letter in found}
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
async def dead_stream(config: Config, command: str) -> AsyncIterator[DeadStream]:
    async with connected(config, command) as client:
        yield DeadStream(client, QueueNames.of(config.job.queue))


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


def parse_headers(block: bytes) -> dict[str, str]:
    """A ``NATS/1.0`` header block as UTF-8 (the first value of a repeated name)."""
    headers: dict[str, str] = {}
    for line in block.decode("utf-8", "replace").split("\r\n")[1:]:
        name, colon, value = line.partition(":")
        if colon and name.strip():
            headers.setdefault(name.strip(), value.strip())
    return headers


def _unix(stamp: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp() if stamp else None
    except (TypeError, ValueError):
        return None
