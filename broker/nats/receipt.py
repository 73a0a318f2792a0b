"""What a pulled JetStream message becomes: its receipt (the ack subject and the counters
read from it) and the delivery handed to the supervisor.

The counters come from the ack subject itself, as nats-py's ``Msg.metadata`` reads them,
without building its metadata object: this runs once per delivery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from broker.base import Delivery
from broker.nats.dead import CONTENT_TYPE

log = logging.getLogger("broker.nats")


@dataclass(slots=True)
class NatsReceipt:
    """Proof of one delivery: its ack subject (valid from any connection) and counters.
    Never changed once made; not frozen only because a frozen dataclass's ``__init__``
    (one ``object.__setattr__`` per field) costs about 0.45 us more, once per delivery."""

    reply: str  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...
    stream_seq: int
    delivered: int  # JetStream's num_delivered for this delivery (1 = first)
    subject: str = ""  # where it was published (a release republishes there)
    content_type: str | None = None


def receipt_of(msg: Msg) -> NatsReceipt | None:
    counters = ack_counters(msg.reply)
    if counters is None:
        log.warning("ignored a message without JetStream metadata on the pull inbox")
        return None
    content_type = (msg.headers or {}).get(CONTENT_TYPE)
    return NatsReceipt(msg.reply, counters[0], counters[1], msg.subject, content_type)


def ack_counters(reply: str) -> tuple[int, int] | None:
    """(stream seq, num_delivered) from an ack subject, as nats-py's ``Msg.metadata``
    reads them (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...``, 9 tokens, or the
    form with domain and account hash, 11 or more), without building its metadata."""
    tokens = reply.split(".")
    count = len(tokens)
    if tokens[0] != "$JS" or tokens[1:2] != ["ACK"] or (count != 9 and count < 11):
        return None
    at = 4 if count == 9 else 6
    try:
        return int(tokens[at + 1]), int(tokens[at])
    except ValueError:
        return None


def delivery_of(
    msg: Msg, receipt: NatsReceipt, decoded: dict[str, Any], plain: bool = False
) -> Delivery:
    return Delivery(
        pid=decoded["pid"], queue=decoded["queue"], timestamp=decoded["timestamp"],
        attempts=receipt.delivered - 1, payload=decoded["payload"], raw=msg.data,
        receipt=receipt, envelope=decoded, plain=plain,
    )
