"""Oversized payloads never cross the wire (issue 28 M1).

reserve.lua moves a payload over the size limit straight to poison and answers with its
length; the progress line's age reads the tail only when it is within the limit. What
crossed the wire is measured by the server's own count of bytes sent
(``INFO stats total_net_output_bytes``), which is exact and needs no timing.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from broker import envelope
from broker.redis.keys import QueueKeys
from support.supervision import (
    NAMESPACE,
    QUEUE,
    Supervisor,
    lines,
    wait_for,
    write_config,
)

KEYS = QueueKeys(NAMESPACE, QUEUE)
LIMIT = 64 * 1024
BIG = 4 * 1024 * 1024


def oversized(n: int, size: int = BIG) -> bytes:
    return envelope.build(QUEUE, {"n": n, "blob": "x" * size})[1]


async def sent_by_server(client) -> int:
    return int((await client.info("stats"))["total_net_output_bytes"])


@pytest.fixture
async def broker(redis_brokers):
    return await redis_brokers(QUEUE, namespace=NAMESPACE, max_envelope_bytes=LIMIT)


async def test_a_batch_keeps_its_good_payloads_and_poisons_the_oversized(broker, redis_client):
    good = [envelope.build(QUEUE, {"n": n}) for n in range(4)]
    big = [oversized(n) for n in range(2)]
    batch = [good[0][1], big[0], good[1][1], good[2][1], big[1], good[3][1]]
    await redis_client.lpush(KEYS.ready, *batch)  # the first pushed is taken first
    before = await sent_by_server(redis_client)
    received = await broker.receive(10, 0)
    sent = await sent_by_server(redis_client) - before
    assert [d.pid for d in received.deliveries] == [pid for pid, _ in good]
    assert len(received.poisoned) == 2
    for poisoned in received.poisoned:
        assert poisoned.raw == b""
        assert f"exceeds {LIMIT}" in poisoned.reason and str(len(big[0])) in poisoned.reason
    assert sent < BIG // 4, f"{sent} bytes crossed the wire"
    # Nothing lost: the oversized payloads are in poison byte for byte, the rest claimed.
    assert sorted(await redis_client.lrange(KEYS.poison, 0, -1)) == sorted(big)
    assert await redis_client.llen(KEYS.ready) == 0
    assert await redis_client.zcard(KEYS.reservations) == 0
    assert await redis_client.get(KEYS.stat("total")) == b"4"


async def test_only_oversized_payloads(broker, redis_client):
    await redis_client.lpush(KEYS.ready, oversized(0))
    received = await broker.receive(10, 1)
    assert received.deliveries == [] and len(received.poisoned) == 1
    assert await redis_client.llen(KEYS.poison) == 1
    assert await redis_client.zcard(KEYS.reservations) == 0  # nothing registered to wait


@pytest.mark.slow
async def test_an_idle_receive_drops_an_oversized_move_unread(broker, redis_client):
    """On an idle queue the blocking BLMOVE returns what it moved: the connection reads
    the length, drops the connection (Redis stops sending) and claim.lua poisons it."""
    huge = oversized(0, 64 * 1024 * 1024)
    waiting = asyncio.ensure_future(broker.receive(10, 30))
    for _ in range(500):
        if int((await redis_client.info("clients"))["blocked_clients"]) == 1:
            break
        await asyncio.sleep(0.02)
    before = await sent_by_server(redis_client)
    await redis_client.lpush(KEYS.ready, huge)
    received = await asyncio.wait_for(waiting, 30)
    sent = await sent_by_server(redis_client) - before
    assert received.deliveries == [] and len(received.poisoned) == 1
    assert f"envelope of {len(huge)} bytes exceeds {LIMIT}" in received.poisoned[0].reason
    assert sent < len(huge) // 2, f"{sent} bytes crossed the wire"
    assert await redis_client.lrange(KEYS.poison, 0, -1) == [huge]
    assert await redis_client.zcard(KEYS.reservations) == 0
    # The connection it dropped is replaced: the next idle receive works.
    pid, raw = envelope.build(QUEUE, {})
    waiting = asyncio.ensure_future(broker.receive(10, 30))
    await redis_client.lpush(KEYS.ready, raw)
    assert [d.pid for d in (await asyncio.wait_for(waiting, 30)).deliveries] == [pid]


async def test_the_progress_age_does_not_read_an_oversized_tail(broker, redis_client):
    await redis_client.lpush(KEYS.ready, oversized(0))
    before = await sent_by_server(redis_client)
    assert await broker.oldest_ready_age() is None
    assert await sent_by_server(redis_client) - before < BIG // 4
    await redis_client.delete(KEYS.ready)
    assert await broker.oldest_ready_age() is None
    await redis_client.lpush(KEYS.ready, envelope.build(QUEUE, {})[1])
    age = await broker.oldest_ready_age()
    assert age is not None and 0 <= age < 3600


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_supervisor_runs_the_good_ones_and_never_holds_a_50_mb_envelope(
    tmp_path, redis_url, client
):
    config = write_config(tmp_path, redis_url, job={"prefetch": 10},
                          supervisor={"max_envelope_bytes": 1 << 20, "lease": 30})
    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        warm = [envelope.build(QUEUE, {"n": n}) for n in range(3)]
        client.lpush(KEYS.ready, *(raw for _, raw in warm))
        wait_for(lambda: len(lines(tmp_path / "handled")) == 3, 30, "the first messages")
        baseline = peak_rss_kib(supervisor.pid)
        good = [envelope.build(QUEUE, {"n": n}) for n in range(3, 7)]
        huge = oversized(99, 50 * 1024 * 1024)
        client.lpush(KEYS.ready, good[0][1], good[1][1], huge, good[2][1], good[3][1])
        wait_for(lambda: len(lines(tmp_path / "handled")) == 7, 30, "the good ones")
        wait_for(lambda: client.llen(KEYS.poison) == 1, 30, "the oversized one in poison")
        peak = peak_rss_kib(supervisor.pid)
        # Once more on an idle queue: its blocking move takes the envelope.
        wait_for(lambda: int(client.info("clients")["blocked_clients"]) == 1, 30, "idle")
        client.lpush(KEYS.ready, huge)
        wait_for(lambda: client.llen(KEYS.poison) == 2, 30, "the idle one in poison")
        idle_peak = peak_rss_kib(supervisor.pid)
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0
    finally:
        supervisor.stop()
    handled = set(lines(tmp_path / "handled"))
    assert handled == {pid for pid, _ in warm + good}
    assert client.lrange(KEYS.poison, 0, -1) == [huge, huge]
    output = supervisor.output()
    assert f"envelope of {len(huge)} bytes exceeds {1 << 20}" in output, output
    print(f"supervisor peak RSS: {baseline} KiB before, {peak} KiB after a 50 MiB envelope "
          f"in a batch, {idle_peak} KiB after one taken by an idle receive")
    assert idle_peak - baseline < 20 * 1024, (baseline, peak, idle_peak)


# --- job records a PHP worker claimed: no size limit there ------------------------------


async def test_a_sweep_and_retry_never_read_an_oversized_job_record(redis_client, redis_url):
    """PHP claims any size; recovery and the operator's retry read job records through
    records.lua, which answers one over the limit with its length: the sweep recovers it
    unread to dead once it is old by its pid (kept while its age cannot be known), and
    retry leaves it where it is."""
    from broker.redis import recovery
    from broker.redis.admin.retry import retry
    from broker.redis.scripts import Scripts

    keys = QueueKeys("utopia-queue", "oversized-records")
    scripts = Scripts(redis_client)
    big = b'{"pid":"%s","queue":"q","timestamp":1,"payload":{"x":"' + b"x" * 4096 + b'"}}'
    old_uniqid = "5f5e100" + "0" * 6 + ".12345678"  # uniqid of 1e8 s: older than any age
    for pid in (old_uniqid, "no-uniqid"):
        await redis_client.set(keys.job(pid), big % pid.encode())
        await redis_client.set(keys.owner(pid), "a" * 32)  # a PHP worker's token
        await redis_client.lpush(keys.processing, pid)
    before = (await redis_client.info("stats"))["total_net_output_bytes"]
    report = await recovery.maintain(
        redis_client, scripts, keys, lock_seconds=5, recovery_age=60, max_attempts=3,
        force=True, max_record_bytes=1024)
    sent = (await redis_client.info("stats"))["total_net_output_bytes"] - before
    assert report.dead_consumers == 1
    assert await redis_client.lrange(keys.dead, 0, -1) == [old_uniqid.encode()]
    assert await redis_client.lrange(keys.processing, 0, -1) == [b"no-uniqid"]
    assert sent < 4096, f"{sent} bytes sent: a record over the limit crossed the wire"

    await redis_client.lpush(keys.failed, "no-uniqid")
    moved = await retry(redis_client, scripts, keys, source="failed", max_record_bytes=1024)
    assert (moved.moved, moved.malformed) == (0, 1)
    assert await redis_client.lrange(keys.failed, 0, -1) == [b"no-uniqid"]


async def test_status_shows_a_large_reservation_without_reading_its_payloads(redis_client):
    """A reservation may hold payloads of any size (a PHP worker takes them all): status
    measures the list first and reads its payloads only when it is small."""
    from broker.redis.admin import status as inspect

    keys = QueueKeys("utopia-queue", "oversized-status")
    small, large = keys.reservation("a" * 32), keys.reservation("b" * 32)
    await redis_client.rpush(small, b'{"pid":"s"}')
    await redis_client.rpush(large, b"x" * (inspect.PEEK_BYTES + 1))
    await redis_client.zadd(keys.reservations, {small: 1, large: 2})
    before = (await redis_client.info("stats"))["total_net_output_bytes"]
    shown = await inspect.reservations(redis_client, keys)
    sent = (await redis_client.info("stats"))["total_net_output_bytes"] - before
    assert sent < inspect.PEEK_BYTES, f"{sent} bytes sent: the large payload was read"
    lists = {item["key"]: item for item in shown["lists"]}
    assert lists[small]["payloads"] == ['{"pid":"s"}']
    [note] = lists[large]["payloads"]
    assert note.endswith("bytes in all: not read)") and lists[large]["size"] == 1
