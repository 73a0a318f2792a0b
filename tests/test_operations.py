"""The operator commands (status, check, recover, retry, publish) against a real redis-server.

Queue state is set up with the real RedisBroker (reserve, claim, reject) or raw commands, the
way producers and other consumers would leave it; each command then runs as the CLI runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from typing import Any

import orjson
import pytest

from broker import envelope
from broker.redis.admin import status as inspect
from supervisor import cli
from supervisor.config import load
from support import envelopes
from support.supervision import NAMESPACE, QUEUE, ROOT, keys, write_config
from support.waiting import until

pytestmark = pytest.mark.usefixtures("no_url_override")


async def push(client, *payloads: dict[str, Any]) -> list[str]:
    """LPUSH envelopes as PHP producers do; the first payload is consumed first."""
    return await envelopes.lpush_each(client, keys().ready, envelopes.of(QUEUE, payloads))


async def server_ms(client) -> int:
    seconds, micros = await client.time()
    return seconds * 1000 + micros // 1000


async def wait_until_expired(client, deadline: float) -> None:
    """Until the server clock passed a registry deadline (whole seconds, as queue 5's)."""
    async def passed() -> bool:
        return await server_ms(client) >= deadline * 1000

    await until(passed, 10.0, "the server clock to pass the deadline", every=0.01)


# -- status -------------------------------------------------------------------------------


async def test_status_json_reports_the_queue_state(conf, run, redis_client, redis_brokers):
    ready_pids = await push(redis_client, *({"n": n} for n in range(4)))
    consumer = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="worker-a", lease=30)
    received = await consumer.receive(2, block_timeout=0)
    reservation = await consumer.reserve(1, block_timeout=0)
    await redis_client.lpush(keys().failed, "f1", "f2")
    await redis_client.lpush(keys().dead, "d1")
    await redis_client.lpush(keys().poison, b"{not json")

    code, out = await run("status", conf, "--json")
    assert code == 0
    state = orjson.loads(out)
    assert state["queue"] == QUEUE and state["namespace"] == NAMESPACE
    assert (state["ready"], state["processing"], state["owners"]) == (1, 2, 2)
    assert (state["failed"], state["dead"], state["poison"]) == (2, 1, 1)
    [listed] = state["reservations"]["lists"]
    assert state["reservations"]["count"] == 1 and state["reservations"]["payloads"] == 1
    assert state["reservations"]["expired"] == 0
    assert listed["key"] == reservation.key and listed["size"] == 1
    assert orjson.loads(listed["payloads"][0])["pid"] == ready_pids[2]
    assert 0 < listed["expires_in_ms"] <= 30_000
    assert state["supervisors"] == []  # a record appears with the first renewal
    await consumer.extend(received.deliveries)
    [live] = orjson.loads((await run("status", conf, "--json"))[1])["supervisors"]
    assert live["id"] == "worker-a" and 0 < live["ttl_ms"] <= 30_000
    assert state["stats"] == {"total": 2, "processing": 2, "success": 0, "failed": 0}
    assert [d.pid for d in received.deliveries] == ready_pids[:2]

    code, text = await run("status", conf)  # the same, for a person
    assert code == 0
    assert "processing    2 (owner records: 2)" in text and "worker-a  " in text


async def test_status_text_escapes_what_it_shows_from_the_broker(conf, run, redis_client,
                                                                 redis_brokers):
    await redis_client.lpush(keys().ready, b'{"pid":"\x1b[2J\r\nforged","x":"' + b"y" * 500
                             + b'"}')
    await (await redis_brokers(QUEUE, namespace=NAMESPACE)).reserve(1, block_timeout=0)
    code, text = await run("status", conf)
    assert code == 0 and "\x1b" not in text and "\r" not in text
    [shown] = [line for line in text.splitlines() if "forged" in line]
    assert '{"pid":"\\x1b[2J\\x0d\\x0aforged"' in shown and "...[cut: 5" in shown
    assert len(shown) < 200


