"""Hostile envelopes PHP accepts, against a real redis-server: every nesting depth PHP's
json_decode allows, and the extremes of every integer field, through settlement (retry),
recovery and the operator's ``retry`` (issue 28: H1 and M2).

One message must never stop a queue: a retry that cannot be written for one delivery
(``1e400`` decodes as INF, which PHP's json_encode refuses too) fails that delivery alone.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from broker import envelope
from broker.base import Action, Delivery, Outcome, Settlement
from broker.redis import RedisBroker
from broker.redis.admin.retry import retry
from broker.redis.keys import QueueKeys
from broker.redis.recovery import maintain
from broker.redis.scripts import Scripts

QUEUE = "hostile"
KEYS = QueueKeys("utopia-queue", QUEUE)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Payload nesting from 250 to 511 levels in all (the envelope is one more): every depth
#: PHP's json_decode accepts from there (512 is poison, see test_envelope.py).
DEPTHS = range(249, 511)


def deep_payload(levels: int) -> bytes:
    """A payload ``levels`` deep, arrays and objects alternating, as PHP would write it."""
    opened = b"".join(b"[" if level % 2 else b'{"a":' for level in range(levels - 1))
    closed = b"".join(b"]" if level % 2 else b"}" for level in reversed(range(levels - 1)))
    return opened + b'{"v":1.5e-7,"s":"\\u00e9\\/"}' + closed


def raw_envelope(pid: str, payload: bytes = b'{"a":1}', timestamp: int = 1,
                 attempts: int | None = None) -> bytes:
    extra = b"" if attempts is None else b',"attempts":%d' % attempts
    return b'{"pid":"%s","queue":"%s","timestamp":%d,"payload":%s%s}' % (
        pid.encode(), QUEUE.encode(), timestamp, payload, extra)


def payload_of(raw: bytes) -> bytes:
    """The payload's bytes as written: between '"payload":' and ',"attempts"'."""
    start = raw.index(b',"payload":') + len(b',"payload":')
    return raw[start:raw.rindex(b',"attempts":')]


INF_PAYLOAD = b'{"a":1e400}'  # PHP reads INF, runs the job, and cannot json_encode it again


async def new_broker(url: str, **options: Any) -> RedisBroker:
    broker = RedisBroker(url, QUEUE, consumer_id="hostile", **options)
    await broker.connect()
    return broker


async def receive_all(broker: RedisBroker, count: int) -> list[Delivery]:
    deliveries: list[Delivery] = []
    while len(deliveries) < count:
        received = await broker.receive(1000, 1)
        assert not received.poisoned, received.poisoned
        deliveries += received.deliveries
    return deliveries


# --- H1: settlement ----------------------------------------------------------------------


@pytest.mark.slow
async def test_a_batch_with_every_deep_retry_and_one_unwritable_commits_the_rest(
    redis_url, redis_client, caplog
):
    deep = {f"deep{levels}": deep_payload(levels) for levels in DEPTHS}
    raws = [raw_envelope(pid, payload) for pid, payload in deep.items()]
    raws += [raw_envelope("good1"), raw_envelope("inf", INF_PAYLOAD), raw_envelope("good2")]
    for raw in raws:
        await redis_client.lpush(KEYS.ready, raw)
    broker = await new_broker(redis_url)
    try:
        deliveries = await receive_all(broker, len(raws))
        settlements = [
            Settlement(Action.COMMIT if d.pid.startswith("good") else Action.REJECT, d, "boom")
            for d in deliveries
        ]
        results = await broker.settle(settlements)  # one batch of 264
    finally:
        await broker.close()
    assert [r.outcome for r in results] == [Outcome.OK] * len(raws)
    # Every deep retry is back on the ready list, its payload byte for byte as received.
    requeued = {envelope.decode(raw)["pid"]: raw for raw in await redis_client.lrange(
        KEYS.ready, 0, -1)}
    assert sorted(requeued) == sorted(deep)
    for pid, raw in requeued.items():
        assert payload_of(raw) == deep[pid]
        assert envelope.decode(raw)["attempts"] == 1
    # The one that cannot be written alone went to the failed list, with its reason logged.
    assert await redis_client.lrange(KEYS.failed, 0, -1) == [b"inf"]
    assert await redis_client.mget(KEYS.stat("success"), KEYS.stat("processing")) == [
        b"2", b"0"]
    reasons = [r.getMessage() for r in caplog.records if "inf" in r.getMessage()]
    assert len(reasons) == 1 and "Inf and NaN cannot be JSON encoded" in reasons[0]


