"""Redis Cluster placement: every key of a queue must hash to one slot.

The scripts touch many keys of a queue in one call (ready, processing, job records, owners,
counters...). On a Cluster that is only possible when all of them live in one slot, which
the namespace's hash tag ensures: ``{utopia-queue}.queue.q`` and
``{utopia-queue}.jobs.q.<pid>`` both hash by ``utopia-queue``. Without a tag the keys would
spread over slots and every script call would fail with CROSSSLOT, after a reserve may
already have moved messages. So the check runs at connect time, before any message moves,
on the key names ``broker.redis.keys`` really builds (fixed keys plus samples of the per-pid,
per-token and per-consumer patterns).

A namespace is never renamed here: a new name means new keys, and the jobs under the old
ones would be orphaned. The error tells the operator what to change and what to move.
"""

from __future__ import annotations

from redis.crc import key_slot

from broker.base import BrokerError
from broker.redis.keys import QueueKeys

DOCS_SECTION = 'docs/redis-cluster.md, "Running on a Redis Cluster"'
BRACES = (' Its braces make none: Redis hashes by what the first "{" and the next "}" enclose, '
          "and only when that is not empty.")

# Samples for the variable parts of key names. Braces are included on purpose: a pid comes
# from producers, and one with a "{" must not be able to move its keys to another slot.
SAMPLE_PIDS = ("65f1c2a3b4c5d6.12345678", "0", "{pid}", "}{")
SAMPLE_TOKENS = ("0123456789abcdef0123456789abcdef", "{t}")
SAMPLE_CONSUMERS = ("host-1-abcdef", "{c}")


class PlacementError(BrokerError):
    """The keys of a queue would not all be in one Redis Cluster slot."""


def queue_key_samples(keys: QueueKeys) -> list[str]:
    """Every fixed key of the queue and samples of each per-message/consumer pattern."""
    return [
        *keys.all_fixed(),
        *(keys.job(pid) for pid in SAMPLE_PIDS),
        *(keys.owner(pid) for pid in SAMPLE_PIDS),
        *(keys.claim(pid) for pid in SAMPLE_PIDS),
        *(keys.error(pid) for pid in SAMPLE_PIDS),
        *(keys.failures(pid) for pid in SAMPLE_PIDS),
        *(keys.pending(key) for key in SAMPLE_PIDS),
        *(keys.reservation(token) for token in SAMPLE_TOKENS),
        *(keys.supervisor(consumer) for consumer in SAMPLE_CONSUMERS),
    ]


def slots(keys: QueueKeys) -> dict[int, list[str]]:
    """The slots the queue's keys hash to, each with its keys."""
    by_slot: dict[int, list[str]] = {}
    for key in queue_key_samples(keys):
        by_slot.setdefault(key_slot(key.encode()), []).append(key)
    return by_slot


def check_placement(keys: QueueKeys) -> None:
    """Raise PlacementError unless every key of the queue hashes to one cluster slot."""
    by_slot = slots(keys)
    if len(by_slot) == 1:
        return
    (slot_a, keys_a), (slot_b, keys_b) = list(by_slot.items())[:2]
    spread = (
        f"the keys of queue {keys.queue!r} would spread over {len(by_slot)} cluster slots "
        f"(e.g. {keys_a[0]!r} in slot {slot_a}, {keys_b[0]!r} in slot {slot_b}), so no script "
        "could touch them together"
    )
    # Every key name starts with the namespace, so a namespace with a tag (keys.hash_tag,
    # Redis's rule: not merely a brace, "{}x" and "}{" have none) never spreads: reaching
    # here means it has none, and no second, looser test of "has a tag" is needed.
    braces = set("{}") & set(keys.namespace)
    raise PlacementError(
        f"namespace {keys.namespace!r} has no hash tag: {spread}.{BRACES if braces else ''} "
        f"Use the hash-tagged namespace = \"{{{_untagged(keys.namespace)}}}\" on Redis Cluster"
        f"{', and keep braces out of the queue name' if braces else ''}. That is a new set of "
        f"key names: jobs already queued under {keys.namespace!r} are not moved for you; drain "
        f"them or migrate their keys explicitly first ({DOCS_SECTION})."
    )


def _untagged(namespace: str) -> str:
    return namespace.replace("{", "").replace("}", "") or "queues"