async def test_status_shows_no_control_character_from_the_broker(conf, run, redis_client):
    """Issue 28, L3: a crafted counter, supervisor record and reservation key reach neither
    the text nor the JSON output as terminal controls; the counter is shown as invalid."""
    crafted = "\x1b]0;pwned\x07\x9b31m\u202e"
    await redis_client.set(keys().stat("success"), crafted.encode())
    await redis_client.set(keys().supervisor(f"id{crafted}"), f"host{crafted} 42".encode())
    await redis_client.zadd(keys().reservations, {f"{keys().reservations}.{crafted}": 1})

    def controls(text: str) -> list[str]:
        return [c for c in text if (c < " " and c != "\n") or "\x7f" <= c <= "\x9f"
                or c == "\u202e"]

    code, text = await run("status", conf)
    assert code == 0 and controls(text) == []
    [stats] = [line for line in text.splitlines() if line.startswith("  stats")]
    assert "success invalid '\\x1b]0;pwned\\x07" in stats, stats
    code, out = await run("status", conf, "--json")
    assert code == 0 and controls(out) == []
    assert orjson.loads(out)["stats"]["success"] == crafted  # the data, escaped as JSON


@pytest.mark.slow
async def test_drain_shows_another_hosts_record_escaped(conf, run, redis_client):
    await redis_client.set(keys().supervisor("elsewhere"), b"other\x1b]0;pwned\x07host 42")
    code, out = await run("drain", conf, "--timeout", "2")
    assert code == 1 and "\x1b" not in out and "\x07" not in out
    assert "running on other hosts (drain there too): other\\x1b]0;pwned\\x07host 42" in out
    assert "host other\\x1b]0;pwned\\x07host pid 42 (elsewhere), record without expiry" in out


# -- check and recover ------------------------------------------------------------------------


@pytest.mark.slow
async def test_check_fails_while_a_reservation_remains_and_passes_after_recover(
    conf, run, redis_client, redis_brokers
):
    pids = await push(redis_client, {"n": 1}, {"n": 2})
    # its reservation's deadline is about 1 s away
    dying = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="dying", lease=1)
    await dying.extend([])  # a supervisor's first renewal, at start: it registers its tokens
    reservation = await dying.reserve(2, block_timeout=0)
    assert len(reservation.payloads) == 2

    code, out = await run("check", conf)
    assert code == 1
    assert "1 registered reservations" in out and reservation.key in out

    deadline = await redis_client.zscore(keys().reservations, reservation.key)
    await wait_until_expired(redis_client, deadline)
    async def lapsed() -> bool:  # it died: its record lapses too (within its lease)
        return not await redis_client.exists(keys().supervisor("dying"))

    await until(lapsed, 10, "the dead supervisor's record to lapse", every=0.01)
    code, out = await run("recover", conf)
    assert code == 0 and "recovered 2 deliveries" in out
    assert "2 from expired reservations" in out

    code, out = await run("check", conf)
    assert code == 0 and out.startswith("ok:")
    ready = await redis_client.lrange(keys().ready, 0, -1)
    assert [orjson.loads(raw)["pid"] for raw in reversed(ready)] == pids  # order kept


async def test_check_passes_beside_a_blocking_receive_and_fails_once_it_is_stale(
    conf, run, redis_client, redis_brokers
):
    """A running, idle consumer's empty reservation (its blocking receive) is not a
    leftover (the consumer itself fails the check, as alive); the same registration past
    its deadline is."""
    waiting = await redis_brokers(QUEUE, namespace=NAMESPACE, lease=3)
    await waiting.extend([])
    blocked = asyncio.ensure_future(waiting.receive(1, block_timeout=10))
    await until(lambda: redis_client.zcard(keys().reservations), 5,
                "the blocking receive's registration", every=0.01)
    code, out = await run("check", conf)
    assert code == 1 and "  1 alive " in out and "registered reservations" not in out, out
    [(key, deadline)] = await redis_client.zrange(keys().reservations, 0, -1, withscores=True)
    await redis_client.zadd(keys().reservations, {key: deadline - 20})  # as if its owner died
    code, out = await run("check", conf)
    assert code == 1 and "1 registered reservations" in out
    waiting.stop_waiting()
    await blocked


async def killed_while_waiting(redis_client, redis_brokers, block_timeout: int) -> bytes:
    """A supervisor (lease 1 s) killed inside a blocking receive on the idle queue: its
    BLMOVE ends with its connection, its registration stays, deadline lease + block_timeout
    after it was made, block_timeout past the supervisor's own lapse. Returns its key, once
    the supervisor no longer counts as alive."""
    dying = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="dying", lease=1)
    await dying.extend([])  # its record and its token registry entry, both for 1 s
    blocked = asyncio.ensure_future(dying.receive(1, block_timeout=block_timeout))
    await until(lambda: redis_client.zcard(keys().reservations), 5,
                "the blocking receive's registration", every=0.01)
    blocked.cancel()  # as SIGKILL: nothing of it runs any more, the ZREM included
    with contextlib.suppress(asyncio.CancelledError):
        await blocked
    async def none_alive() -> bool:
        return not await inspect.live_supervisors(redis_client, keys())

    await until(none_alive, 10, "no supervisor alive", every=0.1)
    [(key, deadline)] = await redis_client.zrange(keys().reservations, 0, -1, withscores=True)
    assert deadline > (await redis_client.time())[0]  # registered, not yet expired
    assert not await redis_client.exists(key)  # and empty
    return key