# --- H1: recovery and the operator's retry ---------------------------------------------


async def abandon(client, pids_and_raws: dict[str, bytes]) -> None:
    """Processing entries of a consumer long gone: no owner, no claim, published long ago."""
    pipe = client.pipeline(transaction=False)
    for pid, raw in pids_and_raws.items():
        pipe.lpush(KEYS.processing, pid)
        pipe.set(KEYS.job(pid), raw)
        pipe.incr(KEYS.stat("processing"))
    await pipe.execute()


async def sweep(client) -> None:
    await client.delete(KEYS.reap_lock)
    await maintain(client, Scripts(client), KEYS, lock_seconds=60, recovery_age=100,
                   max_attempts=3)


@pytest.mark.slow
async def test_recovery_requeues_every_deep_envelope_and_parks_the_unwritable_one(redis_client):
    deep = {f"deep{levels}": deep_payload(levels) for levels in DEPTHS}
    records = {pid: raw_envelope(pid, payload) for pid, payload in deep.items()}
    records |= {"inf": raw_envelope("inf", INF_PAYLOAD), "good": raw_envelope("good")}
    await abandon(redis_client, records)
    while await redis_client.llen(KEYS.processing):
        await sweep(redis_client)  # raised on the first deep one, on every sweep, before
    requeued = {envelope.decode(raw)["pid"]: raw for raw in await redis_client.lrange(
        KEYS.ready, 0, -1)}
    assert sorted(requeued) == sorted([*deep, "good"])
    for pid, payload in deep.items():
        assert payload_of(requeued[pid]) == payload
    assert await redis_client.lrange(KEYS.dead, 0, -1) == [b"inf"]


@pytest.mark.slow
async def test_the_operators_retry_moves_every_deep_envelope(redis_client):
    deep = {f"deep{levels}": deep_payload(levels) for levels in DEPTHS}
    records = {pid: raw_envelope(pid, payload) for pid, payload in deep.items()}
    records["inf"] = raw_envelope("inf", INF_PAYLOAD)
    for pid, raw in records.items():
        await redis_client.set(KEYS.job(pid), raw)
        await redis_client.lpush(KEYS.failed, pid)
    report = await retry(redis_client, Scripts(redis_client), KEYS)
    assert (report.moved, report.malformed) == (len(deep), 1)
    assert await redis_client.lrange(KEYS.failed, 0, -1) == [b"inf"]  # left where it was
    for raw in await redis_client.lrange(KEYS.ready, 0, -1):
        assert payload_of(raw) == deep[envelope.decode(raw)["pid"]]


# --- M2: huge and negative numbers in every integer field --------------------------------


@pytest.mark.parametrize("attempts", [INT64_MIN, -1, INT64_MAX - 1, INT64_MAX])
async def test_a_failing_job_stops_within_max_attempts_whatever_its_attempts(
    redis_url, redis_client, attempts
):
    await redis_client.lpush(KEYS.ready, raw_envelope("p", attempts=attempts))
    broker = await new_broker(redis_url, max_attempts=3)
    runs = 0
    try:
        while not await redis_client.llen(KEYS.failed):
            assert runs < 3, "ran more often than max_attempts allows"
            [delivery] = await receive_all(broker, 1)
            assert delivery.attempts == (attempts if runs == 0 else runs)  # PHP's value first
            runs += 1
            [result] = await broker.reject([delivery], ["boom"])
            assert result.ok
    finally:
        await broker.close()
    assert runs == (1 if attempts >= 2 else 3)


