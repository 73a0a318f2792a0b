"""The NATS JetStream broker against a private nats-server (and a fault proxy in front of it)."""

from __future__ import annotations

import asyncio
import logging
import time

import nats
import orjson
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from broker.base import Action, BrokerError, Delivery, Outcome, Poisoned, Result, Settlement
from broker.failure import NATS_HEADER, Failure
from broker.nats import NatsBroker
from broker.nats.conn import Connection, ConnectionLost, RequestTimeout
from broker.nats.held import Holdings
from broker.nats.setup import QueueNames
from support.brokers import receive_all
from support.servers import NatsServer
from support.waiting import until
from tests.queue5_nats import php_queue

QUEUE = "stats-usage"
NAMES = QueueNames.of(QUEUE)


async def stream_messages(js, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


async def settle_one(
    broker: NatsBroker, action: Action, delivery: Delivery, error: str | None = None
) -> Outcome:
    [result] = await broker.settle([Settlement(action, delivery, error)])
    return result.outcome


# -- names and settings: create as queue 5's newest line, adopt what exists ---------------


async def test_creates_streams_and_consumer_as_queue_5_does(nats_brokers, js):
    broker = await nats_brokers(QUEUE, ack_wait=7, max_attempts=4)
    assert broker.names == QueueNames(
        "Q_STATS-USAGE", "q.stats-usage.normal", "Q_STATS-USAGE_DEAD", "q.stats-usage.dead")
    work = (await js.stream_info(NAMES.stream)).config
    assert work.retention == RetentionPolicy.WORK_QUEUE
    assert work.storage == StorageType.FILE
    assert work.subjects == [NAMES.subject, NAMES.subject + ".*"]
    assert work.duplicate_window == 120
    assert work.max_age in (None, 0)  # a job nobody consumed in time must not vanish
    assert work.metadata["utopia_queue_identity"] == "12:utopia-queue:stats-usage"
    dead = (await js.stream_info(NAMES.dead_stream)).config
    assert dead.subjects == [NAMES.dead_subject]
    assert dead.retention == RetentionPolicy.WORK_QUEUE
    consumer = (await js.consumer_info(NAMES.stream, "worker")).config
    assert consumer.durable_name == "worker"
    assert consumer.ack_policy == AckPolicy.EXPLICIT
    assert consumer.ack_wait == 7
    assert consumer.max_deliver == 5  # max_attempts + queue 5's spare delivery
    assert consumer.metadata["utopia_queue_spare_delivery"] == "1"
    assert consumer.filter_subjects == [NAMES.subject, NAMES.subject + ".*"]
    assert consumer.deliver_subject is None  # a pull consumer
    assert (broker.policy.budget, broker.policy.spare) == (4, 5)


def test_names_are_sanitised_like_the_php_producer():
    names = QueueNames.of("v1-Stats.usage/x")
    assert names.stream == "Q_V1-STATS_USAGE_X"
    assert names.subject == "q.v1-stats_usage_x.normal"
    assert names.dead_stream == "Q_V1-STATS_USAGE_X_DEAD"
    assert names.dead_subject == "q.v1-stats_usage_x.dead"


@pytest.mark.parametrize(("layout", "budget", "spare"), [
    ({"max_deliver": 5, "spare": False}, 5, None),  # N1
    ({"max_deliver": 6, "spare": True, "keyed": True}, 5, 6),  # N2
    ({"max_deliver": 6, "spare": True}, 5, 6),  # N3
    ({"max_deliver": -1, "spare": False}, 3, None),  # unlimited: no spare, as spareOf()
])
async def test_a_php_made_queue_is_adopted_never_rewritten(
    nats_brokers, js, caplog, layout, budget, spare
):
    await php_queue(js, **layout)
    before = (await js.consumer_info(NAMES.stream, "worker")).config
    with caplog.at_level(logging.INFO, logger="broker.nats"):
        broker = await nats_brokers(QUEUE, ack_wait=10, max_attempts=3)
    assert (broker.policy.budget, broker.policy.spare) == (budget, spare)
    assert broker.policy.ack_wait == 30 and broker.lease == 30
    assert (await js.consumer_info(NAMES.stream, "worker")).config == before
    assert f"{budget} attempts" in caplog.text  # what was adopted is logged
    if budget != 3:
        assert "[job] max_attempts = 3 only applies to a consumer this supervisor creates" \
            in caplog.text
    if spare is None:
        assert "keeps no spare delivery" in caplog.text
    pid = await broker.publish(QUEUE, {"a": 1})
    [delivery] = (await broker.receive(10, 5)).deliveries
    assert delivery.pid == pid


async def test_stream_with_other_retention_is_refused(nats_brokers, js):
    await js.add_stream(StreamConfig(name=NAMES.stream, subjects=[NAMES.subject]))  # limits
    with pytest.raises(BrokerError, match="retention 'limits'"):
        await nats_brokers(QUEUE)
    assert (await js.stream_info(NAMES.stream)).config.retention == RetentionPolicy.LIMITS


async def test_stream_of_another_queue_identity_is_refused(nats_brokers, js):
    await js.add_stream(StreamConfig(
        name=NAMES.stream, subjects=[NAMES.subject], retention=RetentionPolicy.WORK_QUEUE,
        metadata={"utopia_queue_identity": "5:other:stats-usage"}))
    with pytest.raises(BrokerError, match="belongs to queue '5:other:stats-usage'"):
        await nats_brokers(QUEUE)


@pytest.mark.parametrize(("setting", "existing", "match"), [
    ("filter subjects", {"filter_subject": "q.stats-usage.priority"}, "priority"),
    ("filter subjects", {"filter_subjects": [NAMES.subject, "q.stats-usage.priority"]},
     "priority"),
    ("no filter", {}, "stream subjects"),
    ("push consumer", {"deliver_subject": "elsewhere"}, "pull consumer is needed"),
])
async def test_a_consumer_that_is_unsafe_to_share_is_refused(
    nats_brokers, js, setting, existing, match
):
    # (A workqueue stream refuses any ack policy but explicit, so that cannot differ.)
    await js.add_stream(StreamConfig(
        name=NAMES.stream, subjects=[NAMES.subject, "q.stats-usage.priority"],
        retention=RetentionPolicy.WORK_QUEUE))
    config = {"durable_name": "worker", "ack_policy": AckPolicy.EXPLICIT, "ack_wait": 30,
              "max_deliver": 3, **existing}
    await js.add_consumer(NAMES.stream, ConsumerConfig(**config))
    before = (await js.consumer_info(NAMES.stream, "worker")).config
    with pytest.raises(BrokerError, match=match) as error:
        await nats_brokers(QUEUE, ack_wait=30)
    assert setting in str(error.value)
    assert "worker" in str(error.value)
    assert (await js.consumer_info(NAMES.stream, "worker")).config == before


async def test_settings_rewritten_by_php_are_adopted_on_reconnect(nats_brokers, js, proxy, caplog):
    """Queue 5's ensure mode rewrites the consumer we made; our next connection adopts
    what it finds (it never refuses what start accepted)."""
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=30, max_attempts=3)
    assert broker.policy.budget == 3
    await js.delete_consumer(NAMES.stream, "worker")
    await js.add_consumer(NAMES.stream, ConsumerConfig(
        durable_name="worker", ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5,
        filter_subject=NAMES.subject))  # N1's ensure: MaxDeliver 5, no spare
    await proxy.cut()
    with caplog.at_level(logging.WARNING, logger="broker.nats"):
        pid = await broker.publish(QUEUE, {"after": "rewrite"})
        await until(lambda: _true(broker.reconnects >= 1), 20)
    assert (broker.policy.budget, broker.policy.spare) == (5, None)
    [delivery] = (await broker.receive(10, 5)).deliveries
    assert delivery.pid == pid
    # Then something a start would refuse (a push consumer): logged, the last settings kept.
    await js.delete_consumer(NAMES.stream, "worker")
    await js.add_consumer(NAMES.stream, ConsumerConfig(
        durable_name="worker", ack_policy=AckPolicy.EXPLICIT, deliver_subject="elsewhere"))
    await proxy.cut()
    with caplog.at_level(logging.ERROR, logger="broker.nats"):
        await until(lambda: _true(broker.reconnects >= 2), 20)
    assert "carrying on with 5 attempts" in caplog.text
    assert broker.policy.budget == 5