@pytest.mark.slow
async def test_check_fails_while_a_dead_supervisors_blocking_receive_is_registered(
    conf, run, redis_client, redis_brokers
):
    """Once no supervisor of ours is alive, no receive of ours waits in an empty
    registration before its deadline: one left by a supervisor killed while it waited is a
    leftover (drain forgets the token registry entries that say whose it is)."""
    key = await killed_while_waiting(redis_client, redis_brokers, block_timeout=30)
    code, out = await run("check", conf)
    assert code == 1 and "1 registered reservations" in out and key.decode() in out, out
    assert "alive" not in out


@pytest.mark.slow
async def test_drain_waits_out_a_dead_supervisors_blocking_receive(
    conf, run, redis_client, redis_brokers
):
    """drain's "ok" leaves no registration of ours: that of a supervisor killed while it
    waited is removed once its deadline passed (a move into it can land until then)."""
    await killed_while_waiting(redis_client, redis_brokers, block_timeout=8)
    code, out = await run("drain", conf)
    assert code == 0 and "ok: no reservation and no owner record" in out, out
    assert await redis_client.zcard(keys().reservations) == 0
    code, out = await run("check", conf)
    assert code == 0 and out.startswith("ok:"), out


async def test_check_counts_only_what_our_supervisors_hold(
    conf, run, redis_client, redis_url, redis_brokers
):
    """During a rollback PHP queue-5 workers run: what they hold is theirs to settle and
    does not fail the check; what a supervisor of ours holds does."""
    import redis as sync_redis

    from tests.queue5 import Queue5Consumer

    await push(redis_client, {"n": 1}, {"n": 2}, {"n": 3})
    client = sync_redis.Redis.from_url(redis_url)
    try:
        php = Queue5Consumer(client, keys().queue, namespace=keys().namespace)
        assert len(php.receive(1)) == 1 and php.receive_reserve_only(1).batch
        code, out = await run("check", conf)
        assert code == 0 and out.startswith("ok:"), out
        assert "hold 2 reservations and owner records" in out
        ours = await redis_brokers(QUEUE, namespace=NAMESPACE)
        await ours.extend([])
        [delivery] = (await ours.receive(1, block_timeout=0)).deliveries
        code, out = await run("check", conf)
        assert code == 1 and "1 owner records" in out and keys().owner(delivery.pid) in out
    finally:
        client.close()


async def test_check_fails_naming_a_live_supervisor_until_it_stops(
    conf, run, redis_client, redis_brokers
):
    """Issue 39.2: an idle supervisor of ours on the queue (it holds nothing) fails the
    check, named by host and pid; its graceful stop (``abandon``) ends its registry entry
    too, so the check passes at once, not a lease later."""
    idle = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="idle-1", lease=30)
    await idle.extend([])
    code, out = await run("check", conf)
    assert code == 1 and not out.startswith("ok:"), out
    assert "  1 alive " in out
    assert f"host {socket.gethostname()} pid {os.getpid()} (idle-1), lapses in " in out
    code, out = await run("status", conf)
    assert "  supervisors   1" in out
    await idle.abandon([])
    code, out = await run("check", conf)
    assert code == 0 and out.startswith("ok:") and "none of them is alive" in out, out


async def test_check_fails_while_a_registry_entry_is_current_without_a_record(
    conf, run, redis_client
):
    """A current entry in the token registry counts as alive even if the record is gone
    (evicted, deleted by hand, or left by a version that did not end it at a stop)."""
    now = int((await redis_client.time())[0])
    await redis_client.hset(keys().supervisor_tokens, "ab" * 8, f"{now + 30} ghost-7-a1b2c3")
    await redis_client.hset(keys().supervisor_tokens, "cd" * 8, f"{now - 1} gone-8-d4e5f6")
    code, out = await run("check", conf)
    assert code == 1 and "ghost-7-a1b2c3 (no record: its token registry entry is current)" in out
    assert "gone-8" not in out  # its until passed: not alive
    await redis_client.hset(keys().supervisor_tokens, "ab" * 8, f"{now} ghost-7-a1b2c3")
    code, out = await run("check", conf)
    assert code == 0 and out.startswith("ok:"), out


