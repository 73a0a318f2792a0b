"""JetStream names of a queue, and creating/checking its streams and consumer.

Names (the same as `utopia-php/queue` uses): stream ``Q_<NAME>`` (upper-cased, characters
outside ``A-Za-z0-9_-`` become ``_``) on subject ``q.<name>.normal`` (lower-cased, same
sanitising), durable pull consumer ``worker``; dead letters to ``q.<name>.dead`` in
stream ``Q_<NAME>_DEAD``.

What is missing is created. What exists with other settings is never changed: the
operator gets a BrokerError that names the setting and what to do about it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import orjson

from broker.base import BrokerError
from broker.nats_conn import Connection
from broker.nats_link import NotReady

log = logging.getLogger("broker.nats")

CONSUMER = "worker"
MAX_STREAM_NAME = 255
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
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
        token = _UNSAFE.sub("_", queue)
        if not token:
            raise ValueError("queue name is empty")
        names = cls(
            stream=f"Q_{token.upper()}", subject=f"q.{token.lower()}.normal",
            dead_stream=f"Q_{token.upper()}_DEAD", dead_subject=f"q.{token.lower()}.dead",
        )
        if len(names.dead_stream) > MAX_STREAM_NAME:
            raise ValueError(f"queue name {queue!r} is too long for a JetStream stream name")
        return names

    @property
    def next_subject(self) -> str:
        """Where pull requests for the consumer go."""
        return f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"


#: MaxDeliver that JetStream reads as "no limit" (it also reports 0 that way).
UNLIMITED = -1


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    ack_wait: float  # seconds
    max_deliver: int = UNLIMITED  # the consumer's MaxDeliver; not the handler's max_attempts
    job_ttl: float = 0.0  # seconds dead letters are kept; 0 = forever


async def ensure_queue(
    conn: Connection, names: QueueNames, settings: ConsumerSettings, timeout: float
) -> None:
    """Create the streams and consumer when missing; raise BrokerError when they differ."""
    api = _Api(conn, timeout)
    work = await api.stream(names.stream, {
        "name": names.stream, "subjects": [names.subject], "retention": "workqueue",
        "storage": "file",
    })
    _check_work_stream(names, work)
    dead: dict[str, Any] = {
        "name": names.dead_stream, "subjects": [names.dead_subject],
        "retention": "workqueue", "storage": "file",
    }
    if settings.job_ttl > 0:
        dead["max_age"] = int(settings.job_ttl * _NS)
    _check_dead_stream(names, await api.stream(names.dead_stream, dead))
    consumer = await api.consumer(names.stream, names.consumer, {
        "durable_name": names.consumer, "ack_policy": "explicit",
        "ack_wait": int(settings.ack_wait * _NS), "max_deliver": settings.max_deliver,
        "filter_subject": names.subject, "deliver_policy": "all",
    })
    _check_consumer(names, settings, consumer)


def _check_work_stream(names: QueueNames, config: dict[str, Any]) -> None:
    where = f"NATS stream {names.stream}"
    if config.get("retention") != "workqueue":
        raise BrokerError(
            f"{where} has retention {config.get('retention')!r}, but a job queue needs "
            f"'workqueue' (a message is removed once acknowledged). Retention cannot be "
            f"changed in place: drain the stream and delete it (nats stream rm "
            f"{names.stream}) so it is recreated, or use another queue name."
        )
    if names.subject not in (config.get("subjects") or []):
        raise BrokerError(
            f"{where} has subjects {config.get('subjects')}, which do not include "
            f"{names.subject!r}: add it (nats stream edit {names.stream} --subjects ...) "
            f"or delete the stream so it is recreated."
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


def _check_consumer(names: QueueNames, settings: ConsumerSettings, config: dict[str, Any]) -> None:
    where = f"NATS consumer {names.consumer!r} on stream {names.stream}"
    fix = (f"change the job's configuration to match, or edit/delete the consumer "
           f"(nats consumer rm {names.stream} {names.consumer}) so it is recreated")
    if config.get("deliver_subject"):
        raise BrokerError(f"{where} is a push consumer; a pull consumer is needed: delete it "
                          f"(nats consumer rm {names.stream} {names.consumer}) so it is recreated")
    if config.get("ack_policy") != "explicit":
        raise BrokerError(f"{where} has ack_policy {config.get('ack_policy')!r}, not "
                          f"'explicit': {fix}")
    ack_wait = config.get("ack_wait", 0) / _NS
    if abs(ack_wait - settings.ack_wait) > 0.001:
        raise BrokerError(f"{where} has ack_wait {ack_wait:g}s, but this worker is configured "
                          f"with {settings.ack_wait:g}s (the lease): {fix}")
    max_deliver = deliver_limit(config.get("max_deliver"))
    if max_deliver != settings.max_deliver:
        raise BrokerError(f"{where} has max_deliver {max_deliver}, but this worker is "
                          f"configured with {settings.max_deliver} ([nats] max_deliver, "
                          f"-1 = unlimited): {fix}")
    filters = config.get("filter_subjects") or (
        [config["filter_subject"]] if config.get("filter_subject") else [])
    if filters and filters != [names.subject]:
        raise BrokerError(f"{where} has filter subjects {filters}, not [{names.subject!r}]: "
                          f"{fix}")


class _Api:
    """The few JetStream API calls setup needs, as plain JSON requests."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self._conn = conn
        self._timeout = timeout

    async def stream(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """The stream's config, creating it with ``config`` when it does not exist."""
        found = await self._call(f"$JS.API.STREAM.INFO.{name}")
        if _not_found(found):
            created = await self._call(f"$JS.API.STREAM.CREATE.{name}", config)
            if "error" not in created:
                log.info("created NATS stream %s", name)
                return created["config"]
            found = await self._call(f"$JS.API.STREAM.INFO.{name}")  # lost a creation race?
        return _config_or_raise(found, f"stream {name}")

    async def consumer(self, stream: str, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """The consumer's config, creating it with ``config`` when it does not exist."""
        found = await self._call(f"$JS.API.CONSUMER.INFO.{stream}.{name}")
        if _not_found(found):
            body = {"stream_name": stream, "config": config, "action": "create"}
            created = await self._call(f"$JS.API.CONSUMER.CREATE.{stream}.{name}", body)
            if "error" not in created:
                log.info("created NATS consumer %s on %s", name, stream)
                return created["config"]
            found = await self._call(f"$JS.API.CONSUMER.INFO.{stream}.{name}")
        return _config_or_raise(found, f"consumer {name} on {stream}")

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
        return answer


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
    return answer["config"]