async def _true(value: bool) -> bool:
    return value


# -- receive -------------------------------------------------------------------------------


async def test_sparse_message_is_returned_without_waiting_for_a_batch(nats_brokers, js):
    broker = await nats_brokers(QUEUE)
    pid = await broker.publish(QUEUE, {"user": "a/b"})
    # A receive that waited to fill its batch would run into the 30 s block timeout.
    received = await asyncio.wait_for(broker.receive(100, 30), 10)
    [delivery] = received.deliveries
    assert (delivery.pid, delivery.queue, delivery.payload, delivery.attempts) == \
        (pid, QUEUE, {"user": "a/b"}, 0)
    assert b"a\\/b" in delivery.raw  # the PHP-compatible envelope
    stored = await js.get_msg(NAMES.stream, delivery.receipt.stream_seq)
    assert stored.headers["Nats-Msg-Id"] == pid


async def test_blocking_receive_returns_a_message_published_while_it_waits(
    nats_brokers, nats_server, js
):
    broker = await nats_brokers(QUEUE)
    waiting = asyncio.ensure_future(broker.receive(10, 30))

    async def pull_waiting() -> bool:
        return (await js.consumer_info(NAMES.stream, "worker")).num_waiting == 1

    await until(pull_waiting, 20)
    assert not waiting.done()
    producer = NatsBroker(nats_server.url, QUEUE)
    pid = await producer.publish(QUEUE, {"n": 1})
    await producer.close()
    received = await asyncio.wait_for(waiting, 10)
    assert [d.pid for d in received.deliveries] == [pid]


async def test_malformed_payload_goes_dead_at_once(nats_brokers, js):
    broker = await nats_brokers(QUEUE)
    await js.publish(NAMES.subject, b"{not json")
    pid = await broker.publish(QUEUE, {"ok": True})
    received = await broker.receive(10, 5)
    if not (received.deliveries and received.poisoned):  # the pull answered one at a time
        more = await broker.receive(10, 5)
        received.deliveries += more.deliveries
        received.poisoned += more.poisoned
    assert [d.pid for d in received.deliveries] == [pid]
    [poisoned] = received.poisoned
    assert poisoned.raw == b"{not json" and "invalid JSON" in poisoned.reason
    dead = await js.get_msg(NAMES.dead_stream, 1)
    assert dead.data == b"{not json"
    record = Failure.decode(dead.headers[NATS_HEADER])
    assert (record.error, record.outcome, record.attempt) == ("MalformedMessage", "dead", 1)
    assert "invalid JSON" in record.message
    await broker.settle([Settlement(Action.COMMIT, received.deliveries[0])])
    assert await stream_messages(js, NAMES.stream) == 0  # terminated, not redelivered


# -- settle ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_reject_at_max_attempts_goes_to_the_dead_stream(nats_brokers, js):
    broker = await nats_brokers(QUEUE, max_attempts=2, ack_wait=2)
    pid = await broker.publish(QUEUE, {"fails": True})
    [first] = await receive_all(broker, 1)
    [result] = await broker.settle([Settlement(Action.REJECT, first, "boom")])
    assert result == Result(Outcome.OK, "retrying in 0 s")  # NAK: retried (no backoff)
    [second] = await receive_all(broker, 1)
    assert (second.pid, second.attempts) == (pid, 1)
    failure = Failure(error="mymod.Boom", message="boom\nagain \u202e\u00e9",
                      where="h.py:3 in handle", traceback="Traceback...\n  line\r\nBoom\n",
                      attempt=2, at=1700000000.5, consumer="host-1")
    [result] = await broker.settle([Settlement(Action.REJECT, second, "boom\nagain", failure)])
    assert result == Result(Outcome.OK, "dead")
    dead = await js.get_msg(NAMES.dead_stream, 1)
    assert dead.data == second.raw  # the bytes as they were, as queue 5 dead-letters them
    assert dead.headers["Queue-Reason"] == "boom again"
    header = dead.headers[NATS_HEADER]
    assert header.isascii() and "\n" not in header and "\r" not in header  # one header line
    assert Failure.decode(header) == failure.replace(outcome="dead")
    assert "Content-Type" not in dead.headers  # queue 5 copies it only when it parks
    assert await stream_messages(js, NAMES.stream) == 0
    assert (await broker.receive(10, 3)).deliveries == []  # terminated: past ack_wait too