@pytest.mark.parametrize("timestamp", [INT64_MIN, -1, 0, INT64_MAX])
async def test_extreme_timestamps_run_retry_and_recover(redis_url, redis_client, timestamp):
    await redis_client.lpush(KEYS.ready, raw_envelope("p", timestamp=timestamp))
    broker = await new_broker(redis_url, max_attempts=3)
    try:
        [delivery] = await receive_all(broker, 1)
        assert delivery.envelope["timestamp"] == timestamp
        assert (await broker.reject([delivery], ["boom"]))[0].ok
        [again] = await receive_all(broker, 1)  # requeued with a fresh timestamp
        assert again.attempts == 1 and again.envelope["timestamp"] > 0
        assert (await broker.commit([again]))[0].ok
        await broker.oldest_ready_age()
    finally:
        await broker.close()


@pytest.mark.parametrize(("attempts", "requeued_with"),
                         [(INT64_MIN, 1), (-1, 1), (1, 2), (INT64_MAX, None)])
async def test_recovery_counts_negative_attempts_as_none(redis_client, attempts, requeued_with):
    await abandon(redis_client, {"p": raw_envelope("p", attempts=attempts)})
    await sweep(redis_client)
    if requeued_with is None:  # out of attempts: dead
        assert await redis_client.lrange(KEYS.dead, 0, -1) == [b"p"]
        return
    [raw] = await redis_client.lrange(KEYS.ready, 0, -1)
    assert envelope.decode(raw)["attempts"] == requeued_with


async def test_the_operators_retry_never_steps_attempts_out_of_range(redis_client):
    for pid, attempts in (("low", INT64_MIN), ("high", INT64_MAX)):
        await redis_client.set(KEYS.job(pid), raw_envelope(pid, attempts=attempts))
        await redis_client.lpush(KEYS.failed, pid)
    assert (await retry(redis_client, Scripts(redis_client), KEYS)).moved == 2
    attempts = {envelope.decode(raw)["pid"]: envelope.decode(raw)["attempts"]
                for raw in await redis_client.lrange(KEYS.ready, 0, -1)}
    assert attempts == {"low": 1, "high": INT64_MAX}  # still an integer PHP can read


def test_infinity_really_is_what_php_reads():
    decoded = envelope.decode(raw_envelope("inf", INF_PAYLOAD))
    assert decoded["payload"]["a"] == math.inf


# --- NATS: queue 5's acceptance (no timestamp cast), deep nesting, extreme numbers --------


async def test_nats_parks_what_php_would_throw_on_and_runs_the_rest(nats_server):
    import nats as nats_client

    from broker.nats import NatsBroker
    from broker.nats.setup import QueueNames

    broker = NatsBroker(nats_server.url, QUEUE, request_timeout=2.0, max_attempts=2)
    await broker.connect()
    client = await nats_client.connect(nats_server.url)
    refused = ['"abc"', '""', "[]", "{}", '"12abc"']
    accepted = {"cast": raw_envelope("cast").replace(b'"timestamp":1', b'"timestamp":"12"'),
                "deep": raw_envelope("deep", deep_payload(510)),
                "low": raw_envelope("low", timestamp=INT64_MIN, attempts=INT64_MIN),
                "high": raw_envelope("high", timestamp=INT64_MAX, attempts=INT64_MAX)}
    try:
        js = client.jetstream()
        subject = QueueNames.of(QUEUE).subject
        for timestamp in refused:
            await js.publish(subject, b'{"pid":"p","queue":"q","timestamp":%s}' % (
                timestamp.encode()))
        for raw in accepted.values():
            await js.publish(subject, raw)
        deliveries, poisoned = [], []
        for _ in range(20):  # each receive waits up to 2 s for the first message
            if len(deliveries) + len(poisoned) == len(refused) + len(accepted):
                break
            received = await broker.receive(100, 2)
            deliveries += received.deliveries
            poisoned += received.poisoned
        assert sorted(d.pid for d in deliveries) == sorted(accepted)
        assert all("timestamp is" in p.reason for p in poisoned), poisoned
        # Every accepted one settles: the deep one is released (its bytes go back as they
        # are) and the others fail until their budget ends, whatever their attempts say.
        for delivery in deliveries:
            assert delivery.raw == accepted[delivery.pid]
        results = await broker.settle([
            Settlement(Action.RELEASE if d.pid == "deep" else Action.REJECT, d, "boom")
            for d in deliveries])
        assert all(r.ok for r in results), results
    finally:
        await client.close()
        await broker.close()


