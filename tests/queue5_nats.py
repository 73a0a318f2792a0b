"""A queue-5 NATS worker (appwrite/appwrite ``packages/queue/src/Broker/Nats.php``), modelled
from the facts for the mixed-fleet tests: it uses the stream and consumer exactly as queue 5
configures and reads them, with nats-py for the wire.

What it does, per the facts (versions N1-N3):
- provisioning: ``ensure`` creates or rewrites (N2/N3: MaxDeliver = max_deliver + 1 with
  the ``utopia_queue_spare_delivery`` mark, ack wait 30 s; N2 also the key subjects);
  ``adopt`` (require mode) reads the spare delivery from the consumer and changes nothing;
- receive: the advisory drained first (get by stream seq, publish to dead, delete); fetch 1
  (blocking), then a short top-up; a delivery at the spare, or one that does not decode
  to an object with pid, queue and timestamp, is parked: published to dead with only its
  Content-Type, then TERM; attempts = num_delivered - 1;
- commit: a confirmed ack; reject: terminal or num_delivered >= max_deliver (its own
  setting, not the consumer's) -> raw bytes to dead without headers, then TERM; otherwise
  NAK (backoff[num_delivered - 1] when configured); extend: +WPI;
- release: N3 republishes under ``<pid>.released.<seq>`` and acks (a NAK delayed 5 s on a
  bounded stream); N1/N2 NAK with the 5 s delay.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any

import nats
import orjson
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from broker.nats.setup import QueueNames

SPARE = "utopia_queue_spare_delivery"
ADVISORY_GROUP = "utopia_queue_dead_letter"


@dataclass
class Job:
    """One delivery as the PHP handler sees it."""

    pid: str
    attempts: int
    payload: Any
    msg: Msg


class Queue5NatsWorker:
    def __init__(self, url: str, queue: str, *, max_deliver: int = 5, ack_wait: float = 30.0,
                 release: str = "republish", namespace: str = "utopia-queue") -> None:
        self.url, self.queue, self.names = url, queue, QueueNames.of(queue)
        self.max_deliver, self.ack_wait, self.release_mode = max_deliver, ack_wait, release
        self.identity = f"{len(namespace)}:{namespace}:{queue}"
        self.spare: int | None = None
        self.bounded = False
        self.parked: list[str] = []  # reasons, for the tests
        self.thrown: list[dict[str, Any]] = []  # envelopes new Message() threw on

    async def connect(self, mode: str = "ensure") -> Queue5NatsWorker:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        if mode == "ensure":
            await self._provision()
        await self._adopt()
        self.advisories = await self.nc.subscribe(self.names.advisory_subject,
                                                  queue=ADVISORY_GROUP)
        self.sub = await self.js.pull_subscribe_bind("worker", stream=self.names.stream)
        return self

    async def close(self) -> None:
        """Gone without settling anything it holds, as a killed worker."""
        with contextlib.suppress(Exception):
            await self.nc.close()

    async def _provision(self) -> None:
        """Ensure mode: createOrUpdate both streams, create/rewrite the consumer (N3)."""
        work = StreamConfig(
            name=self.names.stream, subjects=[self.names.subject],
            retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE, num_replicas=1,
            duplicate_window=120, metadata={"utopia_queue_identity": self.identity})
        dead = StreamConfig(
            name=self.names.dead_stream, subjects=[self.names.dead_subject],
            retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
            metadata={"utopia_queue_identity": self.identity})
        for config in (work, dead):
            try:
                await self.js.stream_info(config.name)
            except NotFoundError:
                await self.js.add_stream(config)
            else:
                await self.js.update_stream(config)
        await self.js.add_consumer(self.names.stream, ConsumerConfig(
            durable_name="worker", ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait,
            max_deliver=self.max_deliver + 1, filter_subjects=[self.names.subject],
            metadata={SPARE: "1"}))

    async def _adopt(self) -> None:
        config = (await self.js.consumer_info(self.names.stream, "worker")).config
        allowed = config.max_deliver or -1
        self.spare = allowed if (config.metadata or {}).get(SPARE) and allowed >= 1 else None
        stream = (await self.js.stream_info(self.names.stream)).config
        self.bounded = any((getattr(stream, limit) or -1) > 0
                           for limit in ("max_msgs", "max_bytes"))

    async def receive(self, n: int = 10,
                      timeout: float = 1.0,  # noqa: ASYNC109 - the fetch's own, as queue5's
                      ) -> list[Job]:
        await self._drain_dead_letters()
        try:
            msgs = await self.sub.fetch(1, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        if n > 1:
            with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                msgs += await self.sub.fetch(n - 1, timeout=0.25)
        jobs = []
        for msg in msgs:
            delivered = msg.metadata.num_delivered
            if self.spare is not None and delivered >= self.spare:
                await self._adopt()  # shared consumer: re-read before parking
                if self.spare is not None and delivered >= self.spare:
                    await self._park(msg, "max deliveries exceeded")
                    continue
            try:
                data = orjson.loads(msg.data)
            except orjson.JSONDecodeError:
                data = None
            if not isinstance(data, dict) or any(
                    data.get(k) is None for k in ("pid", "queue", "timestamp")):
                await self._park(msg, "payload could not be decoded")
                continue
            if not constructs_message(data):
                # new Message() throws out of pull(): this delivery and the rest of the
                # batch are left unacknowledged (redelivered after ack_wait, dead-lettered
                # by the max-deliveries advisory at the end), none of them runs.
                self.thrown.append(data)
                return []
            jobs.append(Job(data["pid"], max(0, delivered - 1), data.get("payload"), msg))
        return jobs

    async def _park(self, msg: Msg, reason: str) -> None:
        headers = {}
        if (msg.headers or {}).get("Content-Type") is not None:
            headers["Content-Type"] = msg.headers["Content-Type"]
        await self.js.publish(self.names.dead_subject, msg.data, headers=headers or None)
        await msg.term()
        self.parked.append(reason)

    async def _drain_dead_letters(self) -> None:
        while True:
            try:
                event = await self.advisories.next_msg(timeout=0.001)
            except (TimeoutError, nats.errors.TimeoutError):
                return
            seq = orjson.loads(event.data).get("stream_seq")
            with contextlib.suppress(NotFoundError):
                stored = await self.js.get_msg(self.names.stream, seq)
                await self.js.publish(self.names.dead_subject, stored.data)
                await self.js.delete_msg(self.names.stream, seq)

    async def commit(self, job: Job) -> None:
        await job.msg.ack_sync()

    async def reject(self, job: Job, terminal: bool = False) -> None:
        if terminal or job.msg.metadata.num_delivered >= self.max_deliver:
            await self.js.publish(self.names.dead_subject, job.msg.data)
            await job.msg.term()
        else:
            await job.msg.nak()

    async def extend(self, job: Job) -> None:
        await job.msg.in_progress()

    async def release(self, job: Job) -> None:
        if self.release_mode == "republish" and not self.bounded:
            seq = job.msg.metadata.sequence.stream
            await self.js.publish(
                job.msg.subject, job.msg.data,
                headers={"Nats-Msg-Id": f"{job.pid}.released.{seq}",
                         "Content-Type": "application/json"})
            await job.msg.ack_sync()
        else:
            await job.msg.nak(delay=5)

    async def retry(self, limit: int = 500) -> int:
        """Dead letters back to work (queue 5's retry(): a ``retry`` durable on dead)."""
        await self.js.add_consumer(self.names.dead_stream, ConsumerConfig(
            durable_name="retry", ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait,
            filter_subject=self.names.dead_subject))
        sub = await self.js.pull_subscribe_bind("retry", stream=self.names.dead_stream)
        moved = 0
        while moved < limit:
            try:
                [msg] = await sub.fetch(1, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            await self.js.publish(self.names.subject, msg.data)
            await msg.ack_sync()
            moved += 1
        return moved


# PHP's numeric strings: whitespace, sign, digits with an optional fraction, exponent.
_NUMERIC = re.compile(r"[ \t\n\r\v\f]*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?"
                      r"[ \t\n\r\v\f]*")
_INTEGER = re.compile(r"[ \t\n\r\v\f]*[+-]?[0-9]+[ \t\n\r\v\f]*")


def _takes_int(value: Any) -> bool:
    """An ``int`` property in PHP's weak mode (Message.php has no strict_types) takes it."""
    if isinstance(value, str):
        if _INTEGER.fullmatch(value) and -(2**63) <= int(value) < 2**63:
            return True
        return bool(_NUMERIC.fullmatch(value)) and _takes_int(float(value))
    if isinstance(value, bool):
        return True
    if isinstance(value, int):  # JSON integers past 64 bits are doubles in PHP
        return -(2**63) <= value < 2**63 or _takes_int(float(value))
    return isinstance(value, float) and math.isfinite(value) and -(2.0**63) <= value < 2.0**63


def constructs_message(data: dict[str, Any]) -> bool:
    """``new Message($data)`` returns (pull() casts nothing first): pid and queue scalars,
    timestamp, attempts and sequence what an int property takes, payload an array."""
    scalar = (str, int, float, bool)
    return (isinstance(data["pid"], scalar) and isinstance(data["queue"], scalar)
            and _takes_int(data["timestamp"])
            and isinstance(data.get("payload") or [], dict | list)
            and (data.get("attempts") is None or _takes_int(data["attempts"]))
            and (data.get("sequence") is None or _takes_int(data["sequence"])))


async def php_queue(js: Any, *, max_deliver: int, spare: bool, ack_wait: float = 30,
                    keyed: bool = False, backoff: list[float] | None = None,
                    stream: dict | None = None, queue: str = "stats-usage") -> None:
    """The stream and consumer as a queue-5 worker provisions them (N1: MaxDeliver 5,
    one subject; N2: spare delivery and key subjects; N3: spare delivery), set up ahead
    of a test through the JetStream context ``js``."""
    names = QueueNames.of(queue)
    subjects = [names.subject, names.subject + ".*"] if keyed else [names.subject]
    await js.add_stream(StreamConfig(
        name=names.stream, subjects=subjects, retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, duplicate_window=120,
        metadata={"utopia_queue_identity": f"12:utopia-queue:{queue}"}, **(stream or {})))
    await js.add_stream(StreamConfig(
        name=names.dead_stream, subjects=[names.dead_subject],
        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
    config = ConsumerConfig(
        durable_name="worker", ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait,
        max_deliver=max_deliver, backoff=backoff,
        metadata={"utopia_queue_spare_delivery": "1"} if spare else None)
    if keyed:
        config.filter_subjects = subjects
    else:
        config.filter_subject = names.subject
    await js.add_consumer(names.stream, config)
