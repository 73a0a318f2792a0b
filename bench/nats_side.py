"""NATS JetStream figures and set-up: messages, bytes and CPU of the server, a held stream.

Counts come from the monitor port's ``/varz`` (in/out messages and bytes over all
connections). The harness polls ``/jsz`` over HTTP, which those counts do not include.
Server CPU is read from the server process when the harness started it; for a server
given by URL it is ``/varz`` "cpu" (percent) times the wall time, a coarse figure.

The stream is created exactly as the supervisor creates it, with the durable consumer
paused, so the queue can be filled before the worker starts; resuming it (plus one more
message, which wakes the pull requests held while paused) is the start of a run.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import dataclass
from typing import Any

import psutil

from bench.common import QUEUE, stats_usage_payload
from broker import envelope
from broker.nats import api
from broker.nats.setup import SPARE_DELIVERY, QueueNames

NAMES = QueueNames.of(QUEUE)
PAUSED_UNTIL = "2999-01-01T00:00:00Z"
ACK_WAIT_S = 30
MAX_ATTEMPTS = 3
MAX_DELIVER = MAX_ATTEMPTS + 1  # queue 5's layout: the budget and one spare delivery


@dataclass
class NatsTarget:
    url: str
    monitor: str | None  # http://host:port of the monitor endpoint
    server_pid: int | None = None


@dataclass
class Snapshot:
    cpu: float | None
    cpu_percent: float | None
    in_msgs: int
    out_msgs: int
    in_bytes: int
    out_bytes: int


def monitor(target: NatsTarget, path: str) -> dict[str, Any]:
    if not target.monitor:
        return {}
    with urllib.request.urlopen(f"{target.monitor}{path}", timeout=5) as answer:
        return json.load(answer)


def snapshot(target: NatsTarget) -> Snapshot:
    varz = monitor(target, "/varz")
    cpu = None
    if target.server_pid:
        times = psutil.Process(target.server_pid).cpu_times()
        cpu = times.user + times.system
    return Snapshot(
        cpu=cpu, cpu_percent=varz.get("cpu"),
        in_msgs=int(varz.get("in_msgs", 0)), out_msgs=int(varz.get("out_msgs", 0)),
        in_bytes=int(varz.get("in_bytes", 0)), out_bytes=int(varz.get("out_bytes", 0)),
    )


def delta(before: Snapshot, after: Snapshot, seconds: float) -> dict[str, Any]:
    if before.cpu is not None and after.cpu is not None:
        cpu = after.cpu - before.cpu
    elif after.cpu_percent is not None:
        cpu = after.cpu_percent / 100 * seconds  # coarse: the server's own recent average
    else:
        cpu = None
    return {
        "server_cpu_s": cpu,
        "in_msgs": after.in_msgs - before.in_msgs,
        "out_msgs": after.out_msgs - before.out_msgs,
        "requests": (after.in_msgs - before.in_msgs) or None,
        "bytes_in": after.in_bytes - before.in_bytes,
        "bytes_out": after.out_bytes - before.out_bytes,
    }


def stored_messages(target: NatsTarget) -> int:
    """Messages left in all streams (a work-queue stream drops a message once acked)."""
    return int(monitor(target, "/jsz").get("messages", 0))


def consumer_state(target: NatsTarget) -> dict[str, Any]:
    for account in monitor(target, "/jsz?consumers=true").get("account_details", []):
        for stream in account.get("stream_detail", []):
            if stream.get("name") != NAMES.stream:
                continue
            for consumer in stream.get("consumer_detail", []):
                if consumer.get("name") == NAMES.consumer:
                    return consumer
    return {}


async def _api(nc: Any, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await nc.request(subject, json.dumps(body).encode() if body else b"", timeout=10)
    return json.loads(reply.data)


class Control:
    """A harness connection kept open across a run (its own event loop, run step by step),
    so starting a run costs one API request and one publish, not a connect."""

    def __init__(self, url: str) -> None:
        import nats

        self.loop = asyncio.new_event_loop()
        self.nc = self.run(nats.connect(url))

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def prepare(self, messages: int) -> None:
        """Fresh streams, the durable consumer paused, ``messages`` envelopes stored."""
        self.run(self._prepare(messages))

    async def _prepare(self, messages: int) -> None:
        for name in (NAMES.stream, NAMES.dead_stream):
            await _api(self.nc, api.stream_delete(name))
        for name, subject in ((NAMES.stream, NAMES.subject),
                              (NAMES.dead_stream, NAMES.dead_subject)):
            created = await _api(self.nc, api.stream_create(name), {
                "name": name, "subjects": [subject], "retention": "workqueue",
                "storage": "file",
            })
            if "error" in created:
                raise RuntimeError(f"cannot create stream {name}: {created['error']}")
        subject = api.consumer_create(NAMES.stream, NAMES.consumer)
        created = await _api(self.nc, subject, {
            "stream_name": NAMES.stream, "action": "create", "config": {
                "durable_name": NAMES.consumer, "ack_policy": "explicit",
                "ack_wait": ACK_WAIT_S * 1_000_000_000, "max_deliver": MAX_DELIVER,
                "metadata": {SPARE_DELIVERY: "1"},
                "filter_subject": NAMES.subject, "deliver_policy": "all",
                "pause_until": PAUSED_UNTIL,
            },
        })
        if "error" in created:
            raise RuntimeError(f"cannot create consumer: {created['error']}")
        await publish(self.nc, messages)

    def resume(self) -> None:
        """Unpause the consumer and publish one more message (the run's last)."""
        self.run(self._resume())

    async def _resume(self) -> None:
        subject = api.consumer_pause(NAMES.stream, NAMES.consumer)
        answer = await _api(self.nc, subject, {})
        if answer.get("paused"):
            raise RuntimeError(f"consumer still paused: {answer}")
        await publish(self.nc, 1, start=10**6)  # wakes the pull requests held while paused

    def close(self) -> None:
        self.run(self.nc.close())
        self.loop.close()


async def publish(nc: Any, messages: int, start: int = 0, published: float | None = None) -> None:
    """Publish stats-usage envelopes and wait for every PubAck (500 in flight)."""
    js = nc.jetstream()
    for first in range(start, start + messages, 500):
        batch = []
        for n in range(first, min(first + 500, start + messages)):
            pid, raw = envelope.build(QUEUE, stats_usage_payload(n, published))
            batch.append(js.publish(NAMES.subject, raw, headers={"Nats-Msg-Id": pid}))
        await asyncio.gather(*batch)


def server_version(target: NatsTarget) -> str:
    version = monitor(target, "/varz").get("version")
    return f"nats-server {version}" if version else "nats-server (version unknown)"