async def test_a_failure_record_shrinks_to_what_max_payload_leaves_beside_the_message(
    nats_brokers, js
):
    """Headers count against the server's max_payload: the record gives way (its traceback
    first) so the dead letter is still stored, and the connection is not refused."""
    broker = await nats_brokers(QUEUE, max_attempts=1, max_envelope_bytes=None)
    limit = js._nc.max_payload
    await broker.publish(QUEUE, {"blob": "x" * (limit - 1500)})
    [delivery] = await receive_all(broker, 1)
    failure = Failure(error="E", message="m" * 2000, traceback="\u00e9" * 4000 + "END")
    [result] = await broker.settle([Settlement(Action.REJECT, delivery, "E", failure)])
    assert result == Result(Outcome.OK, "dead")
    dead = await js.get_msg(NAMES.dead_stream, 1)
    assert dead.data == delivery.raw
    record = Failure.decode(dead.headers[NATS_HEADER])
    assert record.error == "E" and record.outcome == "dead"
    assert record.traceback.endswith("END") or not record.traceback
    assert len(dead.headers[NATS_HEADER]) < 1500


@pytest.mark.slow
async def test_reject_below_the_limit_waits_for_its_backoff(nats_brokers):
    broker = await nats_brokers(QUEUE, max_attempts=5, retry_backoff=4.0, ack_wait=30)
    await broker.publish(QUEUE, {"x": 1})
    [delivery] = await receive_all(broker, 1)
    [result] = await broker.settle([Settlement(Action.REJECT, delivery)])
    assert result == Result(Outcome.OK, "retrying in 4 s")
    assert (await broker.receive(10, 0.5)).deliveries == []  # NAK delay of 4 s
    [again] = await receive_all(broker, 1, timeout=10)
    assert again.attempts == 1


async def test_release_is_available_to_another_consumer_at_once(nats_brokers, js):
    first = await nats_brokers(QUEUE, ack_wait=30)
    second = await nats_brokers(QUEUE, ack_wait=30)
    pids = await first.publish_many(QUEUE, [{"i": i} for i in range(10)])
    held = await receive_all(first, 10)
    results = await first.settle([Settlement(Action.RELEASE, d) for d in held])
    assert all(r.ok for r in results)
    # Well before the 30 s ack_wait: released deliveries are not waiting for expiry.
    again = await receive_all(second, 10, timeout=10)
    assert sorted(d.pid for d in again) == sorted(pids)
    assert {d.attempts for d in again} == {0}  # republished: no attempt spent
    assert [d.raw for d in again] == [d.raw for d in held]
    copy = await js.get_msg(NAMES.stream, again[0].receipt.stream_seq)
    assert copy.headers["Nats-Msg-Id"] == f"{held[0].pid}.released.{held[0].receipt.stream_seq}"
    assert copy.headers["Content-Type"] == "application/json"
    assert await stream_messages(js, NAMES.stream) == 10  # the originals were acknowledged


async def test_release_of_a_message_acknowledged_elsewhere_leaves_no_copy(nats_brokers, js):
    """After a failover a message can be delivered again while the first holder's late
    ACK still lands (as in the cluster soak): the second holder's release at its stop
    must not republish a message the stream no longer has, or a duplicate stays queued."""
    broker = await nats_brokers(QUEUE, ack_wait=30)
    await broker.publish(QUEUE, {"x": 1})
    [held] = await receive_all(broker, 1)
    await js._nc.request(held.receipt.reply, b"+ACK", timeout=2)  # the other holder's ACK
    assert await stream_messages(js, NAMES.stream) == 0
    [result] = await broker.settle([Settlement(Action.RELEASE, held)])
    assert result.outcome is Outcome.STALE, result
    assert await stream_messages(js, NAMES.stream) == 0  # no copy republished
    assert broker.held == 0


async def test_release_after_renewals_failed_longer_than_ack_wait_sends_nothing(
    nats_brokers, js,
):
    """Renewals failing for longer than the ack wait: the server delivers the message again
    (perhaps did, to another consumer). A release republishing it and ACKing the original
    would take it from that consumer and run the copy once more: it leaves it alone."""
    broker = await nats_brokers(QUEUE, ack_wait=30)
    await broker.publish(QUEUE, {"x": 1})
    [held] = await receive_all(broker, 1)
    seq, delivered = held.receipt.stream_seq, held.receipt.delivered
    # As a renewal that began 31 s ago and failed leaves it (no test waits out 30 s).
    broker._held.renewed(seq, delivered, False, time.monotonic() - 31)
    [result] = await broker.settle([Settlement(Action.RELEASE, held)])
    assert result.outcome is Outcome.STALE, result
    info = await js.stream_info(NAMES.stream)
    assert (info.state.messages, info.state.last_seq) == (1, seq)  # the original, no copy
    consumer = await js.consumer_info(NAMES.stream, NAMES.consumer)
    assert consumer.num_ack_pending == 1  # not ACKed, not NAKed: redelivered after ack_wait


async def test_release_after_a_renewal_failed_recently_republishes(nats_brokers, js):
    broker = await nats_brokers(QUEUE, ack_wait=30)
    pid = await broker.publish(QUEUE, {"x": 1})
    [held] = await receive_all(broker, 1)
    broker._held.renewed(held.receipt.stream_seq, held.receipt.delivered, False,
                         time.monotonic())
    assert await settle_one(broker, Action.RELEASE, held) is Outcome.OK
    [again] = await receive_all(broker, 1)
    assert (again.pid, again.attempts) == (pid, 0)  # the copy: no attempt spent


