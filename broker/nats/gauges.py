"""One sample of a NATS queue: three JetStream API requests (the consumer, the work
stream, the dead stream), whatever the queue holds.

The consumer's info gives what waits (``num_pending``), what is held unacknowledged
(``num_ack_pending``) and what was redelivered; the dead stream's message count the dead
letters; the work stream's first timestamp the oldest ready age. A request nobody answers
(503 "no responders", or no reply in time on a live connection) means the JetStream API
has no leader for the queue now: a cluster electing one, or one that lost its quorum; so
does an answer whose replicated group names no leader (a server left without a quorum
answers stream info that way).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import orjson

from broker.base import BrokerError
from broker.gauges import QueueGauges
from broker.nats import api
from broker.nats.broker import NatsBroker
from broker.nats.conn import ConnectionLost, RequestTimeout
from broker.nats.link import NotReady, Unavailable


class Leaderless(BrokerError):
    """The JetStream API did not answer for the queue: no leader now."""


async def sample(broker: NatsBroker) -> QueueGauges:
    """The queue's figures now; ``leader`` False when the API had none to answer.
    BrokerError when there is no connection at all."""
    names = broker.names
    try:
        consumer = await _info(broker, api.consumer_info(names.stream, names.consumer))
        work = await _info(broker, api.stream_info(names.stream))
        dead = await _info(broker, api.stream_info(names.dead_stream))
    except Leaderless:
        return QueueGauges(reconnects=broker.reconnects, leader=False)
    return QueueGauges(
        ready=consumer.get("num_pending"),
        processing=consumer.get("num_ack_pending"),
        redelivered=consumer.get("num_redelivered"),
        dead=_messages(dead),
        oldest_ready_age=_oldest_age(work),
        reconnects=broker.reconnects,
        leader=True,
    )


async def _info(broker: NatsBroker, subject: str) -> dict[str, Any]:
    try:
        conn = await broker._link.current(broker._timeout)
    except Unavailable as error:
        # A new connection is made, then prepared with the same API requests: when a
        # server answered but the API did not, it is the leader that is missing.
        if isinstance(error.last, (RequestTimeout, NotReady)):
            raise Leaderless(str(error)) from error
        raise
    try:
        reply = await conn.request(subject, b"{}", timeout=broker._timeout)
    except RequestTimeout as error:
        raise Leaderless(f"{subject}: {error}") from error
    except ConnectionLost as error:
        raise BrokerError(f"{subject}: {error}") from error
    if (reply.headers or {}).get("Status") == "503":
        raise Leaderless(f"{subject}: no responders")
    try:
        info = orjson.loads(reply.data)
    except orjson.JSONDecodeError as error:
        raise BrokerError(f"{subject}: {error}") from error
    refused = info.get("error")
    if refused and refused.get("code") != 404:  # a dead stream not made yet: no dead letters
        raise BrokerError(f"{subject}: {refused.get('description') or refused}")
    cluster = info.get("cluster")
    if cluster and cluster.get("replicas") and not cluster.get("leader"):
        # A replicated group answered by a server that knows it has no leader (a quorum
        # lost): the figures are that server's, not the group's.
        raise Leaderless(f"{subject}: the group has no leader")
    found: dict[str, Any] = info
    return found


def _messages(info: dict[str, Any]) -> int:
    """A stream's message count (0 for a stream that does not exist)."""
    return int((info.get("state") or {}).get("messages") or 0)


def _oldest_age(info: dict[str, Any]) -> float:
    """Seconds since the oldest message still in the work stream was stored (0: empty)."""
    state = info.get("state") or {}
    if not state.get("messages") or not state.get("first_ts"):
        return 0.0
    first = datetime.datetime.fromisoformat(state["first_ts"].replace("Z", "+00:00"))
    return max(0.0, time.time() - first.timestamp())
