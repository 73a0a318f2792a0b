"""Batched NATS acks (``broker.nats.acks``): one write per settle batch, each ack a request
whose own reply confirms it; lost replies, cuts and reconnects end as a single ack would."""

from __future__ import annotations

import asyncio
import random

import nats
import pytest

from broker.base import MAX_BATCH, Action, Outcome, Result, Settlement
from broker.nats import NatsBroker
from broker.nats.conn import Connection, ConnectionLost, RequestTimeout, _headers
from broker.nats.setup import QueueNames
from support.brokers import receive_all
from support.waiting import until
from tests.faults import UVLOOP_REFUSAL

QUEUE = "acks"
NAMES = QueueNames.of(QUEUE)


async def pending_acks(js) -> int:
    return (await js.consumer_info(NAMES.stream, "worker")).num_ack_pending


async def stored(js) -> int:
    return (await js.stream_info(NAMES.stream)).state.messages


def count_writes(broker: NatsBroker) -> list[bytes]:
    """Every write of the broker's current connection to its socket, from now on."""
    conn = broker._link.connection
    assert conn is not None
    transport = conn.client._transport
    written: list[bytes] = []
    write = transport.write

    def counting(data: bytes) -> None:
        written.append(bytes(data))
        write(data)

    transport.write = counting
    return written


async def test_a_batch_of_max_batch_acks_is_one_write_of_confirmed_requests(nats_brokers, js):
    broker = await nats_brokers(QUEUE)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(MAX_BATCH)])
    held = await receive_all(broker, MAX_BATCH)
    assert await pending_acks(js) == MAX_BATCH
    written = count_writes(broker)
    reported: list[int] = []
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held],
                                  lambda index, result: reported.append(index))
    assert results == [Result(Outcome.OK)] * MAX_BATCH
    assert sorted(reported) == list(range(MAX_BATCH))
    [write] = written  # the whole batch in one write
    # Each one a typed request to its delivery's own ack subject, with a reply subject of
    # its own (as ack_sync sends it): never AckAll, never an ack nobody answers.
    lines = [line for line in write.split(b"\r\n") if line.startswith(b"PUB ")]
    # After the acks, in the same write, the pull for the room they make (Puller.ahead).
    assert lines.pop().startswith(b"PUB " + NAMES.next_subject.encode() + b" ")
    assert len(lines) == MAX_BATCH
    subjects = [line.split()[1].decode() for line in lines]
    assert subjects == [d.receipt.reply for d in held]
    assert len({line.split()[2] for line in lines}) == MAX_BATCH
    assert write.count(b"\r\n+ACK\r\n") == MAX_BATCH
    assert await pending_acks(js) == 0
    assert await stored(js) == 0


class Together:
    """A settle callback that takes several results at once (as supervisor.settlement's)."""

    def __init__(self) -> None:
        self.alone: list[int] = []
        self.together: list[list[int]] = []
        self.results: list[Result] = []

    def __call__(self, index: int, result: Result) -> None:
        self.alone.append(index)

    def many(self, indices: list[int], result: Result) -> None:
        self.together.append(indices)
        self.results.append(result)


async def test_the_confirmations_of_one_read_are_reported_together(nats_brokers, js):
    """The server answers a batch of acks in few reads: each read's confirmations reach a
    callback with ``many`` in one call, each delivery once, and are let go as one by one."""
    broker = await nats_brokers(QUEUE)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(MAX_BATCH)])
    held = await receive_all(broker, MAX_BATCH)
    told = Together()
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held], told)
    assert results == [Result(Outcome.OK)] * MAX_BATCH
    assert not told.alone and set(told.results) == {Result(Outcome.OK)}
    assert sorted(i for indices in told.together for i in indices) == list(range(MAX_BATCH))
    assert len(told.together) < MAX_BATCH / 10  # many at a time, not one by one
    assert broker.held == 0
    assert await pending_acks(js) == 0


def pull_lines(write: bytes) -> list[bytes]:
    return [line for line in write.split(b"\r\n")
            if line.startswith(b"PUB " + NAMES.next_subject.encode() + b" ")]


