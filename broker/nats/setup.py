"""JetStream names of a queue, and adopting (or creating) its streams and consumer.

Names (queue 5's): stream ``Q_<NAME>`` (upper-cased, every *byte* of the UTF-8 name outside
``A-Za-z0-9_-`` becomes ``_``, as PHP's ``preg_replace`` without ``/u``: ``café`` is
``Q_CAF__``) on subject ``q.<name>.normal`` and, for coalescing keys,
``q.<name>.normal.<hex>``; durable pull consumer ``worker``; dead letters to
``q.<name>.dead`` in stream ``Q_<NAME>_DEAD``.

PHP queue-5 workers and this supervisor share a queue, so whoever comes first creates it
and the other **adopts** what it finds: the attempt budget is read from the consumer (its
MaxDeliver, and queue 5's ``utopia_queue_spare_delivery`` metadata that marks one delivery
kept back for dead-lettering), its ack wait and backoff are used as they are. Nothing that
exists is ever rewritten. Only settings under which sharing would be unsafe are refused,
with the setting named: a stream that does not remove acknowledged messages, a consumer
that is not an explicit-ack pull consumer, filters or stream subjects that are not this
queue's, a stream that another queue identity owns.

What is missing is created as queue 5's newest lines create it: both work subjects,
duplicate window 120 s, the queue identity in the stream metadata; the consumer with
MaxDeliver = ``max_attempts`` + 1 and the spare-delivery mark. One deliberate difference:
no ``max_age`` on the work stream (queue 5 sets its job TTL there), because a job nobody
consumed in time would then vanish unhandled.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import orjson

from broker.base import BrokerError
from broker.nats import api
from broker.nats.conn import Connection
from broker.nats.link import NotReady

log = logging.getLogger("broker.nats")

CONSUMER = "worker"
MAX_STREAM_NAME = 255
#: Consumer metadata queue 5 writes when MaxDeliver includes one spare delivery.
SPARE_DELIVERY = "utopia_queue_spare_delivery"
#: Stream metadata naming the queue that owns a stream ("<len(ns)>:<ns>:<name>").
IDENTITY = "utopia_queue_identity"
#: Queue 5's duplicate window for message ids (seconds).
DUPLICATE_WINDOW = 120.0
#: Queue 5 replaces bytes, not characters (its pattern has no /u): matched on the UTF-8 bytes.
_UNSAFE = re.compile(rb"[^A-Za-z0-9_-]")
#: What an earlier release replaced instead: characters (see ``QueueNames.legacy``).
_UNSAFE_CHARACTER = re.compile(r"[^A-Za-z0-9_-]")
_NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class QueueNames:
    stream: str
    subject: str
    dead_stream: str
    dead_subject: str
    consumer: str = CONSUMER

    @classmethod
    def of(cls, queue: str) -> QueueNames:
        return cls._named(queue, token(queue))

    @classmethod
    def legacy(cls, queue: str) -> QueueNames | None:
        """The names this supervisor used before it followed queue 5 byte for byte (one
        ``_`` per character): None where they are the same (an ASCII name)."""
        old = _UNSAFE_CHARACTER.sub("_", queue)
        return None if old == token(queue) else cls._named(queue, old)

    @classmethod
    def _named(cls, queue: str, safe: str) -> QueueNames:
        if not safe:
            raise ValueError("queue name is empty")
        names = cls(
            stream=f"Q_{safe.upper()}", subject=f"q.{safe.lower()}.normal",
            dead_stream=f"Q_{safe.upper()}_DEAD", dead_subject=f"q.{safe.lower()}.dead",
        )
        if len(names.dead_stream) > MAX_STREAM_NAME:
            raise ValueError(f"queue name {queue!r} is too long for a JetStream stream name: "
                             f"its dead stream's name would be {len(names.dead_stream)} bytes (at "
                             f"most {MAX_STREAM_NAME}; each byte of a non-ASCII character "
                             f"counts)")
        return names

    @property
    def keyed_subject(self) -> str:
        """Queue 5's subjects for coalescing keys (``<subject>.<hex(key)>``)."""
        return f"{self.subject}.*"

    @property
    def work_subjects(self) -> list[str]:
        return [self.subject, self.keyed_subject]

    @property
    def next_subject(self) -> str:
        """Where pull requests for the consumer go."""
        return api.consumer_next(self.stream, self.consumer)

    @property
    def advisory_subject(self) -> str:
        """Where the server announces deliveries that ran out of MaxDeliver."""
        return api.max_deliveries_advisory(self.stream)