@pytest.mark.parametrize("pid", ["a\r\nNats-Msg-Id: forged", "x" * 10_000, "ü ü", ""])
async def test_release_of_a_strange_pid_keeps_the_header_block_intact(nats_brokers, js, pid):
    broker = await nats_brokers(QUEUE, ack_wait=30)
    raw = orjson.dumps({"pid": pid, "queue": QUEUE, "timestamp": 1, "payload": {}})
    await js.publish(NAMES.subject, raw)
    [held] = await receive_all(broker, 1)
    assert held.pid == pid
    assert await settle_one(broker, Action.RELEASE, held) is Outcome.OK
    [again] = await receive_all(broker, 1)
    assert (again.raw, again.attempts) == (raw, 0)
    copy = await js.get_msg(NAMES.stream, again.receipt.stream_seq)
    assert copy.headers["Nats-Msg-Id"].startswith("sha256-")
    assert set(copy.headers) == {"Nats-Msg-Id"}


@pytest.mark.slow
async def test_release_on_a_size_limited_stream_is_a_delayed_nak(nats_brokers, js):
    """A republish could push another message out of a bounded stream: queue 5 NAKs with
    a delay there instead, which spends a delivery."""
    await php_queue(js, max_deliver=6, spare=True, stream={"max_msgs": 100})
    broker = await nats_brokers(QUEUE, ack_wait=30)
    assert broker.policy.bounded
    pid = await broker.publish(QUEUE, {"x": 1})
    [held] = await receive_all(broker, 1)
    assert await settle_one(broker, Action.RELEASE, held) is Outcome.OK
    assert (await broker.receive(10, 2)).deliveries == []  # waits out the 5 s delay
    [again] = await receive_all(broker, 1, timeout=10)
    assert (again.pid, again.attempts, again.receipt.stream_seq) == \
        (pid, 1, held.receipt.stream_seq)


async def test_twenty_releases_spend_no_attempt(nats_brokers, js):
    broker = await nats_brokers(QUEUE, ack_wait=30, max_attempts=1)
    pid = await broker.publish(QUEUE, {"x": 1})
    for _ in range(20):
        [held] = await receive_all(broker, 1)
        assert (held.pid, held.attempts) == (pid, 0)
        assert await settle_one(broker, Action.RELEASE, held) is Outcome.OK
    [held] = await receive_all(broker, 1)
    assert await settle_one(broker, Action.COMMIT, held) is Outcome.OK
    assert await stream_messages(js, NAMES.dead_stream) == 0
    assert await stream_messages(js, NAMES.stream) == 0


@pytest.mark.slow
async def test_independent_outcomes_in_one_settle(nats_brokers, proxy, js):
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=3, max_attempts=2, request_timeout=2.0)
    other = await nats_brokers(QUEUE, ack_wait=3, max_attempts=2)
    limit_pid = await broker.publish(QUEUE, {"role": "limit"})
    [limit] = await receive_all(broker, 1)
    assert await settle_one(broker, Action.REJECT, limit) is Outcome.OK  # its first attempt
    pids = await broker.publish_many(QUEUE, [{"i": i} for i in range(6)])
    held = await receive_all(broker, 7)
    by_pid = {d.pid: d for d in held}
    limit = by_pid[limit_pid]
    assert limit.attempts == 1
    commit, dropped, reject, release = pids[0:2], pids[2:4], pids[4], pids[5]
    proxy.drop_replies_to(by_pid[p].receipt.reply for p in dropped)

    plan = [Settlement(Action.COMMIT, by_pid[p]) for p in commit + dropped]
    plan += [Settlement(Action.REJECT, by_pid[reject], "retry me"),
             Settlement(Action.RELEASE, by_pid[release]),
             Settlement(Action.REJECT, limit, "out of attempts")]
    results = await broker.settle(plan)
    outcomes = [r.outcome for r in results]
    assert outcomes == [Outcome.OK, Outcome.OK, Outcome.UNCERTAIN, Outcome.UNCERTAIN,
                        Outcome.OK, Outcome.OK, Outcome.OK]
    assert proxy.dropped == 2
    assert all(proxy.published[by_pid[p].receipt.reply] == 1 for p in dropped)  # no replay

    again = await receive_all(other, 2, timeout=10)
    assert sorted(d.pid for d in again) == sorted([reject, release])
    await other.settle([Settlement(Action.COMMIT, d) for d in again])
    assert (await js.get_msg(NAMES.dead_stream, 1)).data == limit.raw
    # The dropped commits were applied by the server: nothing is left, nothing is lost.
    assert (await other.receive(10, 4)).deliveries == []
    assert await stream_messages(js, NAMES.stream) == 0


# -- attempts as queue 5 counts them: the consumer's budget, the spare delivery, advisories --


async def receive_poisoned(broker: NatsBroker) -> Poisoned:
    """Receive until one delivery comes back out of attempts (within 20 s); nothing reaches
    a handler."""
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        received = await broker.receive(10, 1.0)
        assert received.deliveries == []
        if received.poisoned:
            [poisoned] = received.poisoned
            return poisoned
    raise AssertionError("no delivery came back out of attempts")


async def dead_letter(js, seq: int = 1) -> tuple[bytes, dict[str, str]]:
    message = await js.get_msg(NAMES.dead_stream, seq)
    return message.data, message.headers