@pytest.mark.slow
def test_the_soak_workload_carries_hostile_envelopes():
    from support.soak_workload import FLAKY, generate

    flaky = [m for m in generate(QUEUE, 2000, 7) if m.kind == FLAKY]
    hostile = [envelope.decode(m.raw) for m in flaky if b'"deep"' in m.raw]
    assert len(hostile) >= 5
    for decoded in hostile:
        assert decoded["attempts"] in (INT64_MIN, -1)
        assert decoded["timestamp"] in (INT64_MIN, INT64_MAX)
        depth, value = 2, decoded["payload"]["deep"]
        while isinstance(value, list):
            depth, value = depth + 1, value[0]
        assert 250 <= depth <= 511


def test_the_soak_workload_carries_oversized_envelopes_to_be_parked():
    from support.soak_workload import ENVELOPE_LIMIT, OVERSIZED, generate

    messages = generate(QUEUE, 2000, 7)
    oversized = [m for m in messages if m.kind == OVERSIZED]
    assert len(oversized) >= 4
    for message in oversized:  # valid envelopes PHP runs, over the soak supervisors' limit
        assert len(message.raw) > ENVELOPE_LIMIT and envelope.decode(message.raw)["pid"]
        assert message.pid is None and not message.countable  # checked as parked bytes
    positions = [messages.index(m) for m in oversized]
    assert all(0 < n < len(messages) - 1 for n in positions)  # good ones beside each


def test_the_publish_command_refuses_a_payload_php_could_not_write():
    from supervisor.ops.publish import InputError, read_payloads

    writable = b'{"deep":' + b"[" * 509 + b"]" * 509 + b"}"  # 511 levels in the envelope
    assert read_payloads([writable])
    too_deep = b'{"deep":' + b"[" * 600 + b"]" * 600 + b"}"
    with pytest.raises(InputError, match=r"<stdin>:2: PHP's json_encode refuses it too"):
        read_payloads([writable, too_deep])


# --- the requeue at exit: the same rule as recovery's ----------------------------------


async def test_the_requeue_at_exit_counts_negative_attempts_as_none_and_parks_the_unwritable(
    redis_url, redis_client, caplog
):
    """A supervisor requeues what its killed handlers held at exit with recovery's own rule:
    a negative count is no earlier run (it once came back as -2**63 + 1, retried forever),
    and an envelope PHP cannot write goes to dead alone instead of failing the stop."""
    raws = [raw_envelope("negative", attempts=-(2**63)), raw_envelope("inf", INF_PAYLOAD),
            raw_envelope("plain", attempts=1)]
    for raw in raws:
        await redis_client.lpush(KEYS.ready, raw)
    broker = await new_broker(redis_url, max_attempts=3)
    try:
        deliveries = await receive_all(broker, len(raws))
        await broker.abandon(deliveries)
    finally:
        await broker.close()
    ready = {envelope.decode(raw)["pid"]: envelope.decode(raw)["attempts"]
             for raw in await redis_client.lrange(KEYS.ready, 0, -1)}
    assert ready == {"negative": 1, "plain": 2}
    assert await redis_client.lrange(KEYS.dead, 0, -1) == [b"inf"]
    assert await redis_client.llen(KEYS.processing) == 0
