"""The NATS JetStream part of a soak run (see ``bench.chaos.sides`` for the Redis one).

Supervisors connect through a TCP proxy, so a "connection cut" closes their connections
from the server's side of the wire; the harness connects to the server directly. The
server runs with file storage and is restarted with SIGKILL; publishing pauses meanwhile.
A publish carries ``Nats-Msg-Id``, so repeating one whose PubAck was lost is deduplicated
by the stream.

With ``cluster=True`` (``--nats-cluster``) the broker is three servers with the work
stream on 3 replicas, one proxy each (the supervisors get the three proxy URLs); instead
of the whole-server restart the fault is a "failover": SIGKILL of the stream's leader (every
other time, of a server picked at random), and once a new leader answers, the victim is
started again and rejoins.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from typing import Any

import nats
import orjson
from nats.js.errors import NotFoundError

from bench.chaos.sides import Check, FinalState
from broker.nats.setup import CONSUMER, QueueNames
from support.faultproxy import FaultProxy
from support.servers import NatsCluster, NatsServer
from support.soak_workload import OVERSIZED, Message


class NatsSide:
    name = "nats"
    #: Every kind this side knows (a cluster injects "failover", a lone server restarts).
    known_faults = ("connection_cut", "broker_restart", "failover")

    def __init__(self, queue: str, cluster: bool = False) -> None:
        self.queue = queue
        self.names = QueueNames.of(queue)
        self.cluster = NatsCluster() if cluster else None
        self.server = self.cluster.servers[0] if self.cluster else NatsServer()
        self.faults = ("connection_cut", "failover" if cluster else "broker_restart")
        self.proxies: list[FaultProxy] = []
        self.failovers = 0
        self.publishing = asyncio.Event()
        self.publishing.set()
        self.nc: Any = None
        self.js: Any = None
        self.sequences: dict[str, int] = {}  # pid -> stream sequence (from the PubAck)

    @property
    def supervisor_url(self) -> str:
        return ",".join(proxy.url for proxy in self.proxies)

    @property
    def servers(self) -> list[NatsServer]:
        return self.cluster.servers if self.cluster else [self.server]

    def config_sections(self, settings: Any) -> dict[str, dict[str, Any]]:
        # Redelivery after the lease, as on Redis; the consumer's budget is max_attempts.
        return {"nats": {"ack_wait": settings.lease, "replicas": len(self.servers)}}

    async def start(self) -> None:
        if self.cluster:
            await asyncio.to_thread(self.cluster.start)
        else:
            self.server.start()
        self.proxies = [await FaultProxy(server.port).start() for server in self.servers]
        self.nc = await nats.connect(
            [server.url for server in self.servers], max_reconnect_attempts=-1,
            reconnect_time_wait=0.1,
            name="chaos harness", error_cb=_quiet, disconnected_cb=_quiet_event,
            reconnected_cb=_quiet_event,
        )
        self.js = self.nc.jetstream(timeout=2)

    async def ready(self) -> None:
        """The supervisors create the streams and consumer when they connect."""
        deadline = time.monotonic() + 30
        while True:
            try:
                await self.js.consumer_info(self.names.stream, CONSUMER)
                await self.js.stream_info(self.names.dead_stream)
                return
            except NotFoundError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                await proxy.close()
        await asyncio.sleep(0.1)  # let the proxies' connection tasks end
        if self.cluster:
            self.cluster.close()
        else:
            self.server.close()

    # -- publishing -------------------------------------------------------------------------

    async def publish(self, messages: list[Message]) -> None:
        await self.publishing.wait()
        acks = await asyncio.gather(*(self._publish_one(message) for message in messages))
        for message, ack in zip(messages, acks, strict=True):
            if message.pid is not None:
                self.sequences[message.pid] = ack.seq

    async def _publish_one(self, message: Message) -> Any:
        msg_id = message.pid or "malformed-" + hashlib.sha1(message.raw).hexdigest()
        for attempt in range(50):
            try:
                return await self.js.publish(self.names.subject, message.raw,
                                             headers={"Nats-Msg-Id": msg_id})
            except Exception:  # deduplicated by Nats-Msg-Id: repeating is safe
                if attempt == 49:
                    raise
                await asyncio.sleep(0.2)
                await self.publishing.wait()
        raise AssertionError("unreachable")

    # -- faults -----------------------------------------------------------------------------

    async def inject(self, fault: str) -> str:
        if fault == "connection_cut":
            pairs = sum(len(proxy._pairs) for proxy in self.proxies)
            for proxy in self.proxies:
                await proxy.cut()
            return f"proxy cut {pairs} supervisor connections"
        if fault == "broker_restart" and not self.cluster:
            return await self._restart()
        if fault == "failover" and self.cluster:
            return await self._failover(self.cluster)
        raise ValueError(f"fault {fault!r} does not apply to this NATS side")

    async def _failover(self, cluster: NatsCluster) -> str:
        """SIGKILL the stream leader (or every other time any server); once the cluster
        has a stream leader again, start the victim, which rejoins. Publishing goes on
        (its retries wait out the election)."""
        self.failovers += 1
        leader = await asyncio.to_thread(cluster.leader, self.names.stream)
        victim = leader if leader and self.failovers % 2 else self._rng_server(cluster)
        what = "stream leader" if victim is leader else "server"
        began = time.monotonic()
        victim.stop()
        await asyncio.to_thread(self._until_led, cluster, victim)
        elected = time.monotonic() - began
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(cluster.wait_ready, 60)
        return (f"SIGKILL {what} {victim.name}; a stream leader after {elected:.2f}s; "
                f"{victim.name} rejoined after {time.monotonic() - began:.2f}s")

    def _rng_server(self, cluster: NatsCluster) -> NatsServer:
        return cluster.servers[(self.failovers // 2) % len(cluster.servers)]

    def _until_led(self, cluster: NatsCluster, victim: NatsServer) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            leader = cluster.leader(self.names.stream)
            if leader is not None and leader is not victim:
                return
            time.sleep(0.05)

    async def _restart(self) -> str:
        self.publishing.clear()
        try:
            began = time.monotonic()
            self.server.stop()  # SIGKILL; file storage
            self.server.start()
            listening = time.monotonic() - began
            await self._until_jetstream()
            answering = time.monotonic() - began
        finally:
            self.publishing.set()
        return (f"nats-server SIGKILL and restart (listening after {listening:.2f}s, "
                f"JetStream answering the harness after {answering:.2f}s)")

    async def _until_jetstream(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                await self.js.stream_info(self.names.stream)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    # -- state --------------------------------------------------------------------------------

    async def _retry(self, call: Any) -> Any:
        for attempt in range(100):
            try:
                return await call()
            except NotFoundError:
                raise
            except Exception:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    async def consumer_of(self, process: int) -> None:
        """JetStream does not say which deliveries a client holds: not measured."""
        return None

    async def held_by(self, consumer: str) -> int:
        return 0

    async def outstanding(self) -> dict[str, int]:
        consumer = await self._retry(
            lambda: self.js.consumer_info(self.names.stream, CONSUMER))
        stream = await self._retry(lambda: self.js.stream_info(self.names.stream))
        return {"pending": consumer.num_pending, "ack_pending": consumer.num_ack_pending,
                "in stream": stream.state.messages}

    async def dead_letters(self) -> list[Any]:
        info = await self._retry(lambda: self.js.stream_info(self.names.dead_stream))
        found = []
        if info.state.messages:
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                with contextlib.suppress(NotFoundError):
                    found.append(await self._retry(
                        lambda seq=seq: self.js.get_msg(self.names.dead_stream, seq)))
        return found

    async def failed_now(self) -> set[str]:
        return {pid for pid, _ in _split(await self.dead_letters())[0]}

    async def final_state(self, messages: list[Message], max_attempts: int) -> FinalState:
        counts = await self.outstanding()
        consumer = await self._retry(
            lambda: self.js.consumer_info(self.names.stream, CONSUMER))
        letters = await self.dead_letters()
        failed, poison = _split(letters)
        failed_pids = [pid for pid, _ in failed]
        oversized = {m.raw for m in messages if m.kind == OVERSIZED}
        reasons = [(letter.headers or {}).get("Queue-Reason", "") for letter in letters
                   if letter.data in oversized]
        sized = all(reason.startswith("malformed: envelope of") and "exceeds" in reason
                    for reason in reasons)
        malformed = Counter(m.raw for m in messages if m.pid is None)
        # Rejected on the last attempt: max_attempts deliveries; found out of attempts at
        # receive (the last one was lost with a worker, or released): one more.
        attempts_ok = all(attempts.isdigit() and int(attempts) >= max_attempts
                          for _, attempts in failed)
        checks = [
            Check("stream messages (workqueue: acked = gone)", 0, counts["in stream"],
                  counts["in stream"] == 0,
                  await self._leftovers() if counts["in stream"] else ""),
            Check("consumer: not yet delivered", 0, counts["pending"], counts["pending"] == 0),
            Check("consumer: awaiting ack", 0, counts["ack_pending"],
                  counts["ack_pending"] == 0,
                  f"{consumer.num_redelivered} redelivered now"),
            Check(f"dead letters after >= {max_attempts} deliveries", len(failed),
                  "all" if attempts_ok else "not all", attempts_ok),
            Check("dead letters, each pid once", len(set(failed_pids)), len(failed_pids),
                  len(failed_pids) == len(set(failed_pids))),
            Check("dead malformed = malformed + oversized", sum(malformed.values()),
                  len(poison), Counter(poison) == malformed),
            Check("oversized dead, their size as the reason", len(oversized),
                  len(reasons) if sized else "not all", sized and len(reasons) == len(oversized)),
        ]
        return FinalState(set(failed_pids), checks)

    async def _leftovers(self, limit: int = 1000) -> str:
        """What is left in the work stream, by kind: a release's copies (Nats-Msg-Id
        ``<pid>.released.<seq>``, a stopping supervisor's) or originals, to tell at once a
        duplicate handed back at the stop from a message never handled."""
        info = await self._retry(lambda: self.js.stream_info(self.names.stream))
        kinds: Counter[str] = Counter()
        for seq in range(info.state.first_seq, min(info.state.last_seq,
                                                    info.state.first_seq + limit) + 1):
            try:
                msg = await self._retry(lambda seq=seq: self.js.get_msg(self.names.stream, seq))
            except NotFoundError:  # counted by the stream's info, yet not served
                kinds["not found by seq"] += 1
                continue
            msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
            kinds["release copies" if ".released." in msg_id else "originals"] += 1
        return (", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
                + f"; seqs {info.state.first_seq}-{info.state.last_seq}")

    async def locate(self, pid: str) -> str:
        seq = self.sequences.get(pid)
        if seq is None:
            return "no PubAck recorded"
        places = [f"published as stream seq {seq}"]
        try:
            await self._retry(lambda: self.js.get_msg(self.names.stream, seq))
            places.append("still in the stream")
        except NotFoundError:
            places.append("no longer in the stream (acked or terminated)")
        consumer = await self._retry(
            lambda: self.js.consumer_info(self.names.stream, CONSUMER))
        places.append(f"consumer delivered up to {consumer.delivered.stream_seq}, "
                      f"ack floor {consumer.ack_floor.stream_seq}")
        if pid in await self.failed_now():
            places.append("in the dead stream")
        return ", ".join(places)


async def _quiet(error: Exception) -> None:
    """The harness's own connection breaks with every server restart: expected."""


async def _quiet_event() -> None:
    pass


def _split(letters: list[Any]) -> tuple[list[tuple[str, str]], list[bytes]]:
    """Dead letters as ((pid, attempts) of envelopes, raw bytes of malformed payloads)."""
    failed, poison = [], []
    for letter in letters:
        attempts = (letter.headers or {}).get("Queue-Attempts", "?")
        try:
            pid = orjson.loads(letter.data).get("pid")
        except (orjson.JSONDecodeError, AttributeError):
            pid = None
        reason = (letter.headers or {}).get("Queue-Reason", "")
        if isinstance(pid, str) and not reason.startswith("malformed"):
            failed.append((pid, attempts))
        else:
            poison.append(letter.data)
    return failed, poison