@pytest.mark.slow
async def test_last_attempt_lost_with_its_consumer_is_dead_at_the_spare(nats_brokers, js):
    first = await nats_brokers(QUEUE, max_attempts=2, ack_wait=3)  # 3 s to settle what it received
    pid = await first.publish(QUEUE, {"x": 1})
    [attempt] = await receive_all(first, 1)
    assert await settle_one(first, Action.REJECT, attempt, "failed once") is Outcome.OK
    [last] = await receive_all(first, 1, timeout=10)
    assert (last.pid, last.attempts) == (pid, 1)  # the last allowed attempt
    await first.close()  # gone without settling it, like a killed supervisor

    second = await nats_brokers(QUEUE, max_attempts=2, ack_wait=3)
    poisoned = await receive_poisoned(second)  # the spare delivery, never handled
    assert poisoned.raw == last.raw and not poisoned.malformed
    assert poisoned.reason.startswith("out of attempts: delivery 3 of a consumer that "
                                      "allows 2 runs")
    data, headers = await dead_letter(js)
    assert data == last.raw and headers["Queue-Attempts"] == "3"
    record = Failure.decode(headers[NATS_HEADER])
    assert (record.error, record.attempt, record.outcome) == ("AttemptsExhausted", 3, "dead")
    assert headers["Content-Type"] == "application/json"  # copied, as queue 5 parks
    assert await stream_messages(js, NAMES.stream) == 0
    info = await js.consumer_info(NAMES.stream, "worker")
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


@pytest.mark.slow
async def test_the_spare_is_read_again_before_a_delivery_is_parked(nats_brokers, js):
    """The consumer is shared: when another worker gave it a larger budget since we
    adopted it, the delivery runs instead of being parked on a stale threshold."""
    broker = await nats_brokers(QUEUE, max_attempts=1, ack_wait=3)  # MaxDeliver 2, spare delivery 2
    pid = await broker.publish(QUEUE, {"x": 1})
    [first] = await receive_all(broker, 1)
    config = (await js.consumer_info(NAMES.stream, "worker")).config
    config.max_deliver = 4
    await js.add_consumer(NAMES.stream, config)  # an update of the durable
    await asyncio.sleep(3.5)  # lost: redelivered after ack_wait
    [again] = await receive_all(broker, 1, timeout=10)
    assert (again.pid, again.attempts) == (pid, 1)
    assert (broker.policy.budget, broker.policy.spare) == (3, 4)
    assert first.receipt.stream_seq == again.receipt.stream_seq


@pytest.mark.slow
async def test_out_of_attempts_without_a_confirmed_dead_letter_is_kept(nats_brokers, js):
    broker = await nats_brokers(QUEUE, max_attempts=1, ack_wait=3)  # 3 s to delete the dead stream
    await broker.publish(QUEUE, {"x": 1})
    [last] = await receive_all(broker, 1)  # then lost: never settled
    dead_config = (await js.stream_info(NAMES.dead_stream)).config
    await js.delete_stream(NAMES.dead_stream)  # the dead letter cannot be stored now
    deadline = time.monotonic() + 10
    while (await js.consumer_info(NAMES.stream, "worker")).num_redelivered == 0:
        assert time.monotonic() < deadline
        received = await broker.receive(10, 1)
        assert (received.deliveries, received.poisoned) == ([], [])
    assert await stream_messages(js, NAMES.stream) == 1  # not TERMinated
    await js.add_stream(dead_config)
    # That was the server's last delivery: its advisory is the fallback, as in queue 5.
    deadline = time.monotonic() + 10
    while not await stream_messages(js, NAMES.dead_stream):
        assert time.monotonic() < deadline
        assert (await broker.receive(10, 0.25)).deliveries == []
        await broker.maintain()
    assert (await dead_letter(js))[0] == last.raw
    assert await stream_messages(js, NAMES.stream) == 0


@pytest.mark.slow
async def test_a_delivery_exhausted_without_a_spare_is_buried_from_the_advisory(nats_brokers, js):
    """Queue 5's older consumers have no spare: the server stops delivering and announces
    it; one subscriber of the fleet's queue group copies the message to dead, deletes it."""
    await php_queue(js, max_deliver=2, spare=False, ack_wait=1)
    broker = await nats_brokers(QUEUE, max_attempts=2)
    watcher = await nats_brokers(QUEUE, max_attempts=2)  # a second worker in the same queue group
    pid = await broker.publish(QUEUE, {"x": 1})
    for attempt in range(2):
        [held] = await receive_all(broker, 1, timeout=10)
        assert (held.pid, held.attempts) == (pid, attempt)  # then lost: never settled
    for _ in range(40):
        # The server notices the exhaustion when a pull asks for more.
        assert (await broker.receive(10, 0.25)).deliveries == []
        await asyncio.gather(broker.maintain(), watcher.maintain())
        if await stream_messages(js, NAMES.dead_stream):
            break
        await asyncio.sleep(0.25)
    data, headers = await dead_letter(js)
    assert data == held.raw
    assert "max deliveries exceeded" in headers["Queue-Reason"]
    record = Failure.decode(headers[NATS_HEADER])  # a record saying so
    assert (record.error, record.outcome) == ("MaxDeliveriesExceeded", "dead")
    assert "ran out of deliveries while no worker held it" in record.message
    await asyncio.gather(broker.maintain(), watcher.maintain())
    assert await stream_messages(js, NAMES.dead_stream) == 1  # one copy for the fleet
    assert await stream_messages(js, NAMES.stream) == 0


@pytest.mark.slow
async def test_reject_follows_the_consumers_backoff_list(nats_brokers, js):
    await php_queue(js, max_deliver=6, spare=True, ack_wait=2, backoff=[2, 4])
    broker = await nats_brokers(QUEUE, max_attempts=5, retry_backoff=0)
    assert broker.policy.backoff == (2.0, 4.0) and broker.lease == 2
    await broker.publish(QUEUE, {"x": 1})
    [delivery] = await receive_all(broker, 1)
    started = time.monotonic()
    assert await settle_one(broker, Action.REJECT, delivery) is Outcome.OK
    [again] = await receive_all(broker, 1, timeout=10)
    assert again.attempts == 1 and time.monotonic() - started >= 1.8