def token(queue: str) -> str:
    """Queue 5's ``streamToken``/``subjectToken`` before the case change: ASCII only, so
    ``upper``/``lower`` change ASCII letters alone, as PHP 8's locale-free functions do."""
    raw = queue.encode("utf-8", "surrogatepass")
    return _UNSAFE.sub(b"_", raw).decode("ascii")


def identity(namespace: str, queue: str) -> str:
    """Queue 5's queue identity, kept in the stream metadata."""
    return f"{len(namespace.encode())}:{namespace}:{queue}"


@dataclass(frozen=True, slots=True)
class Wanted:
    """What this supervisor creates when the queue's streams or consumer are missing."""

    ack_wait: float  # seconds
    max_attempts: int  # handler runs before the dead letter
    identity: str
    job_ttl: float = 0.0  # seconds dead letters are kept; 0 = forever
    replicas: int = 1  # num_replicas of the streams we create (a JetStream cluster: up to 5)


@dataclass(frozen=True, slots=True)
class Adopted:
    """The settings of the queue as found (or made): what the broker works by."""

    budget: int  # a rejected delivery with num_delivered >= budget is dead-lettered
    spare: int | None  # a delivery with num_delivered >= spare is dead-lettered on arrival
    max_deliver: int  # the consumer's MaxDeliver (-1 = unlimited)
    ack_wait: float  # the consumer's, seconds
    backoff: tuple[float, ...] = ()  # the consumer's redelivery delays, seconds
    bounded: bool = False  # the work stream has size limits (release must not republish)
    replicas: int = 1  # the work stream's num_replicas, as found

    @property
    def lease(self) -> float:
        """How long an unrenewed delivery stays ours: the shortest wait the server uses."""
        return min((self.ack_wait, *self.backoff))

    def describe(self) -> str:
        spare = f", delivery {self.spare} dead-lettered on arrival" if self.spare else ""
        backoff = f", backoff {list(self.backoff)}s" if self.backoff else ""
        replicas = f", {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"{self.budget} attempts (MaxDeliver {self.max_deliver}{spare}), "
                f"ack_wait {self.ack_wait:g}s{backoff}{replicas}")


async def adopt_queue(
    conn: Connection, names: QueueNames, wanted: Wanted, timeout: float
) -> Adopted:
    """Create what is missing; adopt what exists; raise BrokerError where sharing is unsafe."""
    jetstream = _Api(conn, timeout)
    work = await jetstream.stream(names.stream, {
        "name": names.stream, "subjects": names.work_subjects, "retention": "workqueue",
        "storage": "file", "num_replicas": wanted.replicas,
        "duplicate_window": int(DUPLICATE_WINDOW * _NS),
        "metadata": {IDENTITY: wanted.identity},
    })
    _check_work_stream(names, wanted, work)
    dead: dict[str, Any] = {
        "name": names.dead_stream, "subjects": [names.dead_subject],
        "retention": "workqueue", "storage": "file", "num_replicas": wanted.replicas,
        "metadata": {IDENTITY: wanted.identity},
    }
    if wanted.job_ttl > 0:
        dead["max_age"] = int(wanted.job_ttl * _NS)
    _check_dead_stream(names, await jetstream.stream(names.dead_stream, dead))
    consumer = await jetstream.consumer(names.stream, names.consumer, {
        "durable_name": names.consumer, "ack_policy": "explicit", "deliver_policy": "all",
        "ack_wait": int(wanted.ack_wait * _NS), "max_deliver": wanted.max_attempts + 1,
        "filter_subjects": names.work_subjects, "metadata": {SPARE_DELIVERY: "1"},
    })
    _check_consumer(names, work, consumer)
    return _adopted(consumer, work, wanted)


async def check_renamed(
    conn: Connection, queue: str, wanted: Wanted, timeout: float
) -> None:
    """Refuse to start beside this queue's streams under the names an earlier release gave
    a non-ASCII queue (one ``_`` per character: ``Q_CAF_`` for ``café``, where queue 5 has
    ``Q_CAF__``). Consuming the new stream while the old one still exists would leave its
    jobs, and whatever earlier producers still publish there, behind without a word.
    A stream of that name that another queue owns (``caf_``'s) is none of our business."""
    old, new = QueueNames.legacy(queue), QueueNames.of(queue)
    if old is None:
        return
    jetstream = _Api(conn, timeout)
    dead = await jetstream.stream_info(old.dead_stream)
    if _ours(dead, wanted) and (dead.get("state") or {}).get("messages"):
        log.warning("NATS stream %s holds %d dead letters of queue %r under the name an "
                    "earlier release used; queue 5 and this release keep them in %s. Move "
                    "or read them there (nats stream view %s), then delete it.",
                    old.dead_stream, dead["state"]["messages"], queue, new.dead_stream,
                    old.dead_stream)
    work = await jetstream.stream_info(old.stream)
    if not _ours(work, wanted):
        return
    messages = (work.get("state") or {}).get("messages", 0)
    raise BrokerError(
        f"NATS stream {old.stream} (subject {old.subject}) holds queue {queue!r} under the "
        f"name an earlier release of this supervisor gave it ({messages} messages); queue 5, "
        f"and this release, name the queue {new.stream} (subject {new.subject}): one '_' "
        f"per UTF-8 byte, not per character. Not starting, so that nothing there is left "
        f"behind: stop the earlier release's producers, let its supervisors drain "
        f"{old.stream}, then delete it (nats stream rm {old.stream}) and start this one."
    )


