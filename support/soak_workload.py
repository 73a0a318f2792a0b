"""The messages of a soak run (``python -m bench.chaos``), generated from the seed, and the
totals they must produce.

Kinds:

- ``good``: a stats-usage payload with known metric values (some negative);
- ``flaky``: the same, plus ``"chaos": {"fail": p, "draw": n}``: the handler fails each
  attempt with probability ``p`` (seeded by the run's seed, ``n`` and the attempt), so
  the message is retried and normally ends counted;
- ``slow``: a good message whose call takes ``SLOW_SECONDS``, longer than the shutdown
  deadline, so a SIGTERM can catch it running (the bounded-stop path);
- ``invalid``: a valid envelope whose payload the stats-usage handler rejects (no metrics
  list): it fails every attempt and must end in failed/dead, never in the totals;
- ``malformed``: bytes that are not a valid envelope: poison (Redis) / dead (NATS);
- ``oversized``: a valid envelope longer than the soak supervisors' ``max_envelope_bytes``
  (``ENVELOPE_LIMIT``), published among the others so that it shares batches with good
  ones: on Redis reserve.lua poisons it unread, on NATS it is dead-lettered with a reason
  starting ``malformed: envelope of N bytes exceeds``. Either way it is parked byte for
  byte, like a malformed message (so its ``pid`` is None here: no handler may see it).

A share of the flaky messages is hostile in ways PHP accepts (issue 28): a payload nested
250 to 511 levels deep, which every retry must write back, and a negative ``attempts``
(-2**63 or -1) with a timestamp of -2**63 or 2**63 - 1 in the envelope; the retry
accounting must still end within ``max_attempts`` runs.

Good and flaky messages must all be counted exactly once, except a flaky one whose every
attempt failed (probability ``p ** max_attempts``): it ends in failed/dead and is then
accounted for separately.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from broker import envelope
from examples.stats_usage import make_payload

PROJECTS = 12
FLAKY_SHARE = 0.05
FLAKY_FAIL = 0.3
INVALID_SHARE = 0.002
MALFORMED_SHARE = 0.002
SLOW_SHARE = 0.002
OVERSIZED_SHARE = 0.002
#: The soak supervisors' ``max_envelope_bytes`` (the largest ordinary message, 511 levels
#: deep, is a few KB; nats-server's default max_payload, 1 MB, takes the oversized ones).
ENVELOPE_LIMIT = 64 * 1024
SLOW_SECONDS = 2.5
HOSTILE_SHARE_OF_FLAKY = 0.2
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

GOOD, FLAKY, SLOW, INVALID, MALFORMED = "good", "flaky", "slow", "invalid", "malformed"
OVERSIZED = "oversized"
#: Kinds published as bytes that must end parked (poison on Redis, dead on NATS).
PARKED = (MALFORMED, OVERSIZED)


@dataclass(slots=True)
class Message:
    kind: str
    raw: bytes
    pid: str | None = None  # None for bytes that must be parked (malformed, oversized)
    project: str = ""
    metrics: dict[str, int] = field(default_factory=dict)

    @property
    def countable(self) -> bool:
        """Must end in the totals (unless it legitimately failed max_attempts times)."""
        return self.kind in (GOOD, FLAKY, SLOW)


def generate(queue: str, count: int, seed: int) -> list[Message]:
    """``count`` messages in publishing order; at least one invalid, one malformed and one
    oversized."""
    rng = random.Random(f"workload:{seed}")
    kinds = [GOOD] * count
    special = [INVALID] * max(1, round(count * INVALID_SHARE))
    special += [MALFORMED] * max(1, round(count * MALFORMED_SHARE))
    special += [OVERSIZED] * max(1, round(count * OVERSIZED_SHARE))
    special += [SLOW] * round(count * SLOW_SHARE)
    special += [FLAKY] * round(count * FLAKY_SHARE)
    special = special[:count]
    for position, kind in zip(rng.sample(range(count), len(special)), special, strict=True):
        kinds[position] = kind
    return [_message(queue, n, kind, rng) for n, kind in enumerate(kinds)]


def _message(queue: str, n: int, kind: str, rng: random.Random) -> Message:
    if kind == MALFORMED:
        return Message(kind, _malformed(queue, n, rng))
    if kind == OVERSIZED:
        return Message(kind, _oversized(queue, n, rng))
    project = f"project-{rng.randrange(PROJECTS)}"
    metrics = {"executions": 1, "bandwidth": rng.randrange(-500, 50_000)}
    if rng.random() < 0.3:
        metrics["storage"] = rng.randrange(-10_000, 10_000)
    payload: dict[str, Any] = make_payload(project, metrics)
    if kind == FLAKY:
        payload["chaos"] = {"fail": FLAKY_FAIL, "draw": n}
    if kind == SLOW:
        payload["chaos"] = {"work": SLOW_SECONDS}
    if kind == INVALID:
        payload = {"project": {"$id": project}, "metrics": f"not a list ({n})"}
        metrics = {}
    hostile = kind == FLAKY and rng.random() < HOSTILE_SHARE_OF_FLAKY
    if hostile:
        payload["deep"] = _nested(rng.randrange(248, 510))  # 250..511 levels in all
    pid, raw = envelope.build(queue, payload)
    if hostile:
        raw = envelope.encode({**envelope.decode(raw), "attempts": rng.choice((INT64_MIN, -1)),
                               "timestamp": rng.choice((INT64_MIN, INT64_MAX))})
    return Message(kind, raw, pid, project, metrics)


def _nested(levels: int) -> list[Any]:
    value: list[Any] = [levels]
    for _ in range(levels - 1):
        value = [value]
    return value


def _oversized(queue: str, n: int, rng: random.Random) -> bytes:
    """A stats-usage envelope PHP would run, 1 byte to 16 KiB over ``ENVELOPE_LIMIT``."""
    payload = make_payload(f"project-{rng.randrange(PROJECTS)}", {"executions": 1})
    payload["blob"] = f"{n}:" + "x" * (ENVELOPE_LIMIT + rng.randrange(1, 16 * 1024))
    raw = envelope.build(queue, payload)[1]
    assert len(raw) > ENVELOPE_LIMIT
    return raw


def _malformed(queue: str, n: int, rng: random.Random) -> bytes:
    """Distinct bytes each time, so the harness can find every one in poison/dead. Each is
    one a queue-5 PHP worker poisons too (a numeric pid, say, it would run)."""
    choices = [
        f"{{not json {n}".encode(),
        f'["an array", {n}]'.encode(),
        f'{{"queue": "{queue}", "timestamp": {n}, "payload": {{}}}}'.encode(),  # no pid
        f'{{"pid": "m{n}", "queue": "{queue}", "timestamp": 1, "payload": "text"}}'.encode(),
    ]
    return rng.choice(choices)


def expected_totals(messages: list[Message]) -> Counter[tuple[str, str]]:
    """The totals if every countable message is counted exactly once."""
    totals: Counter[tuple[str, str]] = Counter()
    for message in messages:
        if message.countable:
            for metric, value in message.metrics.items():
                totals[(message.project, metric)] += value
    return totals