@pytest.mark.slow
async def test_each_commit_reports_as_soon_as_its_own_reply_arrives(nats_brokers, proxy):
    broker = await nats_brokers(QUEUE, proxy.url, request_timeout=5.0)
    await broker.publish_many(QUEUE, [{"i": 1}, {"i": 2}])
    slow, fast = await receive_all(broker, 2)
    proxy.drop_replies_to([slow.receipt.reply])
    slow_settle = asyncio.ensure_future(settle_one(broker, Action.COMMIT, slow))
    await asyncio.sleep(0)
    assert await settle_one(broker, Action.COMMIT, fast) is Outcome.OK
    assert not slow_settle.done()  # still waiting for its lost reply
    assert await slow_settle is Outcome.UNCERTAIN


async def test_cut_after_the_ack_is_uncertain_and_not_replayed(nats_brokers, proxy, js):
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=2)
    await broker.publish(QUEUE, {"x": 1})
    [delivery] = await receive_all(broker, 1)
    proxy.cut_after(b"+ACK")
    assert await settle_one(broker, Action.COMMIT, delivery) is Outcome.UNCERTAIN
    assert proxy.triggered.is_set()
    assert proxy.published[delivery.receipt.reply] == 1

    # The broker carries on with a new connection; the message ended acked (or, had the
    # ack been lost, it would be redelivered): either way it is not lost.
    later = await broker.publish(QUEUE, {"x": 2})
    seen = [d for d in (await broker.receive(10, 3)).deliveries]
    assert later in [d.pid for d in seen]
    assert broker.reconnects >= 1
    leftovers = [d for d in seen if d.pid == delivery.pid]
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in seen])
    assert all(r.ok for r in results)
    assert not leftovers or leftovers[0].attempts == 1
    assert await stream_messages(js, NAMES.stream) == 0
    assert proxy.published[delivery.receipt.reply] == 1


@pytest.mark.slow
async def test_silent_connection_is_replaced(nats_brokers, proxy, js):
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=2, request_timeout=1.0,
                                connect_timeout=1.0)
    await broker.publish(QUEUE, {"x": 1})
    [delivery] = await receive_all(broker, 1)
    proxy.pause()  # the socket stays open, nothing gets through either way
    assert await settle_one(broker, Action.COMMIT, delivery) is Outcome.UNCERTAIN
    # The failed health check closed that client and a new one is being dialled.
    await until(lambda: _at_least(proxy.connections, 2), 20)
    proxy.resume()  # the held ack may still reach the server now: either way, no loss
    redelivered: list[Delivery] = []

    async def drained() -> bool:
        received = await broker.receive(10, 0.5)
        redelivered.extend(received.deliveries)
        await broker.settle([Settlement(Action.COMMIT, d) for d in received.deliveries])
        return await stream_messages(js, NAMES.stream) == 0

    await until(drained, 20)
    assert broker.reconnects >= 1
    assert all(d.pid == delivery.pid and d.attempts >= 1 for d in redelivered)
    assert proxy.published[delivery.receipt.reply] <= 1  # never replayed by the broker


async def test_publish_to_a_queue_without_a_stream_says_so(nats_brokers):
    broker = await nats_brokers(QUEUE)
    with pytest.raises(BrokerError, match=r"no JetStream stream stores 'q\.elsewhere\.normal'"):
        await broker.publish("elsewhere", {"x": 1})


# -- renewal --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_extend_keeps_held_deliveries_past_ack_wait(nats_brokers, js):
    broker = await nats_brokers(QUEUE, ack_wait=4)
    rival = await nats_brokers(QUEUE, ack_wait=4)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(20)])
    held = await receive_all(broker, 20)
    deadline = time.monotonic() + 9
    while time.monotonic() < deadline:
        assert await broker.extend(held) == [True] * 20
        assert (await rival.receive(20, 0.6)).deliveries == []  # nothing redelivered
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held])
    assert all(r.ok for r in results)
    assert {d.attempts for d in held} == {0}
    info = await js.consumer_info(NAMES.stream, "worker")
    assert info.num_redelivered == 0
    assert await stream_messages(js, NAMES.stream) == 0


def count_requests(broker: NatsBroker) -> list[str]:
    """The name of each request method of the broker's connection called from now on:
    ``request`` (one at a time) or ``request_batch``."""
    conn = broker._link.connection
    calls: list[str] = []

    def counted(name: str):
        real = getattr(conn, name)

        def spy(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return spy

    for name in ("request", "request_batch"):
        setattr(conn, name, counted(name))
    return calls


async def test_renewals_go_a_thousand_to_a_write(nats_brokers, js):
    """1,001 held (a consumer made beforehand with room for them: the server's default
    MaxAckPending is 1,000): two writes of renewals."""
    await js.add_stream(StreamConfig(
        name=NAMES.stream, subjects=[NAMES.subject], retention=RetentionPolicy.WORK_QUEUE))
    await js.add_consumer(NAMES.stream, ConsumerConfig(
        durable_name="worker", ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=4,
        filter_subject=NAMES.subject, max_ack_pending=2000))
    broker = await nats_brokers(QUEUE, ack_wait=30)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(1001)])
    held = await receive_all(broker, 1000) + await receive_all(broker, 1)
    calls = count_requests(broker)
    assert await broker.extend(held) == [True] * 1001
    assert calls == ["request_batch"] * 2
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held])
    assert all(r.ok for r in results)


@pytest.mark.slow
async def test_renewals_leave_in_one_write_and_a_lost_reply_is_never_replayed(
        nats_brokers, proxy, js, caplog):
    """100 renewals: one batch of typed requests, no request one at a time. The 10 whose
    reply the proxy drops are uncertain (still ours: True), told in one line, and were
    published once each; every delivery then commits with nothing redelivered."""
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=30, request_timeout=3.0)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(100)])
    held = await receive_all(broker, 100)
    calls = count_requests(broker)
    proxy.drop_replies_to(d.receipt.reply for d in held[:10])
    with caplog.at_level(logging.WARNING, logger="broker.nats"):
        assert await broker.extend(held) == [True] * 100
    assert calls == ["request_batch"]
    assert [proxy.published[d.receipt.reply] for d in held] == [1] * 100
    [told] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("renewal")]
    assert "10 of 100 without a confirmed outcome (first: uncertain" in told, told
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held])
    # (the proxy still drops the replies to those 10 acks: applied, but not confirmed)
    assert [r.outcome for r in results] == [Outcome.UNCERTAIN] * 10 + [Outcome.OK] * 90
    assert (await js.consumer_info(NAMES.stream, "worker")).num_redelivered == 0
    assert await stream_messages(js, NAMES.stream) == 0