def _ours(answer: dict[str, Any], wanted: Wanted) -> bool:
    metadata = (answer.get("config") or {}).get("metadata") or {}
    return "error" not in answer and metadata.get(IDENTITY) == wanted.identity


def read_consumer_policy(consumer: dict[str, Any], max_attempts: int) -> tuple[int, int | None]:
    """(budget, spare) as queue 5 reads them from a consumer's MaxDeliver and metadata.

    Marked with the spare delivery: MaxDeliver - 1 attempts, the last delivery is only
    dead-lettered. Unmarked: MaxDeliver attempts, and a delivery that ran out while no
    handler held it is announced by the server's max-deliveries advisory. Unlimited: our
    ``max_attempts`` for rejections and no spare, as queue 5's ``spareOf()`` (a job whose
    every run dies unsettled, e.g. it kills its supervisor, comes back until it succeeds,
    under PHP workers as here; the start-up warning says so).
    """
    max_deliver = deliver_limit(consumer.get("max_deliver"))
    if max_deliver == UNLIMITED:
        return max_attempts, None
    if (consumer.get("metadata") or {}).get(SPARE_DELIVERY) is not None and max_deliver > 1:
        return max_deliver - 1, max_deliver
    return max_deliver, None


def _adopted(consumer: dict[str, Any], work: dict[str, Any], wanted: Wanted) -> Adopted:
    budget, spare = read_consumer_policy(consumer, wanted.max_attempts)
    limits = ("max_msgs", "max_bytes", "max_msgs_per_subject")
    return Adopted(
        budget=budget, spare=spare, max_deliver=deliver_limit(consumer.get("max_deliver")),
        ack_wait=consumer.get("ack_wait", 30 * _NS) / _NS,
        backoff=tuple(b / _NS for b in consumer.get("backoff") or ()),
        bounded=any((work.get(limit) or -1) > 0 for limit in limits),
        replicas=work.get("num_replicas") or 1,
    )


def _check_work_stream(names: QueueNames, wanted: Wanted, config: dict[str, Any]) -> None:
    where = f"NATS stream {names.stream}"
    if config.get("retention") != "workqueue":
        raise BrokerError(
            f"{where} has retention {config.get('retention')!r}, but a job queue needs "
            f"'workqueue' (a message is removed once acknowledged). Retention cannot be "
            f"changed in place: drain the stream and delete it (nats stream rm "
            f"{names.stream}) so it is recreated, or use another queue name."
        )
    subjects = config.get("subjects") or []
    if names.subject not in subjects:
        raise BrokerError(
            f"{where} has subjects {subjects}, which do not include {names.subject!r}: "
            f"add it (nats stream edit {names.stream} --subjects ...) or delete the stream "
            f"so it is recreated."
        )
    owner = (config.get("metadata") or {}).get(IDENTITY)
    if owner is not None and owner != wanted.identity:
        raise BrokerError(
            f"{where} belongs to queue {owner!r} (metadata {IDENTITY}), not "
            f"{wanted.identity!r} (this job's [broker] namespace and [job] queue): two "
            f"queues map to one stream. Use the namespace the queue's other workers use, "
            f"or rename one of the queues."
        )
    if config.get("max_age", 0) > 0:
        log.warning("%s has max_age %.0fs: jobs not consumed in time expire unhandled",
                    where, config["max_age"] / _NS)


def _check_dead_stream(names: QueueNames, config: dict[str, Any]) -> None:
    if names.dead_subject not in (config.get("subjects") or []):
        raise BrokerError(
            f"NATS stream {names.dead_stream} has subjects {config.get('subjects')}, which "
            f"do not include {names.dead_subject!r}: dead letters would have nowhere to go. "
            f"Add the subject (nats stream edit {names.dead_stream}) or delete the stream."
        )