@pytest.mark.slow
async def test_drain_waits_for_supervisors_it_cannot_stop_and_fails_while_they_run(
    conf, run, redis_client, redis_brokers
):
    """Issue 39.2: ``drain`` never reports success while a supervisor of ours it did not
    stop still runs (here one whose record names this very process, which drain never
    signals, as one on another host): it waits up to its timeout, and ends ok once that
    one stopped meanwhile."""
    other = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="other-1", lease=30)
    await other.extend([])
    code, out = await run("drain", conf, "--timeout", "2")
    assert code == 1 and "ok:" not in out, out
    assert f"host {socket.gethostname()} pid {os.getpid()} (other-1)" in out

    draining = asyncio.ensure_future(run("drain", conf, "--timeout", "30"))
    await asyncio.sleep(2)  # drain is waiting for it (a margin: nothing depends on it)
    assert not draining.done()
    await other.abandon([])  # it stops gracefully meanwhile
    code, out = await draining
    assert code == 0 and "ok: no reservation and no owner record" in out, out


@pytest.mark.slow
async def test_check_fails_while_an_owner_record_remains(conf, run, redis_client, redis_brokers):
    [pid] = await push(redis_client, {"n": 1})
    # Claims expire after 3 s; with 1 s the claim could miss its reservation's whole-second
    # deadline (now + lease) and nothing would be delivered.
    dying = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="dying", lease=3)
    await dying.extend([])  # a supervisor's first renewal: its record and token registration
    [delivery] = (await dying.receive(1, block_timeout=0)).deliveries

    code, out = await run("check", conf)
    assert code == 1 and "1 owner records" in out and keys().owner(pid) in out

    async def lapsed() -> bool:  # it died: its claims and its record lapse
        return not await redis_client.exists(keys().claim(pid), keys().supervisor("dying"))

    await until(lapsed, 10, "the dead supervisor's claim and record to lapse", every=0.01)
    code, out = await run("recover", conf)
    assert code == 0 and "1 whose claim lapsed" in out
    code, _ = await run("check", conf)
    assert code == 0
    [requeued] = await redis_client.lrange(keys().ready, 0, -1)
    assert orjson.loads(requeued)["pid"] == pid
    assert orjson.loads(requeued)["attempts"] == 1  # the lost run counts (queue 5)
    assert orjson.loads(requeued)["payload"] == delivery.payload


# -- retry --------------------------------------------------------------------------------------


async def fail_all(redis_client, redis_brokers, count: int) -> list[str]:
    """``count`` messages rejected at max_attempts = 1: in the failed list, attempts 1."""
    pids = await push(redis_client, *({"n": n} for n in range(count)))
    consumer = await redis_brokers(QUEUE, namespace=NAMESPACE, max_attempts=1)
    received = await consumer.receive(count, block_timeout=0)
    await consumer.reject(received.deliveries)
    assert await redis_client.llen(keys().failed) == count
    return pids


async def ready_envelopes(redis_client) -> list[dict[str, Any]]:
    """The ready list in consumption order."""
    return [orjson.loads(raw) for raw in reversed(await redis_client.lrange(keys().ready, 0, -1))]


async def test_retry_keeps_attempts_and_is_bounded_by_limit(conf, run, redis_client, redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 3)
    code, out = await run("retry", conf, "--limit", "2")
    assert code == 0 and "moved 2 failed jobs" in out and "attempts + 1" in out
    moved = await ready_envelopes(redis_client)
    assert [job["pid"] for job in moved] == pids[:2]  # the oldest failures first
    assert [job["attempts"] for job in moved] == [1, 1]
    assert await redis_client.lrange(keys().failed, 0, -1) == [pids[2].encode()]
    assert not await redis_client.exists(*(keys().job(pid) for pid in pids[:2]))
    assert await redis_client.exists(keys().job(pids[2]))


async def test_retry_can_reset_attempts(conf, run, redis_client, redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 2)
    code, out = await run("retry", conf, "--reset-attempts")
    assert code == 0 and "moved 2 failed jobs" in out and "reset to 0" in out
    moved = await ready_envelopes(redis_client)
    assert [(job["pid"], job["attempts"]) for job in moved] == [(pids[0], 0), (pids[1], 0)]
    assert [job["payload"] for job in moved] == [{"n": 0}, {"n": 1}]
    assert await redis_client.llen(keys().failed) == 0