@pytest.mark.slow
async def test_superseded_delivery_is_reported_stale(nats_brokers):
    broker = await nats_brokers(QUEUE, ack_wait=3)  # 3 s to renew the new delivery
    await broker.publish(QUEUE, {"x": 1})
    [old] = await receive_all(broker, 1)
    [new] = await receive_all(broker, 1, timeout=10)  # redelivered after ack_wait
    assert new.attempts == old.attempts + 1
    assert await broker.extend([old, new]) == [False, True]
    assert await settle_one(broker, Action.RELEASE, old) is Outcome.STALE
    assert await settle_one(broker, Action.COMMIT, new) is Outcome.OK


@pytest.mark.slow
async def test_each_renewal_result_lands_on_its_own_delivery(nats_brokers, proxy):
    """Held, superseded and held again, in that order, the last one's reply lost: the
    superseded one is told gone, the lost reply is recorded as a failed renewal of that
    delivery alone (the others' records untouched)."""
    # ack_wait 4 s and replies 2 s: the commit after the lost reply comes well within the
    # ack wait the renewals restarted.
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=4, request_timeout=2.0)
    await broker.publish(QUEUE, {"x": 0})
    [old] = await receive_all(broker, 1)
    [new] = await receive_all(broker, 1, timeout=10)  # redelivered after ack_wait
    await broker.publish_many(QUEUE, [{"x": 1}, {"x": 2}])
    first, last = await receive_all(broker, 2)
    proxy.drop_replies_to([last.receipt.reply])
    assert await broker.extend([first, old, new, last]) == [True, False, True, True]
    unrenewed = broker._held.unrenewed_since
    assert unrenewed(last.receipt.stream_seq, last.receipt.delivered) is not None
    assert unrenewed(first.receipt.stream_seq, first.receipt.delivered) is None
    assert unrenewed(new.receipt.stream_seq, new.receipt.delivered) is None
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in (first, new)])
    assert all(r.ok for r in results)


@pytest.mark.slow
async def test_late_pull_arrivals_count_against_prefetch_and_are_renewed(nats_brokers, proxy, js):
    """A pull that got no answer in time may still be answered: what it asked for is
    counted against the next pulls, and what arrives is renewed until it is handed out."""
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=4, request_timeout=1.0)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(30)])
    proxy.pause()  # the pull request and its answer wait in the proxy
    assert (await broker.receive(10, 0)).deliveries == []  # no answer within 1 s
    # Prefetch 10 is owed already: a second receive must not ask for 10 more.
    assert (await broker.receive(10, 0)).deliveries == []
    proxy.resume()  # (before the health check gives up on the connection)
    await until(lambda: _true(len(broker._puller.backlog()) == 10), 20)
    info = await js.consumer_info(NAMES.stream, "worker")
    assert info.num_ack_pending == 10
    held = (await broker.receive(4, 0)).deliveries  # 6 stay unreturned, beyond the room
    assert len(held) == 4 and broker.reconnects == 0
    deadline = time.monotonic() + 9  # more than twice the ack wait
    while time.monotonic() < deadline:
        assert await broker.extend(held) == [True] * 4
        await asyncio.sleep(0.5)
    rest = (await broker.receive(6, 0)).deliveries
    assert len(rest) == 6 and {d.attempts for d in rest} == {0}
    assert (await js.consumer_info(NAMES.stream, "worker")).num_redelivered == 0
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held + rest])
    assert all(r.ok for r in results)


@pytest.mark.slow
async def test_tracking_is_bounded_by_what_is_held(nats_brokers, proxy, js):
    """Uncertain, stale and certain settlements all end the tracking of their delivery."""
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=3, request_timeout=1.0)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(200)])
    held = await receive_all(broker, 200)
    assert broker.held == 200
    # 50 acks lose their reply (uncertain); the other 150 deliveries are left unrenewed
    # past the ack wait and come back: their first deliveries are superseded (stale).
    proxy.drop_replies_to(d.receipt.reply for d in held[:50])
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held[:50]])
    assert {r.outcome for r in results} == {Outcome.UNCERTAIN}
    await asyncio.sleep(3.5)
    again = await receive_all(broker, 150, timeout=10)
    assert {d.attempts for d in again} == {1}
    results = await broker.settle([Settlement(Action.REJECT, d) for d in held[50:100]])
    assert {r.outcome for r in results} == {Outcome.STALE}
    assert await broker.extend(held[100:]) == [False] * 100
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in again])
    assert all(r.ok for r in results)
    assert broker.held == 0
    assert await stream_messages(js, NAMES.stream) == 0


@pytest.mark.slow
def test_holdings_stay_bounded_over_a_million_settlements():
    """The bookkeeping alone, at volume: 1,000,000 deliveries, some superseded, settled
    in every order; the map never holds more than what is outstanding."""
    held = Holdings()
    outstanding: list[tuple[int, int]] = []
    peak = 0
    for seq in range(1, 1_000_001):
        held.add(seq, 1)
        outstanding.append((seq, 1))
        if seq % 7 == 0:  # redelivered while the first is still held: the first is stale
            held.add(seq, 2)
            outstanding.append((seq, 2))
        if len(outstanding) >= 100:
            for index, (s, d) in enumerate(outstanding):
                if index % 5 == 0:
                    held.drop(s, d)  # an uncertain settlement
                elif not held.owns(s, d):
                    held.drop(s, d)  # reported stale
                else:
                    held.drop(s, d)  # settled
            outstanding.clear()
        peak = max(peak, len(held))
    for s, d in outstanding:
        held.drop(s, d)
    assert peak <= 100 and len(held) == 0