def _check_consumer(names: QueueNames, work: dict[str, Any], config: dict[str, Any]) -> None:
    where = f"NATS consumer {names.consumer!r} on stream {names.stream}"
    recreate = (f"delete it (nats consumer rm {names.stream} {names.consumer}) so it is "
                f"recreated")
    if config.get("deliver_subject"):
        raise BrokerError(f"{where} is a push consumer (deliver_subject "
                          f"{config['deliver_subject']!r}); a pull consumer is needed: "
                          f"{recreate}")
    if config.get("ack_policy") != "explicit":
        raise BrokerError(f"{where} has ack_policy {config.get('ack_policy')!r}, not "
                          f"'explicit': {recreate}")
    filters = config.get("filter_subjects") or (
        [config["filter_subject"]] if config.get("filter_subject") else [])
    ours = set(names.work_subjects)
    # No filter means every subject of the stream: only safe if they are all ours.
    seen = filters or (work.get("subjects") or [])
    if names.subject not in seen or not set(seen) <= ours:
        what = f"filter subjects {filters}" if filters else f"no filter (stream subjects {seen})"
        raise BrokerError(f"{where} has {what}; it must take {names.subject!r} (and may take "
                          f"{names.keyed_subject!r}) and nothing else, or it hands this "
                          f"queue's workers foreign messages or none: {recreate}")


class _Api:
    """The few JetStream API calls setup needs, as plain JSON requests."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self._conn = conn
        self._timeout = timeout

    async def stream(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """The stream's config, creating it with ``config`` when it does not exist."""
        found = await self._call(api.stream_info(name))
        if _not_found(found):
            created = await self._call(api.stream_create(name), config)
            if "error" not in created:
                log.info("created NATS stream %s (%d replicas)", name,
                         config.get("num_replicas", 1))
                return _config(created)
            found = await self._call(api.stream_info(name))  # lost a creation race?
            if _not_found(found):  # no: the creation itself was refused, say why
                return _config_or_raise(created, f"stream {name} not created")
        return _config_or_raise(found, f"stream {name}")

    async def consumer(self, stream: str, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """The consumer's config, creating it with ``config`` when it does not exist."""
        found = await self.consumer_info(stream, name)
        if _not_found(found):
            body = {"stream_name": stream, "config": config, "action": "create"}
            created = await self._call(api.consumer_create(stream, name), body)
            if "error" not in created:
                log.info("created NATS consumer %s on %s", name, stream)
                return _config(created)
            found = await self.consumer_info(stream, name)
        return _config_or_raise(found, f"consumer {name} on {stream}")

    async def stream_info(self, name: str) -> dict[str, Any]:
        return await self._call(api.stream_info(name))

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any]:
        return await self._call(api.consumer_info(stream, name))

    async def _call(self, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = orjson.dumps(body) if body is not None else b""
        reply = await self._conn.request(subject, payload, timeout=self._timeout)
        status = (reply.headers or {}).get("Status")
        if status == "503":
            raise NotReady("JetStream is not available on this server (yet)")
        try:
            answer = orjson.loads(reply.data)
        except orjson.JSONDecodeError:
            raise BrokerError(
                f"unexpected JetStream API reply to {subject}: {reply.data[:200]!r}"
            ) from None
        error = answer.get("error") if isinstance(answer, dict) else None
        if error and error.get("code") == 503:
            raise NotReady(f"JetStream not ready: {error.get('description')}")
        parsed: dict[str, Any] = answer
        return parsed


async def reread_consumer(
    conn: Connection, names: QueueNames, timeout: float
) -> dict[str, Any]:
    """The consumer's current config (it is shared: another worker may have changed it)."""
    found = await _Api(conn, timeout).consumer_info(names.stream, names.consumer)
    return _config_or_raise(found, f"consumer {names.consumer} on {names.stream}")


#: MaxDeliver that JetStream reads as "no limit" (it also reports 0 that way).
UNLIMITED = -1


def deliver_limit(value: Any) -> int:
    """A consumer's MaxDeliver as we compare it: any value below 1 means no limit."""
    return value if isinstance(value, int) and value >= 1 else UNLIMITED


def _not_found(answer: dict[str, Any]) -> bool:
    return (answer.get("error") or {}).get("code") == 404


def _config_or_raise(answer: dict[str, Any], what: str) -> dict[str, Any]:
    if "error" in answer:
        error = answer["error"]
        raise BrokerError(f"NATS {what}: {error.get('description')} (code {error.get('code')}, "
                          f"err_code {error.get('err_code')})")
    return _config(answer)


def _config(answer: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = answer["config"]
    return config