async def test_the_next_pull_rides_in_the_acks_write(nats_brokers, js):
    """A settle of commits asks for the room its acks make in the same write (after
    them), so the next receive finds the messages without a round trip of its own; the
    server never counts more outstanding than before."""
    broker = await nats_brokers(QUEUE)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(8)])
    held = await receive_all(broker, 3)
    written = count_writes(broker)
    # Two settle calls at once (as the supervisor makes them): each its own pull ahead.
    settled = await asyncio.gather(broker.settle([Settlement(Action.COMMIT, held[0])]),
                                   broker.settle([Settlement(Action.COMMIT, d)
                                                  for d in held[1:]]))
    assert all(r.ok for results in settled for r in results)
    assert len(written) == 2
    for write in written:
        [pull] = pull_lines(write)
        assert write.index(pull) > write.rindex(b"+ACK")  # the acks first: room made, then used
    await until(lambda: len(broker._puller.backlog()) == 3, 10, "the pulled-ahead messages")
    assert await pending_acks(js) == 3
    again = (await broker.receive(3, 1.0)).deliveries
    assert sorted(d.payload["i"] for d in again) == [3, 4, 5]
    assert len(written) == 2  # the receive needed no request

    # A settle that hands a job back does not pull it (or another) back here at once.
    await broker.settle([Settlement(Action.COMMIT, again[0]),
                         Settlement(Action.REJECT, again[1], "boom")])
    assert pull_lines(b"".join(written[2:])) == []
    # Nor does one after a stop began: what it would pull only waits to be released.
    broker.stop_waiting()
    await broker.settle([Settlement(Action.COMMIT, again[2])])
    assert pull_lines(b"".join(written[2:])) == []
    assert broker._puller.backlog() == []


async def test_what_a_pull_ahead_brought_is_taken_in_the_turn_it_was_read(nats_brokers, js):
    """The broker tells after a read that brought pulled messages; receive_nowait then
    gives what a receive would, with no request and no wait, or None when that would take
    one: fewer there than asked, or one that must go to the dead stream first."""
    broker = await nats_brokers(QUEUE)
    told: list[int] = []
    broker.on_arrival(lambda: told.append(len(broker._puller.backlog())))
    await broker.publish_many(QUEUE, [{"i": i} for i in range(4)])
    held = await receive_all(broker, 2)
    assert broker.receive_nowait(1) is None  # nothing arrived beyond what was received
    written = count_writes(broker)
    assert all(r.ok for r in await broker.settle([Settlement(Action.COMMIT, d)
                                                   for d in held]))
    await until(lambda: len(broker._puller.backlog()) == 2, 10, "the pulled-ahead messages")
    assert told and told[-1] == 2  # told in the read that brought them
    assert broker.receive_nowait(3) is None  # a receive of 3 would ask for the third
    taken = broker.receive_nowait(2)
    assert taken is not None and sorted(d.payload["i"] for d in taken.deliveries) == [2, 3]
    assert broker.held == 2 and broker._puller.backlog() == []
    assert len(written) == 1  # the settle's write: the take needed no request

    # Undecodable: left for the receive, which dead-letters it (never to a handler).
    await js.publish(NAMES.subject, b"not json")
    assert all(r.ok for r in await broker.settle([Settlement(Action.COMMIT, d)
                                                   for d in taken.deliveries]))
    await until(lambda: len(broker._puller.backlog()) == 1, 10, "the pulled-ahead message")
    assert broker.receive_nowait(1) is None and len(broker._puller.backlog()) == 1
    received = await broker.receive(1, 5.0)
    assert received.deliveries == [] and len(received.poisoned) == 1
    assert await stored(js) == 0


