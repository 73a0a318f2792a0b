"""``failed`` / ``dead`` / ``poison JOB ACTION`` on a real redis-server (and a Redis Cluster).

Failed jobs are made by the real RedisBroker (reject at max_attempts = 1) or written as a PHP
queue-5 worker leaves them (a pid in the list, its job record, no failure record); failure
records are written as ``broker.failure`` encodes them. Each command runs as the CLI runs it.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from broker import envelope
from broker.failure import Failure
from broker.redis.keys import QueueKeys
from supervisor import cli
from support import envelopes
from support.operator import listed, php_failed
from support.supervision import NAMESPACE, QUEUE, keys, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")

BIDI = "\u202e"  # right-to-left override: reverses what a terminal shows after it



async def fail_all(redis_client, redis_brokers, count: int, **fields) -> list[str]:
    """``count`` jobs rejected at max_attempts = 1 by the real broker: in failed, oldest
    first in the returned order."""
    pids = await envelopes.lpush_each(redis_client, keys().ready,
                                      envelopes.of(QUEUE, ({"n": n, **fields}
                                                           for n in range(count))))
    consumer = await redis_brokers(QUEUE, namespace=NAMESPACE, max_attempts=1)
    received = await consumer.receive(count, block_timeout=0)
    await consumer.reject(received.deliveries)
    assert await redis_client.llen(keys().failed) == count
    return pids


async def record(redis_client, pid: str, message: str = "boom", **fields) -> Failure:
    """The failure record a supervisor keeps beside a failed pid."""
    failure = Failure(error="ValueError", message=message, where="jobs.py:12 in handle",
                      traceback="Traceback (most recent call last):\n  ...\nValueError: "
                      + message, attempt=1, at=1_700_000_000.0, outcome="failed", **fields)
    await redis_client.set(keys().error(pid), failure.encode())
    return failure



# -- list / show ------------------------------------------------------------------------------


async def test_list_shows_oldest_first_with_error_or_no_record(conf, run, redis_client,
                                                               redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 3)
    await record(redis_client, pids[0], "bad input")
    php = await php_failed(redis_client, "failed", {"from": "php"})
    code, out = await run("failed", conf, "list")
    assert code == 0
    title, *rows = out.splitlines()
    assert "failed jobs of e2e: 4" in title and "oldest first" in title
    assert [row.split()[0] for row in rows] == [*pids, php]
    assert "ValueError: bad input" in rows[0] and "2023-11-14 22:13:20Z" in rows[0]
    # The broker's own reject (no error given) writes a record; a PHP worker's writes none.
    assert "Error: unknown error" in rows[1] and "(no record)" in rows[3]
    assert '{"n":0}' in rows[0] and '{"from":"php"}' in rows[3]
    assert "attempt 4" in rows[3]  # a PHP worker's: 3 earlier attempts and the failed one

    code, out = await run("failed", conf, "list", "--json", "--limit", "2")
    state = orjson.loads(out)
    assert code == 0 and state["total"] == 4 and state["order"] == "oldest first"
    assert [job["pid"] for job in state["jobs"]] == pids[:2]
    assert state["jobs"][0]["error"]["class"] == "ValueError"
    assert state["jobs"][1]["error"]["class"] == "Error"  # the broker's record, no text given


async def test_show_prints_the_envelope_the_record_and_its_expiry(conf, run, redis_client,
                                                                  redis_brokers):
    [pid] = await fail_all(redis_client, redis_brokers, 1)
    failure = await record(redis_client, pid)
    await redis_client.expire(keys().job(pid), 3600)
    code, out = await run("failed", conf, "show", pid)
    assert code == 0
    assert f"failed job {pid}" in out and "ValueError: boom" in out
    assert "jobs.py:12 in handle" in out and "Traceback (most recent call last):" in out
    assert "expires in" in out and '"payload":{"n":0}' in out
    code, out = await run("failed", conf, "show", pid, "--json")
    shown = orjson.loads(out)
    assert code == 0 and shown["error"]["traceback"] == failure.traceback
    assert 0 < shown["ttl_ms"] <= 3_600_000
    assert envelope.decode(shown["envelope"].encode())["pid"] == pid

    code, out = await run("failed", conf, "show", "no-such-pid")
    assert code == 1 and "no failed job no-such-pid" in out


async def test_hostile_payloads_are_escaped_and_bounded(conf, run, redis_client):
    script = "<script>alert(1)</script>"
    pid = await php_failed(redis_client, "failed", {"html": script, "bidi": BIDI + "evil\x1b[2J",
                                                     "big": "x" * 100_000})
    await record(redis_client, pid, message=f"{BIDI}\x1b]0;owned\x07" + "m" * 5000)
    code, out = await run("failed", conf, "list")
    assert code == 0
    assert BIDI not in out and "\x1b" not in out and "\x07" not in out
    assert "\\u202e" in out and "\\x1b" in out
    [row] = out.splitlines()[1:]
    assert len(row) < 600 and "[cut:" in row  # 100 KB payload, 2 KB message: a short line
    code, out = await run("failed", conf, "show", pid)
    assert code == 0 and BIDI not in out and "\x1b" not in out
    assert "<script>alert(1)" in out  # plain text to a terminal: shown as stored
    code, out = await run("failed", conf, "show", pid, "--json")
    assert BIDI not in out and "\\u202e" in out


async def test_a_record_over_the_envelope_limit_is_not_read(tmp_path, redis_url, run,
                                                            redis_client):
    conf = str(write_config(tmp_path, redis_url, handler="examples.noop:handle",
                            supervisor={"max_envelope_bytes": 1024}))
    pid = await php_failed(redis_client, "failed", {"big": "x" * 5000})
    code, out = await run("failed", conf, "show", pid)
    assert code == 0 and "over the job's envelope limit, not read" in out
    assert "xxxx" not in out


# -- delete -----------------------------------------------------------------------------------


async def test_delete_by_pid_removes_list_entry_job_and_failure_records(conf, run, redis_client,
                                                                        redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 3)
    for pid in pids:
        await record(redis_client, pid)
    code, out = await run("failed", conf, "delete", pids[1], "--dry-run")
    assert code == 0 and "would delete (dry run, nothing changed) 1" in out
    assert await listed(redis_client) == pids
    assert await redis_client.exists(keys().job(pids[1]), keys().error(pids[1])) == 2

    code, out = await run("failed", conf, "delete", pids[1], "gone-pid")
    assert code == 1  # one named pid was not there
    assert "deleted 1 failed jobs of e2e" in out and pids[1] in out
    assert "not in failed, so untouched" in out and "gone-pid" in out
    assert await listed(redis_client) == [pids[0], pids[2]]
    assert not await redis_client.exists(keys().job(pids[1]), keys().error(pids[1]))
    assert await redis_client.exists(keys().job(pids[0]), keys().error(pids[0])) == 2


async def test_delete_by_count_and_all_oldest_first(conf, run, redis_client, redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 4)
    code, out = await run("failed", conf, "delete", "--count", "2", "--json")
    assert code == 0 and orjson.loads(out)["pids"] == pids[:2]
    assert await listed(redis_client) == pids[2:]
    code, out = await run("failed", conf, "delete", "--all", "--dry-run")
    assert code == 0 and "would delete (dry run, nothing changed) 2" in out
    assert await listed(redis_client) == pids[2:]
    code, out = await run("failed", conf, "delete", "--all")
    assert code == 0 and "deleted 2" in out
    assert await redis_client.llen(keys().failed) == 0
    assert not await redis_client.exists(*(keys().job(pid) for pid in pids))


async def test_delete_needs_exactly_one_selection(conf, run, redis_client, capsys):
    code = await asyncio.to_thread(cli.main, ["failed", conf, "delete"])
    assert code == 2 and "exactly one of" in capsys.readouterr().err
    code = await asyncio.to_thread(cli.main, ["dead", conf, "retry", "p1", "--all"])
    assert code == 2


async def test_a_pid_deleted_meanwhile_is_skipped_not_doubled(redis_client, redis_brokers):
    """Two operators delete and retry the same pids at once: each pid is acted on once."""
    from broker.redis.admin import lists
    from broker.redis.admin.retry import retry
    from broker.redis.keys import QueueKeys

    pids = await fail_all(redis_client, redis_brokers, 50)
    for pid in pids:
        await record(redis_client, pid)
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE)
    qk = QueueKeys(NAMESPACE, QUEUE)
    deleted, moved = await asyncio.gather(
        lists.delete(broker.client, broker.scripts, qk, "failed", pids),
        retry(broker.client, broker.scripts, qk, pids=pids),
    )
    assert sorted(deleted.deleted + moved.moved_pids) == sorted(pids)
    assert sorted(deleted.missing + moved.missing) == sorted(pids)  # the other one's
    ready = [envelope.decode(raw)["pid"] for raw in await redis_client.lrange(keys().ready, 0, -1)]
    assert sorted(ready) == sorted(moved.moved_pids)
    assert await redis_client.llen(keys().failed) == 0
    assert not await redis_client.exists(*(keys().error(pid) for pid in pids))


# -- retry ------------------------------------------------------------------------------------


async def test_retry_by_pid_moves_it_and_deletes_its_failure_record(conf, run, redis_client,
                                                                   redis_brokers):
    pids = await fail_all(redis_client, redis_brokers, 3)
    for pid in pids:
        await record(redis_client, pid)
    code, out = await run("failed", conf, "retry", pids[2], "--dry-run")
    assert code == 0 and "would move (dry run, nothing changed) 1" in out
    assert await listed(redis_client) == pids and await redis_client.llen(keys().ready) == 0

    code, out = await run("failed", conf, "retry", pids[2], "--reset-attempts")
    assert code == 0 and "moved 1 failed jobs of e2e back to the ready list" in out
    [raw] = await redis_client.lrange(keys().ready, 0, -1)
    assert (envelope.decode(raw)["pid"], envelope.decode(raw)["attempts"]) == (pids[2], 0)
    assert await listed(redis_client) == pids[:2]
    assert not await redis_client.exists(keys().job(pids[2]), keys().error(pids[2]))
    assert await redis_client.exists(keys().error(pids[0]))

    code, out = await run("failed", conf, "retry", pids[2])  # retried already
    assert code == 1 and "not in failed, so untouched" in out
    assert await redis_client.llen(keys().ready) == 1  # not doubled


async def test_retry_by_count_from_dead_and_the_old_command_deletes_records(
        conf, run, redis_client):
    pids = [await php_failed(redis_client, "dead", {"n": n}) for n in range(3)]
    for pid in pids:
        await record(redis_client, pid)
    code, out = await run("dead", conf, "retry", "--count", "2", "--json")
    assert code == 0 and orjson.loads(out)["pids"] == pids[:2]
    assert await listed(redis_client, "dead") == pids[2:]
    code, out = await run("retry", conf, "--from", "dead", "--dry-run")
    assert code == 0 and "would move (dry run, nothing changed) 1 dead jobs" in out
    assert await listed(redis_client, "dead") == pids[2:]
    code, out = await run("retry", conf, "--from", "dead")  # the command as before
    assert code == 0 and "moved 1 dead jobs" in out
    assert not await redis_client.exists(*(keys().error(pid) for pid in pids))
    assert await redis_client.llen(keys().ready) == 3


async def test_an_expired_job_record_drops_the_pid_and_its_failure_record(conf, run,
                                                                          redis_client):
    await redis_client.lpush(keys().failed, "expired-pid")
    await record(redis_client, "expired-pid")
    code, out = await run("failed", conf, "retry", "--all")
    assert code == 0 and "dropped 1 pids whose job record had expired" in out
    assert not await redis_client.exists(keys().failed, keys().error("expired-pid"))


# -- poison -----------------------------------------------------------------------------------


async def test_poison_list_show_delete(conf, run, redis_client):
    await redis_client.lpush(keys().poison, b"{not json", b"\x1b[31m" + b"y" * 100_000,
                             b"third")
    code, out = await run("poison", conf, "list")
    assert code == 0 and "poison jobs of e2e: 3" in out and "\x1b" not in out
    rows = out.splitlines()[1:]
    assert rows[0].startswith("  0  9 bytes  {not json") and "100,005 bytes" in rows[1]
    assert len(out) < 2000
    code, out = await run("poison", conf, "show", "2")
    assert code == 0 and "third" in out
    code, out = await run("poison", conf, "delete", "--count", "2", "--dry-run")
    assert code == 0 and await redis_client.llen(keys().poison) == 3
    code, out = await run("poison", conf, "delete", "--count", "2")
    assert code == 0 and await redis_client.lrange(keys().poison, 0, -1) == [b"third"]


# -- Redis Cluster ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_failed_commands_on_a_redis_cluster(tmp_path, run, redis_cluster):
    import redis.asyncio as aioredis

    namespace = "{app}"
    conf = str(write_config(tmp_path, redis_cluster.url, handler="examples.noop:handle",
                            broker={"namespace": namespace, "cluster": True}))
    qk = QueueKeys(namespace, QUEUE)
    client = aioredis.RedisCluster.from_url(redis_cluster.url)
    try:
        pids = []
        for n in range(3):
            pid, raw = envelope.build(QUEUE, {"n": n})
            await client.set(qk.job(pid), raw)
            await client.lpush(qk.failed, pid)
            await client.set(qk.error(pid), Failure(error="E", message=str(n)).encode())
            pids.append(pid)
        code, out = await run("failed", conf, "list")
        assert code == 0 and "E: 0" in out and "E: 2" in out
        code, out = await run("failed", conf, "show", pids[0])
        assert code == 0 and "E: 0" in out
        code, out = await run("failed", conf, "delete", pids[0])
        assert code == 0 and not await client.exists(qk.job(pids[0]), qk.error(pids[0]))
        code, out = await run("failed", conf, "retry", "--all")
        assert code == 0 and await client.llen(qk.ready) == 2
        assert not await client.exists(qk.error(pids[1]), qk.error(pids[2]))
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_count_and_all_go_past_one_script_call_of_1000(conf, run, redis_client):
    pipe = redis_client.pipeline(transaction=False)
    pids = []
    for n in range(2500):
        pid, raw = envelope.build(QUEUE, {"n": n})
        pipe.set(keys().job(pid), raw)
        pipe.set(keys().error(pid), Failure(error="E").encode())
        pipe.lpush(keys().failed, pid)
        pids.append(pid)
    await pipe.execute()
    code, out = await run("failed", conf, "retry", "--count", "1200", "--json")
    assert code == 0 and orjson.loads(out)["pids"] == pids[:1200]
    code, out = await run("failed", conf, "delete", "--all")
    assert code == 0 and "deleted 1300 failed jobs" in out and "... and 1280 more" in out
    assert await redis_client.llen(keys().failed) == 0
    assert await redis_client.llen(keys().ready) == 1200
    assert not await redis_client.exists(*(keys().error(pid) for pid in pids))
