"""NATS names of a queue, byte for byte as queue 5 makes them, and what a start does when
the streams an earlier release named differently (non-ASCII queue names) still exist."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from broker.base import BrokerError
from broker.nats import NatsBroker
from broker.nats.setup import QueueNames
from supervisor import cli
from support.brokers import receive_all
from support.supervision import write_config

#: (queue, stream, subject, dead stream, dead subject) as PHP 8.2 computes them with queue
#: 5's streamToken()/subjectToken() (``preg_replace('/[^A-Za-z0-9_-]/', '_', $name)``, no
#: /u, then strtoupper/strtolower), produced by ``php -r`` and kept here as data.
PHP_NAMES = [
    ('stats-usage',
     'Q_STATS-USAGE', 'q.stats-usage.normal',
     'Q_STATS-USAGE_DEAD', 'q.stats-usage.dead'),
    ('v1-Stats.usage/x',
     'Q_V1-STATS_USAGE_X', 'q.v1-stats_usage_x.normal',
     'Q_V1-STATS_USAGE_X_DEAD', 'q.v1-stats_usage_x.dead'),
    ('caf\xe9',
     'Q_CAF__', 'q.caf__.normal',
     'Q_CAF___DEAD', 'q.caf__.dead'),
    ('CAF\xc9',
     'Q_CAF__', 'q.caf__.normal',
     'Q_CAF___DEAD', 'q.caf__.dead'),
    ('\xc6r\xf8sk\xf8bing',
     'Q___R__SK__BING', 'q.__r__sk__bing.normal',
     'Q___R__SK__BING_DEAD', 'q.__r__sk__bing.dead'),
    ('na\xefve_Q',
     'Q_NA__VE_Q', 'q.na__ve_q.normal',
     'Q_NA__VE_Q_DEAD', 'q.na__ve_q.dead'),
    ('\u7528\u6237\u7edf\u8ba1',
     'Q_____________', 'q.____________.normal',
     'Q______________DEAD', 'q.____________.dead'),
    ('\u30e6\u30fc\u30b6\u30fc',
     'Q_____________', 'q.____________.normal',
     'Q______________DEAD', 'q.____________.dead'),
    ('\U0001f680jobs',
     'Q_____JOBS', 'q.____jobs.normal',
     'Q_____JOBS_DEAD', 'q.____jobs.dead'),
    ('\U0001f469\u200d\U0001f4bb',
     'Q____________', 'q.___________.normal',
     'Q_____________DEAD', 'q.___________.dead'),
    ('a.b.c',
     'Q_A_B_C', 'q.a_b_c.normal',
     'Q_A_B_C_DEAD', 'q.a_b_c.dead'),
    ('with space',
     'Q_WITH_SPACE', 'q.with_space.normal',
     'Q_WITH_SPACE_DEAD', 'q.with_space.dead'),
    ('*',
     'Q__', 'q._.normal',
     'Q___DEAD', 'q._.dead'),
    ('>',
     'Q__', 'q._.normal',
     'Q___DEAD', 'q._.dead'),
    ('q.*.>',
     'Q_Q____', 'q.q____.normal',
     'Q_Q_____DEAD', 'q.q____.dead'),
    ('tab\there',
     'Q_TAB_HERE', 'q.tab_here.normal',
     'Q_TAB_HERE_DEAD', 'q.tab_here.dead'),
    ('\xdf',
     'Q___', 'q.__.normal',
     'Q____DEAD', 'q.__.dead'),
    ('\u0130stanbul',
     'Q___STANBUL', 'q.__stanbul.normal',
     'Q___STANBUL_DEAD', 'q.__stanbul.dead'),
    ('Stra\xdfe-\xc4\xd6\xdc',
     'Q_STRA__E-______', 'q.stra__e-______.normal',
     'Q_STRA__E-_______DEAD', 'q.stra__e-______.dead'),
    ('\xe9',
     'Q___', 'q.__.normal',
     'Q____DEAD', 'q.__.dead'),
    ('e\u0301',
     'Q_E__', 'q.e__.normal',
     'Q_E___DEAD', 'q.e__.dead'),
    ('\xa0nbsp',
     'Q___NBSP', 'q.__nbsp.normal',
     'Q___NBSP_DEAD', 'q.__nbsp.dead'),
    ('mixed_UP-case9',
     'Q_MIXED_UP-CASE9', 'q.mixed_up-case9.normal',
     'Q_MIXED_UP-CASE9_DEAD', 'q.mixed_up-case9.dead'),
    ('\u65e5\u672c.\u8a9e *>',
     'Q______________', 'q._____________.normal',
     'Q_______________DEAD', 'q._____________.dead'),
]


@pytest.mark.parametrize(("queue", "stream", "subject", "dead_stream", "dead_subject"),
                         PHP_NAMES)
def test_names_are_queue_5s_byte_for_byte(queue, stream, subject, dead_stream, dead_subject):
    names = QueueNames.of(queue)
    assert (names.stream, names.subject, names.dead_stream, names.dead_subject) == (
        stream, subject, dead_stream, dead_subject)


def test_a_name_too_long_in_bytes_is_refused_as_queue_5_refuses_it():
    # 83 three-byte characters: Q_<249 bytes>_DEAD is 256 bytes, over JetStream's 255 (queue
    # 5 measures strlen(), bytes); 82 of them fit.
    assert len(QueueNames.of("\u7528" * 82).dead_stream) == 2 + 246 + 5
    with pytest.raises(ValueError, match="would be 256 bytes"):
        QueueNames.of("\u7528" * 83)


def test_an_ascii_name_has_no_earlier_names():
    assert QueueNames.legacy("stats-usage.v1") is None
    assert QueueNames.legacy("caf\u00e9") == QueueNames(
        "Q_CAF_", "q.caf_.normal", "Q_CAF__DEAD", "q.caf_.dead")


async def streams(js) -> set[str]:
    return {info.config.name for info in await js.streams_info()}


async def test_a_queue_5_producer_and_the_broker_meet_on_one_stream(nats_server, js):
    """A PHP producer publishes on the subject PHP computes; the supervisor receives it."""
    broker = NatsBroker(nats_server.url, "caf\u00e9", request_timeout=2.0)
    try:
        await broker.connect()
        await js.publish("q.caf__.normal", b'{"pid":"p1","queue":"caf\\u00e9","timestamp":1,'
                         b'"payload":{"n":1}}', headers={"Nats-Msg-Id": "p1"})
        [delivery] = await receive_all(broker, 1)
        assert delivery.pid == "p1"
        assert await streams(js) == {"Q_CAF__", "Q_CAF___DEAD"}
    finally:
        await broker.close()


async def earlier_release_stream(js, queue: str, identity: str) -> QueueNames:
    """The streams an earlier release created for ``queue`` (one '_' per character)."""
    old = QueueNames.legacy(queue)
    assert old is not None
    for name, subjects in ((old.stream, [old.subject, old.subject + ".*"]),
                           (old.dead_stream, [old.dead_subject])):
        await js.add_stream(StreamConfig(
            name=name, subjects=subjects, retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE, metadata={"utopia_queue_identity": identity}))
    return old


@pytest.mark.parametrize("waiting", [0, 2])
async def test_a_start_beside_the_earlier_releases_stream_refuses_naming_both(
    nats_server, js, waiting
):
    old = await earlier_release_stream(js, "caf\u00e9", "12:utopia-queue:caf\u00e9")
    for n in range(waiting):
        await js.publish(old.subject, b'{"pid":"p%d"}' % n)
    broker = NatsBroker(nats_server.url, "caf\u00e9", request_timeout=2.0)
    try:
        with pytest.raises(BrokerError) as refused:
            await broker.connect()
    finally:
        await broker.close()
    said = str(refused.value)
    assert "Q_CAF_ " in said and "Q_CAF__ " in said and "nats stream rm Q_CAF_)" in said
    assert f"({waiting} messages)" in said
    assert await streams(js) == {"Q_CAF_", "Q_CAF__DEAD"}  # nothing created, nothing moved
    with pytest.raises(NotFoundError):
        await js.stream_info("Q_CAF__")


async def test_the_same_name_owned_by_another_queue_is_not_mistaken_for_ours(nats_server, js):
    """Q_CAF_ is also queue "caf_"'s own stream: it stays that queue's business."""
    await earlier_release_stream(js, "caf\u00e9", "12:utopia-queue:caf_")
    broker = NatsBroker(nats_server.url, "caf\u00e9", request_timeout=2.0)
    try:
        await broker.connect()
        assert broker.names.stream == "Q_CAF__"
    finally:
        await broker.close()


async def test_dead_letters_left_in_the_earlier_dead_stream_are_named(nats_server, js, caplog):
    old = await earlier_release_stream(js, "caf\u00e9", "12:utopia-queue:caf\u00e9")
    await js.publish(old.dead_subject, b"dead")
    await js.delete_stream(old.stream)  # drained and removed, as the refusal asks
    broker = NatsBroker(nats_server.url, "caf\u00e9", request_timeout=2.0)
    try:
        await broker.connect()
    finally:
        await broker.close()
    assert "NATS stream Q_CAF__DEAD holds 1 dead letters" in caplog.text
    assert "Q_CAF___DEAD" in caplog.text


async def test_status_names_the_earlier_releases_stream(
    nats_server, js, tmp_path, capsys, monkeypatch
):
    """What the operator of a supervisor that refuses to start sees in `status`."""
    monkeypatch.delenv("QUEUE_BROKER_URL", raising=False)
    old = await earlier_release_stream(js, "caf\u00e9", "12:utopia-queue:caf\u00e9")
    await js.publish(old.subject, b'{"pid":"p1"}')
    conf = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle",
                            job={"queue": "caf\u00e9"}))
    code = await asyncio.to_thread(cli.main, ["status", conf, "--json"])
    state = orjson.loads(capsys.readouterr().out)
    assert code == 0 and state["stream"] is None
    assert state["earlier_stream"] == {"name": "Q_CAF_", "messages": 1}
    code = await asyncio.to_thread(cli.main, ["status", conf])
    assert "earlier name  stream Q_CAF_ still exists (1 messages)" in capsys.readouterr().out