async def test_pulled_messages_waiting_for_room_are_told_when_an_ack_is_answered(
        nats_brokers, js):
    """The server serves a pull ahead once it applied the acks before it, and their replies
    may come after its messages, in a later read (at prefetch 1, often): that read brought
    no message, but the room its replies make is what the waiting messages need, so the
    broker tells then too (take_arrivals, not a turn of the receive loop)."""
    broker = await nats_brokers(QUEUE)
    told: list[int] = []
    broker.on_arrival(lambda: told.append(len(broker._puller.backlog())))
    await broker.publish_many(QUEUE, [{"i": i} for i in range(3)])
    held = await receive_all(broker, 2)
    assert all(r.ok for r in await broker.settle([Settlement(Action.COMMIT, held[0])]))
    await until(lambda: len(broker._puller.backlog()) == 1, 10, "the pulled-ahead message")
    before = len(told)
    # Its pull ahead finds the queue empty: its reads bring acks' replies and a 404, no message.
    assert all(r.ok for r in await broker.settle([Settlement(Action.COMMIT, held[1])]))
    assert len(told) > before and told[-1] == 1
    taken = broker.receive_nowait(1)
    assert taken is not None and [d.payload["i"] for d in taken.deliveries] == [2]


@pytest.mark.slow
async def test_a_pull_ahead_left_unanswered_holds_back_nothing(nats_brokers, proxy, js):
    """The status of a pull ahead is lost (an empty queue's 404 never reaches us): the
    next receive waits out its request timeout, keeps the connection after its health
    check, and a message published meanwhile is still received; nothing is lost."""
    broker = await nats_brokers(QUEUE, proxy.url)  # request timeout 2 s
    await broker.publish_many(QUEUE, [{"i": i} for i in range(2)])
    held = await receive_all(broker, 2)
    proxy.drop_replies_to_prefix(NAMES.next_subject)  # the next pull: the settle's
    assert all(r.ok for r in await broker.settle([Settlement(Action.COMMIT, d)
                                                   for d in held]))
    await until(lambda: proxy.dropped == 1, 10, "the pull ahead's status dropped")
    pid = await broker.publish(QUEUE, {"i": 2})
    [again] = await receive_all(broker, 1, timeout=20)
    assert again.pid == pid
    assert all(r.ok for r in await broker.settle([Settlement(Action.COMMIT, again)]))
    assert broker.reconnects == 0
    assert await stored(js) == 0


async def request_batch(conn: Connection, requests: list[tuple[str, bytes]],
                        timeout: float,  # noqa: ASYNC109 - each request's, passed on
                        ) -> list:
    """Each request's reply (or error), in the order of the requests."""
    outcomes: dict[int, object] = {}
    complete = asyncio.Event()

    def on_reply(index: int, outcome: object) -> None:
        assert index not in outcomes  # once each
        outcomes[index] = outcome
        if len(outcomes) == len(requests):
            complete.set()

    await conn.request_batch(requests, timeout=timeout, on_reply=on_reply)
    await asyncio.wait_for(complete.wait(), 60)
    return [outcomes[i] for i in range(len(requests))]


async def test_replies_are_matched_to_their_requests_in_any_order(nats_server):
    """A responder that answers a batch backwards, with header blocks and payloads that
    straddle the client's reads: each future gets its own reply."""
    responder = await nats.connect(nats_server.url)
    batch: list = []
    count = 300

    async def collect(msg) -> None:
        batch.append(msg)
        if len(batch) == count:
            for request in reversed(batch):
                size = int(request.data)
                await responder.publish(request.reply, b"x" * size,
                                        headers={"Echo": request.subject})

    await responder.subscribe("svc.*", cb=collect)
    await responder.flush()
    conn = await Connection.open(nats_server.url, lambda msg: None)
    try:
        sizes = [random.Random(i).choice((0, 1, 700, 40_000, 70_000)) for i in range(count)]
        replies = await request_batch(
            conn, [(f"svc.{i}", str(size).encode()) for i, size in enumerate(sizes)], 30)
        assert [r.headers["Echo"] for r in replies] == [f"svc.{i}" for i in range(count)]
        assert [len(r.data) for r in replies] == sizes
        assert conn._waiting == {}
    finally:
        await conn.close()
        await responder.close()


