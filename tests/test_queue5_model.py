"""The queue-5 PHP consumer model (tests/queue5.py) against a private redis-server.

These pin the model to the PHP broker's behaviour (the RedisReservationTest and
RedisBrokerRecoveryTest cases of appwrite/appwrite packages/queue), so mixed-fleet tests
can trust it as the "foreign" consumer.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import redis

from tests.queue5 import (
    Message,
    NotOwned,
    Queue5Consumer,
    SettlementFailed,
    php_float,
    php_json_decode,
    php_json_encode,
)

NS, Q = "utopia-queue", "jobs"
PID = re.compile(r"^[0-9a-f]{13}\d\.\d{8}$")


def k(kind: str, *rest: str) -> str:
    return ".".join((NS, kind, Q, *rest))


def consumer(client: redis.Redis, **options) -> Queue5Consumer:
    worker = Queue5Consumer(client, Q, **options)
    worker.pop_timeout = 0.1
    return worker


def counters(client: redis.Redis) -> dict[str, int]:
    names = ("total", "processing", "success", "failed")
    return {n: int(client.get(k("stats", n)) or 0) for n in names}


def stale(client: redis.Redis, msg: Message) -> None:
    """The heartbeat lapses (the claims key expires)."""
    client.delete(k("claims", msg.pid))


def test_batch_claim_and_independent_outcomes(client: redis.Redis) -> None:
    php = consumer(client)
    pids = [php.publish({"n": n}) for n in range(3)]
    batch = php.receive(3)
    assert [m.pid for m in batch] == pids
    assert [m.payload for m in batch] == [{"n": 0}, {"n": 1}, {"n": 2}]
    token = batch[0].receipt
    assert re.fullmatch(r"[0-9a-f]{32}", token) and {m.receipt for m in batch} == {token}
    for m in batch:
        assert client.get(k("owners", m.pid)) == token.encode()
        assert client.ttl(k("owners", m.pid)) == -1
        assert client.get(k("jobs", m.pid)) == m.raw and client.ttl(k("jobs", m.pid)) == -1
        assert 0 < client.ttl(k("claims", m.pid)) <= 90
    assert client.lrange(k("processing"), 0, -1) == [p.encode() for p in reversed(pids)]
    assert client.zcard(k("reservations")) == 0 and not client.exists(k("reservations", token))
    assert counters(client) == {"total": 3, "processing": 3, "success": 0, "failed": 0}

    php.commit(batch[0])
    php.reject(batch[1])
    php.release(batch[2])
    assert counters(client) == {"total": 3, "processing": 0, "success": 1, "failed": 1}
    assert client.lrange(k("failed"), 0, -1) == [pids[1].encode()]
    assert client.lrange(k("queue"), 0, -1) == [batch[2].raw]
    assert client.exists(k("jobs", pids[1])) and client.ttl(k("jobs", pids[1])) == -1
    assert not client.exists(k("jobs", pids[0]), k("jobs", pids[2]), k("owners", pids[1]))
    assert client.llen(k("processing")) == 0
    with pytest.raises(NotOwned):
        php.commit(batch[0])


def test_reject_keeps_payload_for_job_ttl_and_release_keeps_order(client: redis.Redis) -> None:
    php = consumer(client, job_ttl=30)
    pids = [php.publish({"n": n}) for n in range(3)]
    first, *rest = php.receive(3)
    php.reject(first)
    assert 0 < client.ttl(k("jobs", first.pid)) <= 30
    php.release(*rest)
    assert [m.pid for m in php.receive(2)] == pids[1:]


def test_reservation_holds_the_most_recent_pop_at_its_head(client: redis.Redis) -> None:
    php = consumer(client)
    for n in range(3):
        php.publish({"n": n})
    before = int(client.time()[0])
    reserved = php.receive_reserve_only(3)
    after = int(client.time()[0])  # the reserve ran in one of the seconds before..after
    assert client.lrange(reserved.key, 0, -1) == list(reversed(reserved.batch))
    assert reserved.key == k("reservations", reserved.token)
    assert before + 90 <= client.zscore(k("reservations"), reserved.key) <= after + 90


def test_killed_blocking_receiver_leaves_a_registered_reservation(client: redis.Redis) -> None:
    php = consumer(client)
    before = int(client.time()[0])
    got = []
    receiver = threading.Thread(target=lambda: got.append(php.receive_reserve_only(1, timeout=5)))
    receiver.start()
    deadline = time.monotonic() + 5
    while not client.zcard(k("reservations")):  # registered before it blocks
        assert time.monotonic() < deadline, "no registration"
        time.sleep(0.01)
    after = int(client.time()[0])
    # Registered before blocking: deadline now + lease + timeout, in integer seconds.
    (key, score), = client.zrange(k("reservations"), 0, -1, withscores=True)
    assert before + 95 <= score <= after + 95
    php.publish({"late": True})
    receiver.join(5)
    (reserved,) = got  # the PHP worker dies here, before its claim
    assert key.decode() == reserved.key and client.lrange(reserved.key, 0, -1) == reserved.batch

    sweeper = consumer(client)
    sweeper.maintain()  # not expired yet: untouched
    assert client.lrange(reserved.key, 0, -1) == reserved.batch
    client.zadd(k("reservations"), {reserved.key: before - 1})  # the deadline passes
    client.delete(k("reap-lock"))
    sweeper.maintain()
    assert client.lrange(k("queue"), 0, -1) == reserved.batch
    assert not client.exists(reserved.key) and client.zcard(k("reservations")) == 0
    assert [m.payload for m in sweeper.receive()] == [{"late": True}]


def test_a_late_claim_fails_and_leaves_the_payload_recoverable(client: redis.Redis) -> None:
    php = consumer(client)
    php.publish({"n": 1})
    reserved = php.receive_reserve_only(1)
    client.zadd(k("reservations"), {reserved.key: 1})
    with pytest.raises(redis.ResponseError, match="Queue reservation expired"):
        php.claim(reserved)
    assert client.lrange(reserved.key, 0, -1) == reserved.batch
    consumer(client).maintain()
    assert client.lrange(k("queue"), 0, -1) == reserved.batch


@pytest.mark.slow
def test_an_empty_blocking_reservation_is_registered_and_later_dropped(client: redis.Redis) -> None:
    php = consumer(client)
    assert php.receive(2, timeout=1) == []
    (key,) = client.zrange(k("reservations"), 0, -1)
    client.zadd(k("reservations"), {key: 1})
    php.maintain()
    assert client.zcard(k("reservations")) == 0


def test_poison(client: redis.Redis) -> None:
    php = consumer(client)
    bad = [b"not json", b'{"pid":"a","queue":"jobs"}', b"[1,2]", b'"text"', b"{}",
           b'{"pid":null,"queue":"jobs","timestamp":1}', b'{"pid":"b","queue":"jobs",'
           b'"timestamp":1,"payload":"text"}', b'{"pid":[],"queue":"jobs","timestamp":1}',
           b'{"pid":"c","queue":"jobs","timestamp":1,"attempts":"many"}', b"\xff{}",
           b'{"pid":"d","queue":"jobs","timestamp":NaN}',
           b'{"pid":"\\ud800","queue":"q","timestamp":1}']
    good = [b'{"pid":7,"queue":"jobs","timestamp":"12abc"}',
            b'{"pid":"e","queue":"jobs","timestamp":1.9,"payload":[1],"attempts":"2"}']
    client.lpush(k("queue"), *bad, *good)
    messages = php.receive(20)
    assert [(m.pid, m.timestamp, m.payload, m.attempts) for m in messages] == [
        ("7", 12, [], 0), ("e", 1, [1], 2)]
    assert sorted(client.lrange(k("poison"), 0, -1)) == sorted(bad)
    assert counters(client)["total"] == 2 and counters(client)["processing"] == 2
    assert client.get(k("jobs", "7")) == good[0]


def test_an_all_poison_batch_still_writes_zero_counters(client: redis.Redis) -> None:
    client.lpush(k("queue"), b"junk")
    assert consumer(client).receive() == []
    assert client.get(k("stats", "total")) == b"0" and client.get(k("stats", "processing")) == b"0"


def test_heartbeat_expiry_does_not_prevent_settlement_but_takeover_does(
        client: redis.Redis) -> None:
    php = consumer(client)
    php.publish({"n": 1})
    php.publish({"n": 2})
    first, second = php.receive(2)
    stale(client, first)
    stale(client, second)
    php.commit(first)  # liveness lapsed, ownership did not

    assert consumer(client, reap_after=0).reap(0) == 1  # another worker takes over
    php.extend(second)
    assert not client.exists(k("claims", second.pid))  # extend never resurrects
    with pytest.raises(NotOwned):
        php.commit(second)
    assert counters(client) == {"total": 2, "processing": 0, "success": 1, "failed": 0}


def test_extend_renews_the_claim_of_an_owner(client: redis.Redis) -> None:
    php = consumer(client, claim_ttl=20)
    php.publish({})
    (msg,) = php.receive()
    client.expire(k("claims", msg.pid), 5)
    php.extend(msg)
    assert 5 < client.ttl(k("claims", msg.pid)) <= 20


def test_missing_release_payload_keeps_ownership(client: redis.Redis) -> None:
    php = consumer(client)
    php.publish({"n": 1})
    (msg,) = php.receive()
    client.delete(k("jobs", msg.pid))
    with pytest.raises(SettlementFailed, match="payload is missing"):
        php.release(msg)
    assert client.get(k("owners", msg.pid)) == msg.receipt.encode()
    assert client.lrange(k("processing"), 0, -1) == [msg.pid.encode()]
    assert counters(client)["processing"] == 1
    php.commit(msg)
    assert counters(client) == {"total": 1, "processing": 0, "success": 1, "failed": 0}


def test_reap_requeues_a_stranded_claim_with_a_new_pid(client: redis.Redis) -> None:
    php = consumer(client)
    pid = php.publish({"path": "a/b", "n": 1})
    (msg,) = php.receive()
    stale(client, msg)  # the PHP worker died; its heartbeat lapses
    assert consumer(client, reap_after=0).maintain() == 1

    (raw,) = client.lrange(k("queue"), 0, -1)
    text = raw.decode()
    assert re.fullmatch(r'\{"pid":"[^"]+","queue":"jobs","timestamp":\d+,'
                        r'"payload":\{"path":"a\\/b","n":1\},"attempts":1\}', text)
    envelope = php_json_decode(raw)
    assert PID.match(envelope["pid"]) and envelope["pid"] != pid
    assert not client.exists(k("jobs", pid), k("owners", pid), k("claims", pid))
    assert client.llen(k("processing")) == 0 and counters(client)["processing"] == 0
    assert client.get(k("reap-cursor")) == b"0:0"
    assert php.receive()[0].attempts == 1


def test_reap_dead_verdicts(client: redis.Redis) -> None:
    php = consumer(client)
    php.publish({})
    (msg,) = php.receive()
    stale(client, msg)
    assert consumer(client, reap_after=0, max_attempts=0, job_ttl=50).maintain() == 0
    assert client.lrange(k("dead"), 0, -1) == [msg.pid.encode()]
    assert 0 < client.ttl(k("jobs", msg.pid)) <= 50 and client.llen(k("queue")) == 0


def test_a_heartbeated_claim_is_never_reaped(client: redis.Redis) -> None:
    php = consumer(client)
    php.publish({})
    (msg,) = php.receive()
    php.extend(msg)
    assert consumer(client, reap_after=0).maintain() == 0
    assert client.lrange(k("processing"), 0, -1) == [msg.pid.encode()]
    assert client.get(k("reap-cursor")) == b"1:0"
    php.commit(msg)


def test_the_reap_lock_admits_one_sweep_per_interval(client: redis.Redis) -> None:
    first, second = consumer(client), consumer(client)
    before = int(time.time())
    assert first.maintain() == 0
    assert second.maintain() is None and first.maintain() is None
    assert before <= int(client.get(k("reap-lock"))) <= before + 1
    assert 0 < client.ttl(k("reap-lock")) <= 60


def test_the_cursor_walks_oldest_first_and_wraps(client: redis.Redis) -> None:
    php = consumer(client)
    for n in range(5):
        php.publish({"n": n})
    batch = php.receive(5)
    stale(client, batch[0])  # only the oldest is stranded
    sweeper = consumer(client)
    assert sweeper.reap(0, scan=2) == 1
    assert client.get(k("reap-cursor")) == b"1:3"
    sweeper.reap(0, scan=2)
    assert client.get(k("reap-cursor")) == b"3:1"
    sweeper.reap(0, scan=2)
    assert client.get(k("reap-cursor")) == b"4:0"
    sweeper.reap(0, scan=2)  # retained >= size: wraps
    assert client.get(k("reap-cursor")) == b"2:2"
    client.set(k("reap-cursor"), b"junk")
    sweeper.reap(0, scan=2)
    assert client.get(k("reap-cursor")) == b"2:2"


def test_reap_drops_an_entry_whose_job_and_owner_are_gone(client: redis.Redis) -> None:
    client.lpush(k("processing"), b"ghost")
    assert consumer(client).reap(0, scan=10) == 0
    assert client.llen(k("processing")) == 0 and client.get(k("reap-cursor")) == b"0:0"
    client.lpush(k("processing"), b"orphan")
    client.set(k("owners", "orphan"), b"x")
    with pytest.raises(RuntimeError, match="payload is missing"):
        consumer(client).reap(0, scan=10)


def test_coalescing_marker_is_freed_on_commit(client: redis.Redis) -> None:
    php = consumer(client)
    marker = k("pending", b"user:1".hex())
    assert php.coalesce({"n": 1}, "user:1") is True
    assert php.coalesce({"n": 2}, "user:1") is False
    assert client.llen(k("queue")) == 1 and 0 < client.ttl(marker) <= 86400
    (msg,) = php.receive()
    assert msg.key == "user:1" and client.get(marker) == msg.pid.encode()
    assert b'"key":"user:1"}' in msg.raw
    php.commit(msg)
    assert not client.exists(marker)
    assert php.coalesce({"n": 3}, "user:1") is True


def test_coalescing_marker_survives_release_and_follows_a_reaped_copy(
        client: redis.Redis) -> None:
    php = consumer(client)
    marker = k("pending", b"k".hex())
    php.coalesce({}, "k", ttl=500)
    (msg,) = php.receive()
    php.release(msg)
    assert client.get(marker) == msg.pid.encode()
    (msg,) = php.receive()
    stale(client, msg)
    assert consumer(client, reap_after=0).maintain() == 1
    (again,) = php.receive()
    assert again.key == "k" and again.pid != msg.pid and again.attempts == 1
    assert client.get(marker) == again.pid.encode() and 400 < client.ttl(marker) <= 500
    php.reject(again)
    assert not client.exists(marker)


def test_retry_requeues_old_failures_and_parks_exhausted_ones(client: redis.Redis) -> None:
    php = consumer(client)
    for n in range(3):
        php.publish({"n": n})
    batch = php.receive(3)
    for msg in batch:
        php.reject(msg)
    for msg, stamp, attempts in zip(batch, (1, 1, 4102444800), (0, 3, 0), strict=True):
        client.set(k("jobs", msg.pid), php_json_encode({"pid": msg.pid, "queue": Q,
                   "timestamp": stamp, "payload": msg.payload, "attempts": attempts}))
    php.retry(max_attempts=3)
    assert client.lrange(k("dead"), 0, -1) == [batch[1].pid.encode()]
    assert client.lrange(k("failed"), 0, -1) == [batch[2].pid.encode()]  # too new: put back
    (requeued,) = php.receive()
    assert requeued.payload == {"n": 0} and requeued.attempts == 1
    assert PID.match(requeued.pid) and requeued.pid != batch[0].pid


def test_php_json(client: redis.Redis) -> None:
    assert php_json_encode({"a/b": [], "e": {}, "é": 2.0, "f": 0.5, "g": 1e25, "h": 1e-5,
                            "i": {"0": "x", "1": "y"}, "j": None, "k": True}) == (
        '{"a\\/b":[],"e":[],"\\u00e9":2,"f":0.5,"g":1.0e+25,"h":1.0e-5,'
        '"i":["x","y"],"j":null,"k":true}')
    assert php_json_decode(b"99999999999999999999") == 1e20
    floats = (100.0, 0.0001, -1.5, 123.456, 1e17, 1e16)
    assert [php_float(x) for x in floats] == [
        "100", "0.0001", "-1.5", "123.456", "1.0e+17", "10000000000000000"]
    raw = Queue5Consumer(client, Q).envelope({})
    assert list(raw) == ["pid", "queue", "timestamp", "payload"] and PID.match(raw["pid"])