async def test_retry_drops_expired_records_and_takes_from_dead(conf, run, redis_client):
    pid, raw = envelope.build(QUEUE, {"n": 1})
    await redis_client.lpush(keys().dead, "expired-pid", pid)  # the oldest has no record
    await redis_client.set(keys().job(pid), raw)
    await redis_client.set(keys().job("expired-pid"), b"")
    await redis_client.delete(keys().job("expired-pid"))
    code, out = await run("retry", conf, "--from", "dead")
    assert code == 0 and "moved 1 dead jobs" in out and "dropped 1" in out
    [moved] = await redis_client.lrange(keys().ready, 0, -1)
    # As queue 5's retry(): the same payload, attempts + 1 (the pid is kept here).
    assert {**orjson.loads(moved), "timestamp": 0} == {
        **orjson.loads(raw), "timestamp": 0, "attempts": 1}
    assert await redis_client.llen(keys().dead) == 0


async def test_retry_refuses_a_wrong_type_before_writing(conf, run, redis_client, redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 1)
    await redis_client.hset(keys().ready, "x", "y")
    code, _ = await run("retry", conf)
    assert code == 1
    assert await redis_client.lrange(keys().failed, 0, -1) == [pids[0].encode()]


# -- publish --------------------------------------------------------------------------------------


async def test_publish_json_lines_as_php_compatible_envelopes(
    conf, run, redis_client, tmp_path
):
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"url": "https://example.com/a", "n": 1}\n\n{}\n{"n": 3}\n')
    code, out = await run("publish", conf, str(lines), "--verbose")
    assert code == 0
    summary, *pids = out.splitlines()
    assert summary == f"published 3 messages to {QUEUE}" and len(pids) == 3
    raws = list(reversed(await redis_client.lrange(keys().ready, 0, -1)))
    assert [orjson.loads(raw)["pid"] for raw in raws] == pids  # first line consumed first
    assert b'"url":"https:\\/\\/example.com\\/a"' in raws[0]  # PHP's escaped slashes
    assert b'"payload":[]' in raws[1]  # PHP's empty array
    for raw, payload in zip(raws, [{"url": "https://example.com/a", "n": 1}, {}, {"n": 3}],
                            strict=True):
        decoded = envelope.decode(raw)
        assert decoded["queue"] == QUEUE and decoded["payload"] == payload
        assert isinstance(decoded["timestamp"], int) and len(decoded["pid"]) == 23


async def test_publish_refuses_a_bad_line_and_publishes_nothing(
    conf, run, redis_client, tmp_path, capsys
):
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"n": 1}\n[1, 2]\n')
    code = await asyncio.to_thread(cli.main, ["publish", conf, str(lines)])
    assert code == 2
    assert "jobs.jsonl:2: a payload must be a JSON object" in capsys.readouterr().err
    assert await redis_client.llen(keys().ready) == 0


@pytest.mark.parametrize("max_envelope_bytes", [0, 4096])  # 0: half the ring is the limit
async def test_publish_refuses_an_envelope_the_consumers_would_poison(
    tmp_path, redis_url, run, redis_client, redis_brokers, capsys, max_envelope_bytes
):
    conf = str(write_config(tmp_path, redis_url, handler="examples.noop:handle",
                            supervisor={"max_envelope_bytes": max_envelope_bytes}))
    limit = load(conf, import_handler=False).supervisor.envelope_limit()
    # The largest payload that fits, exactly: the envelope of {"x": ""} plus n characters.
    n = limit - len(envelope.build(QUEUE, {"x": ""})[1])
    lines = tmp_path / "jobs.jsonl"
    lines.write_text(f'{{"n": 1}}\n{{"x": "{"a" * (n + 1)}"}}\n')
    code = await asyncio.to_thread(cli.main, ["publish", conf, str(lines)])
    assert code == 2 and await redis_client.llen(keys().ready) == 0  # not even line 1
    [error] = capsys.readouterr().err.splitlines()
    assert error.startswith("error: ") and "jobs.jsonl:2: its envelope would be " in error
    assert f"{limit + 1:,} bytes, above the {limit:,}" in error
    assert ("max_envelope_bytes = 4096" if max_envelope_bytes else "ring_slot_size") in error

    lines.write_text(f'{{"x": "{"a" * n}"}}\n')  # one byte less: published, and consumed
    code, _ = await run("publish", conf, str(lines))
    assert code == 0
    consumer = await redis_brokers(QUEUE, namespace=NAMESPACE, max_envelope_bytes=limit)
    received = await consumer.receive(1, block_timeout=1)
    assert len(received.deliveries) == 1 and not received.poisoned
    assert len(received.deliveries[0].raw) == limit