# -- server restart -------------------------------------------------------------------------


@pytest.mark.slow
async def test_server_restart_mid_run_loses_nothing(nats_brokers, nats_server):
    broker = await nats_brokers(QUEUE, ack_wait=2, connect_timeout=2.0)
    pids = set(await broker.publish_many(QUEUE, [{"i": i} for i in range(500)]))
    handled: set[str] = set()
    failures = 0
    reached, stopped = asyncio.Event(), asyncio.Event()

    async def consume() -> None:
        nonlocal failures
        while True:
            try:
                received = await broker.receive(50, 1.0)
            except BrokerError:
                failures += 1  # server down: receive waited for a connection in vain
                continue
            if len(handled) >= 100 and not reached.is_set():
                reached.set()
                await stopped.wait()  # settle this batch with the server gone
            pending = [Settlement(Action.COMMIT, d) for d in received.deliveries]
            while pending:
                results = await broker.settle(pending)
                for settlement, result in zip(pending, results, strict=True):
                    if result.outcome in (Outcome.OK, Outcome.UNCERTAIN):
                        handled.add(settlement.delivery.pid)
                # Never sent: still ours, settle again (uncertain ones are not replayed).
                pending = [s for s, r in zip(pending, results, strict=True)
                           if r.outcome is Outcome.ERROR]
                failures += len(pending)
            if not received.deliveries and handled >= pids:
                return

    consumer = asyncio.ensure_future(consume())
    await asyncio.wait_for(reached.wait(), 30)
    await asyncio.to_thread(nats_server.stop)
    stopped.set()
    await until(lambda: _at_least(failures, 1), 20)
    await asyncio.to_thread(nats_server.start)  # same port, same file storage
    await asyncio.wait_for(consumer, 90)
    assert handled >= pids
    assert broker.reconnects >= 1
    await until(lambda: _stream_empty(nats_server), 20)


# -- request deadlines (one shared timer, each request its own timeout) ---------------------


@pytest.fixture
async def silent(nats_server: NatsServer):
    """(connection, subject): requests to ``subject`` reach a subscriber that never answers."""
    listener = await nats.connect(nats_server.url)
    await listener.subscribe("silent.>")
    await listener.flush()
    conn = await Connection.open(nats_server.url, lambda msg: None)
    yield conn, "silent.x"
    await conn.close()
    await listener.close()


@pytest.mark.slow
async def test_each_request_times_out_at_its_own_deadline(silent):
    conn, subject = silent
    started = time.monotonic()
    slow = asyncio.ensure_future(conn.request(subject, timeout=5.0))
    fast = asyncio.ensure_future(conn.request(subject, timeout=0.3))  # made later, due first
    with pytest.raises(RequestTimeout, match=r"no reply to silent\.x in 0\.3s"):
        await fast
    assert 0.3 <= time.monotonic() - started < 4  # not after the slow one's 5 s
    assert not slow.done()
    with pytest.raises(RequestTimeout, match=r"in 5\.0s"):
        await slow
    assert time.monotonic() - started >= 5.0
    assert conn._waiting == {}


async def test_replies_and_cancels_leave_nothing_waiting(silent, nats_server):
    conn, subject = silent

    async def echo(msg) -> None:
        await responder.publish(msg.reply, msg.data)

    responder = await nats.connect(nats_server.url)
    await responder.subscribe("echo", cb=echo)
    await responder.flush()
    try:
        pending = asyncio.ensure_future(conn.request(subject, timeout=30))
        replies = await asyncio.gather(
            *(conn.request("echo", str(i).encode(), timeout=5) for i in range(500)))
        assert [r.data for r in replies] == [str(i).encode() for i in range(500)]
        reply, status = conn.expect_reply(5, "pull request")
        status.cancel()  # forgets the subject: a late reply to it is ignored
        await responder.publish(reply, b"late")
        await responder.flush()
        assert (await conn.request("echo", b"last", timeout=5)).data == b"last"
        assert status.cancelled()
        # Finished requests are dropped as new ones are made, not kept to their deadline:
        # only the one still waiting is left.
        [left] = conn._waiting.values()
        assert not left.done() and not pending.done()
    finally:
        pending.cancel()
        await responder.close()


async def test_close_fails_waiting_requests_at_once(silent):
    conn, subject = silent
    waiting = asyncio.ensure_future(conn.request(subject, timeout=30))
    await asyncio.sleep(0)
    await conn.close()
    with pytest.raises(ConnectionLost) as lost:
        await asyncio.wait_for(waiting, 5)
    assert lost.value.sent


async def _at_least(value: int, count: int) -> bool:
    return value >= count


async def _stream_empty(server: NatsServer) -> bool:
    client = await nats.connect(server.url)
    try:
        return (await client.jetstream().stream_info(NAMES.stream)).state.messages == 0
    finally:
        await client.close()


def test_holdings_remember_failing_renewals_until_confirmed_or_dropped():
    """When a delivery's renewals began failing: kept from the first failure (a later one
    does not move it), forgotten at a confirmed renewal, a drop or a clear; never kept
    for a delivery not held (bounded by what is outstanding)."""
    held = Holdings()
    held.add(5, 1)
    held.renewed(5, 1, True, 10.0)
    assert held.unrenewed_since(5, 1) is None
    held.renewed(5, 1, False, 10.0)
    held.renewed(5, 1, False, 11.0)
    assert held.unrenewed_since(5, 1) == 10.0
    held.renewed(5, 1, True, 12.0)
    assert held.unrenewed_since(5, 1) is None
    held.renewed(5, 1, False, 13.0)
    held.drop(5, 1)
    assert held.unrenewed_since(5, 1) is None and held._unrenewed == {}
    held.renewed(6, 1, False, 14.0)  # not held: nothing to remember
    held.add(7, 1)
    held.renewed(7, 1, False, 15.0)
    held.clear()
    assert held._unrenewed == {}