@pytest.mark.slow
async def test_a_request_of_a_batch_without_a_reply_times_out_alone(nats_server):
    listener = await nats.connect(nats_server.url)

    async def answer_all_but_one(msg) -> None:
        if msg.subject != "svc.3":
            await listener.publish(msg.reply, b"ok")

    await listener.subscribe("svc.*", cb=answer_all_but_one)
    await listener.flush()
    conn = await Connection.open(nats_server.url, lambda msg: None)
    try:
        replies = await request_batch(conn, [(f"svc.{i}", b"") for i in range(6)], 1)
        assert isinstance(replies[3], RequestTimeout)
        assert str(replies[3]) == "no reply to svc.3 in 1s"
        assert [r.data for i, r in enumerate(replies) if i != 3] == [b"ok"] * 5
        assert conn._waiting == {}
    finally:
        await conn.close()
        await listener.close()


@pytest.mark.slow
@pytest.mark.parametrize(("refusal", "raised"), [
    (RuntimeError(UVLOOP_REFUSAL), ConnectionLost),  # uvloop, before nats-py saw the EOF
    (RuntimeError("something else"), RuntimeError),  # not hidden
])
async def test_a_batch_whose_write_fails_is_unsent_and_never_answered_later(
        nats_server, refusal, raised):
    """The error the write raised, as ConnectionLost(sent=False) when it is a transport uvloop
    has closed; either way no request of the batch is answered after the call raised."""
    listener = await nats.connect(nats_server.url)

    async def answer(msg) -> None:
        await listener.publish(msg.reply, b"ok")

    await listener.subscribe("svc.*", cb=answer)
    await listener.flush()
    conn = await Connection.open(nats_server.url, lambda msg: None)
    answered: list[int] = []
    try:
        def refuse(data: bytes) -> None:
            raise refusal

        await conn.client.flush()  # nothing of nats-py's waits: the batch is written at once
        conn.client._transport.write = refuse
        with pytest.raises(raised) as failed:
            await conn.request_batch([(f"svc.{i}", b"") for i in range(3)], timeout=1,
                                     on_reply=lambda index, outcome: answered.append(index))
        assert getattr(failed.value, "sent", False) is False
        await asyncio.sleep(2)  # past the requests' timeout: a slot left would answer now
        assert answered == []
    finally:
        await conn.close()
        await listener.close()


@pytest.mark.slow
async def test_a_lost_ack_reply_is_uncertain_and_holds_back_nothing_of_its_batch(
    nats_brokers, proxy, js
):
    broker = await nats_brokers(QUEUE, proxy.url, request_timeout=1.0)
    await broker.publish_many(QUEUE, [{"i": i} for i in range(10)])
    held = await receive_all(broker, 10)
    lost = held[3]
    proxy.drop_replies_to([lost.receipt.reply])
    order: list[tuple[int, Outcome]] = []
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held],
                                  lambda index, result: order.append((index, result.outcome)))
    assert [r.outcome for r in results] == [Outcome.OK] * 3 + [Outcome.UNCERTAIN] + [
        Outcome.OK] * 6
    assert "no reply" in (results[3].detail or "")
    assert order[-1] == (3, Outcome.UNCERTAIN)  # the others were reported before it
    assert proxy.dropped == 1
    assert proxy.published[lost.receipt.reply] == 1  # an uncertain ack is never replayed
    # The server did get it: nothing comes back, nothing is left.
    assert (await broker.receive(10, 2)).deliveries == []
    assert await stored(js) == 0


