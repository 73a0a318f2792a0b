"""The NATS JetStream broker (queue 5's protocol): the adapter, its connection and pulls,
the queue's stream and consumer, and TLS for nats-py."""

from broker.nats.broker import NatsBroker
from broker.nats.receipt import NatsReceipt

__all__ = ["NatsBroker", "NatsReceipt"]