async def test_operator_commands_exit_2_on_a_bad_config(run, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nqueue = "q"\nhandler = "examples.noop:handle"\nprefetchh = 3\n')
    code = await asyncio.to_thread(cli.main, ["check", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "prefetchh" in err


# -- NATS -------------------------------------------------------------------------------------


async def test_status_of_a_nats_queue_reads_the_stream_and_consumer(run, tmp_path, nats_server):
    from broker.nats import NatsBroker

    conf = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle",
                            nats={"ack_wait": 30}))
    code, out = await run("status", conf, "--json")  # nothing exists yet: nothing created
    assert code == 0 and orjson.loads(out)["stream"] is None

    broker = NatsBroker(nats_server.url, QUEUE, ack_wait=30, max_attempts=3)
    try:
        await broker.connect()
        await broker.publish_many(QUEUE, [{"n": n} for n in range(3)])
        received = await broker.receive(1, block_timeout=5)
        assert len(received.deliveries) == 1
        code, out = await run("status", conf, "--json")
    finally:
        await broker.close()
    state = orjson.loads(out)
    assert code == 0 and state["broker"] == "nats" and state["stream"] == f"Q_{QUEUE.upper()}"
    assert (state["ready"], state["processing"], state["dead"]) == (2, 1, 0)
    assert state["consumer"]["max_deliver"] == 4  # 3 attempts and queue 5's spare delivery
    assert (state["consumer"]["attempts"], state["consumer"]["spare_delivery"]) == (3, 4)


async def test_redis_only_commands_refuse_a_nats_queue(run, tmp_path, capsys):
    conf = str(write_config(tmp_path, "nats://127.0.0.1:1", handler="examples.noop:handle"))
    code = await asyncio.to_thread(cli.main, ["recover", conf])
    assert code == 2 and "for Redis queues only" in capsys.readouterr().err


async def test_check_fails_while_a_previous_format_supervisor_runs(conf, run, redis_client):
    """The previous format's recovery would take every live delivery of this version (and
    of PHP workers): `check` fails while one of those supervisors still has a heartbeat."""
    heartbeat = keys().legacy_consumer("oldhost-4242-abcdef")
    await redis_client.set(heartbeat, "oldhost-4242-abcdef", px=30_000)
    code, out = await run("check", conf)
    assert code == 1
    assert "running supervisors of the previous format" in out and heartbeat in out
    code, out = await run("status", conf)
    assert "previous-format supervisors still running: 1" in out
    await redis_client.delete(heartbeat)
    code, out = await run("check", conf)
    assert code == 0 and out.startswith("ok:")


@pytest.mark.slow
@pytest.mark.parametrize(("args", "says"), [
    (["status", "{conf}", "--bogus"], "unrecognized arguments: --bogus"),
    (["retry", "{conf}", "--limit", "x"], "argument --limit: 'x' is not a whole number of at "
                                          "least 1"),
    (["drain", "{conf}", "--timeout", "nan"], "argument --timeout: 'nan' is not a positive "
                                              "number of seconds"),
    (["recover", "{conf}", "--timeout=-1"], "argument --timeout: '-1' is not a positive "
                                             "number of seconds"),
])
def test_argument_errors_read_well(conf, args, says):
    done = subprocess.run([sys.executable, "-m", "supervisor",
                           *(a.format(conf=conf) for a in args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == f"python -m supervisor {args[0]}: error: {says}"
    assert "usage: python -m supervisor " + args[0] in done.stderr  # its own usage


@pytest.mark.slow
def test_operator_commands_print_no_library_debug_lines(tmp_path, redis_url):
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle",
                          supervisor={"log_level": "debug"})
    done = subprocess.run([sys.executable, "-m", "supervisor", "status", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    loggers = {orjson.loads(line)["logger"] for line in done.stderr.splitlines()
               if line.startswith("{")}
    assert not {name for name in loggers if name.split(".")[0] in ("redis", "nats", "asyncio")}