@pytest.mark.slow
async def test_a_cut_in_the_middle_of_a_batch_loses_nothing(nats_brokers, proxy, js):
    """The connection closes after half of a batch's acks went to the server: every ack
    ends UNCERTAIN or OK (none replayed), the broker reconnects, what was not applied
    comes back after the ack wait, and nothing is lost."""
    broker = await nats_brokers(QUEUE, proxy.url, ack_wait=2)
    pids = await broker.publish_many(QUEUE, [{"i": i} for i in range(100)])
    held = await receive_all(broker, 100)
    proxy.cut_after(held[49].receipt.reply.encode())
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held])
    assert proxy.triggered.is_set()
    assert {r.outcome for r in results} <= {Outcome.OK, Outcome.UNCERTAIN}
    assert all(proxy.published[d.receipt.reply] == 1 for d in held[:50])
    assert all(proxy.published[d.receipt.reply] == 0 for d in held[50:])  # never sent on
    assert all(r.outcome is Outcome.UNCERTAIN for r in results[50:])

    # The half that never reached the server comes back (so may some of the first half:
    # the cut can drop what the server had not read yet); what was confirmed does not.
    never_sent = {d.pid for d in held[50:]}
    confirmed = {d.pid for d, r in zip(held, results, strict=True) if r.ok}
    back: list = []

    async def drained() -> bool:
        received = await broker.receive(100, 1.0)  # after the ack wait, on a new connection
        back.extend(received.deliveries)
        assert all(r.ok for r in await broker.settle(
            [Settlement(Action.COMMIT, d) for d in received.deliveries]))
        return never_sent <= {d.pid for d in back} and await stored(js) == 0

    await until(drained, 30)
    assert broker.reconnects >= 1
    assert {d.pid for d in back} <= {d.pid for d in held} - confirmed
    assert {d.attempts for d in back} == {1}
    assert all(proxy.published[d.receipt.reply] == 1 for d in held[:50])  # none replayed
    assert sorted(pids) == sorted(d.pid for d in held)


@pytest.mark.slow
async def test_acks_sent_while_the_server_is_down_are_errors_then_settle_after_it_returns(
    nats_brokers, nats_server
):
    """Never sent: certainly not applied, so ERROR (the delivery stays ours and is settled
    again); once a new connection is up they settle (an ack the restarting server did
    not answer in time is uncertain and comes back if it was not applied): nothing lost."""
    broker = await nats_brokers(QUEUE, ack_wait=3, connect_timeout=1.0, request_timeout=1.0)
    pids = set(await broker.publish_many(QUEUE, [{"i": i} for i in range(20)]))
    held = await receive_all(broker, 20)
    await asyncio.to_thread(nats_server.stop)

    async def disconnected() -> bool:
        return broker._link.connection is None

    await until(disconnected, 20)
    results = await broker.settle([Settlement(Action.COMMIT, d) for d in held])
    assert {r.outcome for r in results} == {Outcome.ERROR}
    assert all(r.detail and "not sent" in r.detail for r in results)
    await asyncio.to_thread(nats_server.start)  # same port, same file storage
    pending = held
    for _ in range(30):
        results = await broker.settle([Settlement(Action.COMMIT, d) for d in pending])
        assert {r.outcome for r in results} <= {Outcome.OK, Outcome.UNCERTAIN, Outcome.ERROR}
        pending = [d for d, r in zip(pending, results, strict=True)
                   if r.outcome is Outcome.ERROR]
        if not pending:
            break
    assert not pending
    assert broker.reconnects >= 1

    async def drained() -> bool:  # what an unapplied uncertain ack left comes back
        received = await broker.receive(20, 1.0)
        assert {d.pid for d in received.deliveries} <= pids
        await broker.settle([Settlement(Action.COMMIT, d) for d in received.deliveries])
        client = await nats.connect(nats_server.url)
        try:
            info = await client.jetstream().stream_info(NAMES.stream)
        finally:
            await client.close()
        return info.state.messages == 0

    await until(drained, 30)


@pytest.mark.parametrize("raw", [
    b"NATS/1.0\r\nNats-Msg-Id: abc\r\nContent-Type: application/json\r\n\r\n",
    b"NATS/1.0 503\r\n\r\n",
    b"NATS/1.0 404 No Messages\r\n\r\n",
    b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\nNats-Pending-Bytes: 9\r\n\r\n",
    b"NATS/1.0 409 Consumer Deleted\r\n\r\n",
    b"NATS/1.0\r\nName:Value\r\nTabbed:\tx \r\nBad Name: skipped\r\n\r\n",
    "NATS/1.0\r\nQueue-Reason: caf\u00e9 \u2014 d\u00e9j\u00e0\r\n\r\n".encode(),
])
async def test_inbox_headers_are_read_as_nats_py_reads_them(nats_server, raw):
    """The inbox's messages skip nats-py's header parsing: the result must be the same."""
    client = await nats.connect(nats_server.url)
    try:
        assert _headers(raw) == await client._process_headers(raw)
    finally:
        await client.close()
