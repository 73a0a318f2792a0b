"""Every script refuses an argument it cannot apply before its first write (issue 23.2).

Lua does not roll back: a command that fails halfway through a script leaves the writes
before it in place. Each test records the real call the broker (or recovery) makes, then
replays it from the same state with one argument made extreme or invalid, and checks that
the script answers ``QSARG`` and that no key changed; and that the largest valid value
still applies completely.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import redis.exceptions

from broker import envelope
from broker.base import Action, Delivery, Settlement
from broker.redis import RedisBroker
from broker.redis.keys import MAX_TTL, QueueKeys
from broker.redis.recovery import maintain
from broker.redis.scripts import Scripts, lua_source
from support.lua_calls import Recorded, restore, snapshot

QUEUE = "args"
KEYS = QueueKeys("utopia-queue", QUEUE)
#: What no script may accept as a count, a lease or a TTL: above what EXPIRE takes, not a
#: whole number, not a number, negative, NaN, infinite.
BAD_NUMBERS = ["9300000000000000", "1e16", str(MAX_TTL + 1), "1.5", "x", "", "-1", "nan",
               "inf", "0x10"]



async def refused_without_writes(
    client, name: str, keys: list[str], args: list[Any], at: int, bad: str,
    before: dict[bytes, tuple[bytes, bool]],
) -> None:
    await restore(client, before)
    changed = [*args]
    changed[at] = bad
    with pytest.raises(redis.exceptions.ResponseError, match="QSARG"):
        await client.eval(lua_source(name), len(keys), *keys, *changed)
    assert await snapshot(client) == before, f"{name}.lua ARGV[{at + 1}] = {bad!r} wrote"


def raw(pid: str, attempts: int = 0) -> bytes:
    return envelope.encode({"pid": pid, "queue": QUEUE, "timestamp": 1_700_000_000,
                            "payload": {}, "attempts": attempts})


@pytest.fixture
async def broker(redis_brokers):
    return await redis_brokers(QUEUE, consumer_id="args", max_attempts=1, job_ttl=MAX_TTL)


async def claimed(broker: RedisBroker, client, count: int = 3) -> Recorded:
    for i in range(count):
        await client.lpush(KEYS.ready, raw(f"p{i}"))
    recorded = Recorded(broker.scripts)
    received = await broker.receive(count, 0)
    assert len(received.deliveries) == count
    return recorded


async def test_reserve(broker, redis_client):
    for i in range(3):
        await redis_client.lpush(KEYS.ready, raw(f"p{i}"))
    before = await snapshot(redis_client)
    recorded = Recorded(broker.scripts)
    await broker.reserve(3, 1)
    keys, args = recorded.last("reserve")
    for at in range(4):  # n, lease, timeout, size limit
        for bad in [*BAD_NUMBERS, "0" if at < 2 else "-1", "1001" if at == 0 else "-1"]:
            await refused_without_writes(redis_client, "reserve", keys, args, at, bad, before)
    await restore(redis_client, before)
    extreme = [1000, MAX_TTL, MAX_TTL, MAX_TTL]
    assert len(await redis_client.eval(lua_source("reserve"), len(keys), *keys, *extreme)) == 3


async def test_claim(broker, redis_client):
    for i in range(3):
        await redis_client.lpush(KEYS.ready, raw(f"p{i}"))
    reservation = await broker.reserve(3, 0)
    before = await snapshot(redis_client)
    recorded = Recorded(broker.scripts)
    await broker.claim(reservation)
    keys, args = recorded.last("claim")
    for at, bads in ((0, [*BAD_NUMBERS, "0"]), (2, ["1.5", "x", "-1"]),
                     (4, ["1.5", "x", "-1", "nan"])):  # lease, n, pid offset
        for bad in bads:
            await refused_without_writes(redis_client, "claim", keys, args, at, bad, before)
    await restore(redis_client, before)
    args[0] = MAX_TTL
    assert await redis_client.eval(lua_source("claim"), len(keys), *keys, *args) == [b"ok"] * 3
    assert 0 < await redis_client.ttl(KEYS.claim("p0")) <= MAX_TTL


async def test_settle(broker, redis_client):
    """A reject at the last attempt keeps the job record for job_ttl (EXPIRE): the write
    that failed halfway with a job_ttl Redis does not take."""
    await claimed(broker, redis_client)
    deliveries = []
    for i in range(3):
        raw_bytes = await redis_client.get(KEYS.job(f"p{i}"))
        owner = (await redis_client.get(KEYS.owner(f"p{i}"))).decode()
        decoded = envelope.decode(raw_bytes)
        deliveries.append(Delivery(f"p{i}", QUEUE, decoded["timestamp"], 0, {}, raw_bytes,
                                   owner, decoded))
    before = await snapshot(redis_client)
    recorded = Recorded(broker.scripts)
    await broker.settle([Settlement(Action.REJECT, d, "boom") for d in deliveries])
    keys, args = recorded.last("settle")
    assert args[2] == "fff"
    for at, bads in ((0, BAD_NUMBERS), (1, ["1.5", "x", "-1"]), (3, ["1.5", "x", "-1"]),
                     (4, [*BAD_NUMBERS, "0"])):
        for bad in bads:  # job_ttl, n, pid offset, record_ttl
            await refused_without_writes(redis_client, "settle", keys, args, at, bad, before)
    await restore(redis_client, before)
    assert await redis_client.eval(lua_source("settle"), len(keys), *keys, *args) == [b"ok"] * 3
    assert await redis_client.llen(KEYS.failed) == 3
    assert await redis_client.llen(KEYS.processing) == 0
    assert 0 < await redis_client.ttl(KEYS.job("p0")) <= MAX_TTL


async def test_extend(broker, redis_client):
    await claimed(broker, redis_client)
    before = await snapshot(redis_client)
    recorded = Recorded(broker.scripts)
    await broker.abandon([])
    keys, args = recorded.last("extend")
    for bad in BAD_NUMBERS:
        await refused_without_writes(redis_client, "extend", keys, args, 0, bad, before)
    await restore(redis_client, before)
    args[0] = MAX_TTL
    assert await redis_client.eval(lua_source("extend"), len(keys), *keys, *args) == []
    assert 0 < await redis_client.ttl(keys[0]) <= MAX_TTL


async def test_reclaim(broker, redis_client):
    """Dead-lettering keeps the record for job_ttl: EXPIRE came after the pid left
    processing and before it was pushed to dead, so a job_ttl Redis refuses lost it."""
    await claimed(broker, redis_client)
    await redis_client.delete(*(KEYS.claim(f"p{i}") for i in range(3)))  # owners died
    before = await snapshot(redis_client)
    scripts = Scripts(redis_client)
    recorded = Recorded(scripts)
    report = await maintain(redis_client, scripts, KEYS, lock_seconds=5, recovery_age=90000,
                            max_attempts=1, job_ttl=MAX_TTL, force=True)
    assert report.dead_consumers == 3
    keys, args = recorded.last("reclaim")
    for at, bads in ((0, BAD_NUMBERS), (1, [*BAD_NUMBERS, "0"])):  # job_ttl, record_ttl
        for bad in bads:
            await refused_without_writes(redis_client, "reclaim", keys, args, at, bad, before)
    # A counter DECRBY refuses (leading zeros, "-0") is refused before the first write too.
    for bad in (b"007", b"-0", b"+1", b" 1"):
        await restore(redis_client, before)
        await redis_client.set(KEYS.stat("processing"), bad)
        counter = await snapshot(redis_client)
        with pytest.raises(redis.exceptions.ResponseError, match="QSTYPE"):
            await redis_client.eval(lua_source("reclaim"), len(keys), *keys, *args)
        assert await snapshot(redis_client) == counter, bad
    await restore(redis_client, before)
    assert await redis_client.eval(lua_source("reclaim"), len(keys), *keys, *args) == [1] * 3
    assert await redis_client.llen(KEYS.dead) == 3
    assert await redis_client.get(KEYS.stat("processing")) == b"0"
    assert 0 < await redis_client.ttl(KEYS.job("p0")) <= MAX_TTL


async def test_recover_and_expired(broker, redis_client):
    for i in range(3):
        await redis_client.lpush(KEYS.ready, raw(f"p{i}"))
    reservation = await broker.reserve(3, 0)
    await redis_client.zadd(KEYS.reservations, {reservation.key: 1})  # long expired
    before = await snapshot(redis_client)
    keys = [KEYS.reservations, KEYS.ready, reservation.key]
    for bad in [*BAD_NUMBERS, "0", "1001"]:
        await refused_without_writes(redis_client, "recover", keys, [1000, 0], 0, bad, before)
        await refused_without_writes(redis_client, "expired", keys[:1], [1000, 0], 0, bad,
                                     before)
    for bad in BAD_NUMBERS:  # the offset; the grace (no expiry: up to 10 digits)
        await refused_without_writes(redis_client, "expired", keys[:1], [1000, 0], 1, bad,
                                     before)
        if bad != str(MAX_TTL + 1):
            await refused_without_writes(redis_client, "recover", keys, [1000, 0], 1, bad,
                                         before)
    await refused_without_writes(redis_client, "recover", keys, [1000, 0], 1, "10000000000",
                                 before)
    await restore(redis_client, before)
    assert await redis_client.eval(lua_source("recover"), 3, *keys, 1000) == [3, 0]


async def test_retry(redis_client):
    await redis_client.lpush(KEYS.failed, "p0")
    await redis_client.set(KEYS.job("p0"), raw("p0"))
    await redis_client.set(KEYS.error("p0"), b'{"error":"E"}')
    before = await snapshot(redis_client)
    await redis_client.lpush(KEYS.failures("p0"), b'{"error":"E"}')
    before = await snapshot(redis_client)
    keys = [KEYS.failed, KEYS.ready, KEYS.job("p0"), KEYS.error("p0"), KEYS.failures("p0")]
    args = ["p0", raw("p0"), raw("p0", 0)]
    for count in (2, 4, 6):  # arguments missing or left over (6: two items' arguments)
        await restore(redis_client, before)
        with pytest.raises(redis.exceptions.ResponseError, match="QSARG"):
            await redis_client.eval(lua_source("retry"), 5, *keys, *(args * 2)[:count])
        assert await snapshot(redis_client) == before
    with pytest.raises(redis.exceptions.ResponseError, match="QSARG"):  # a key missing
        await redis_client.eval(lua_source("retry"), 4, *keys[:4], *args)
    assert await snapshot(redis_client) == before
    assert await redis_client.eval(lua_source("retry"), 5, *keys, *args) == [b"ok"]
    assert not await redis_client.exists(KEYS.job("p0"), KEYS.error("p0"), KEYS.failures("p0"))


async def test_delete(redis_client):
    await redis_client.lpush(KEYS.failed, "p0")
    await redis_client.set(KEYS.job("p0"), raw("p0"))
    await redis_client.set(KEYS.error("p0"), b'{"error":"E"}')
    before = await snapshot(redis_client)
    await redis_client.lpush(KEYS.failures("p0"), b'{"error":"E"}')
    before = await snapshot(redis_client)
    keys = [KEYS.failed, KEYS.job("p0"), KEYS.error("p0"), KEYS.failures("p0")]
    for count_keys, args in ((3, ["p0"]), (4, []), (4, ["p0", "p1"])):
        with pytest.raises(redis.exceptions.ResponseError, match="QSARG"):
            await redis_client.eval(lua_source("delete"), count_keys, *keys[:count_keys], *args)
        assert await snapshot(redis_client) == before
    assert await redis_client.eval(lua_source("delete"), 4, *keys, "p0") == [b"ok"]
    assert await redis_client.eval(lua_source("delete"), 4, *keys, "p0") == [b"gone"]
    assert not await redis_client.exists(KEYS.failed, KEYS.job("p0"), KEYS.error("p0"),
                                         KEYS.failures("p0"))


async def test_peek(redis_client):
    await redis_client.lpush(KEYS.poison, b"oldest", b"x" * 50)
    for args in (["0", "1001", "10"], ["-1", "1", "10"], ["0", "1", "0"], ["0", "1"],
                 ["0", "x", "10"]):
        with pytest.raises(redis.exceptions.ResponseError, match="QSARG"):
            await redis_client.eval(lua_source("peek"), 1, KEYS.poison, *args)
    sha1 = [hashlib.sha1(entry).hexdigest().encode() for entry in (b"oldest", b"x" * 50)]
    assert await redis_client.eval(lua_source("peek"), 1, KEYS.poison, 0, 1000, 10) == [
        [6, b"oldest", sha1[0]], [50, b"x" * 10, sha1[1]]]
    assert await redis_client.eval(lua_source("peek"), 1, KEYS.poison, 1, 5, 3) == [
        [50, b"xxx", sha1[1]]]


@pytest.mark.parametrize("name", ["reserve", "claim", "settle", "extend", "reclaim", "recover",
                                  "expired", "oldest", "delete", "peek", "promote", "retry"])
async def test_missing_arguments_are_refused(redis_client, name):
    with pytest.raises(redis.exceptions.ResponseError, match="QSARG"):
        await redis_client.eval(lua_source(name), 1, KEYS.ready)
