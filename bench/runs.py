"""One measured run: ``python -m supervisor`` (or a peer) against a pre-filled queue.

Every run follows the same steps, so figures compare:

1. fill the queue while nothing consumes it (Redis: a staging key; NATS: a paused consumer);
2. start the worker and wait until it is up and idle (start-up is not measured);
3. read the CPU of the worker's process family and the server's counters;
4. make the messages available at once (Redis: RENAME staging -> ready; NATS: resume the
   consumer), start the clock;
5. poll until every message is done (Redis: the success counter, or the peer's own
   structures; NATS: no message left in the stream), stop the clock, read everything again.

Client CPU is the worker process plus every process it forked (psutil, read while they
live); peak RSS is each process's VmHWM just before it is stopped.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from bench import latency, nats_side, redis_side
from bench.common import (
    NAMESPACE,
    NATS_POLL,
    QUEUE,
    Family,
    per_job,
    percentiles,
    start,
    stop,
    until,
    wait_for_line,
    wait_until_title,
)
from broker.nats import api
from broker.redis.keys import QueueKeys
from support.servers import free_port

KEYS = QueueKeys(NAMESPACE, QUEUE)
STAGING = f"{KEYS.ready}.staging"
HANDLERS = {"noop": "examples.noop:handle", "stats-usage": "examples.stats_usage:handle",
            "stats-usage-sqlite": "examples.stats_usage:handle", "sleep-1ms": "bench.slow:handle"}
LATENCY_HANDLERS = {"noop": "bench.latency:handle", "stats-usage": "bench.latency_usage:handle",
                    "stats-usage-sqlite": "bench.latency_usage:handle"}
#: The stats-usage store per handler: the embedded ClickHouse engine (the default) or SQLite.
USAGE_DB = {"stats-usage-sqlite": "usage.sqlite"}


def usage_db(folder: Path, handler: str) -> str:
    return str(folder / USAGE_DB.get(handler, "usage.chdb"))


def usage_store_ready(folder: Path, handler: str) -> Any:
    """The stats-usage store, once it answers (the embedded engine's writer takes 1.5 s and
    more to start, and a run measured before it serves would time its start); None for
    other handlers. Close it after the supervisor stopped."""
    if not handler.startswith("stats-usage"):
        return None
    from examples.usage import is_sqlite, open_store

    db = usage_db(folder, handler)
    if not is_sqlite(db):  # the handlers' writer, not one of ours (its CPU is the job's)
        deadline = time.monotonic() + 120
        while not _listening(db):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no stats-usage writer listens for {db}")
            time.sleep(0.05)
    return open_store(db)


def _listening(db: str) -> bool:
    """Whether a writer holds the database's socket name (a handler's: only they start
    one before this); connecting to it then starts no writer of the harness's own."""
    import socket

    from examples.usage import wire

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(wire.address(db))
            return True
        except OSError:
            return False


def usage_totals_exact(folder: Path, handler: str, messages: int, store: Any = None
                       ) -> bool | None:
    """Whether a stats-usage run stored exactly the totals of the messages it was given
    (throughput alone cannot show that it counted right); None for other handlers.
    ``store``: the run's own (``usage_store_ready``), read while the job's writer still
    serves, once every message is acknowledged: no writer of its own to start (2 s and
    more a run)."""
    if not handler.startswith("stats-usage"):
        return None
    if store is not None:
        return store.totals() == expected_usage(messages)
    from examples.stats_usage import totals

    return totals(usage_db(folder, handler)) == expected_usage(messages)


def expected_usage(messages: int) -> dict[tuple[str, str], int]:
    """The totals of ``stats_usage_payload(n)`` for n below ``messages``."""
    from bench.common import stats_usage_payload

    expected: dict[tuple[str, str], int] = {}
    for n in range(messages):
        payload = stats_usage_payload(n, 0.0)
        for metric in payload["metrics"]:
            key = (payload["project"]["$id"], metric["key"])
            expected[key] = expected.get(key, 0) + metric["value"]
    return expected
SETTLE_AFTER_START = 0.5  # seconds: handler processes ready, receive blocked on the empty queue


@dataclass
class RedisTarget:
    url: str
    server_pid: int | None = None
    client: redis.Redis = field(init=False)
    internal: set[str] = field(init=False)
    broker: str = "redis"

    def __post_init__(self) -> None:
        self.client = redis.Redis.from_url(self.url)
        self.internal = redis_side.script_commands()


@dataclass
class NatsTargetRun:
    target: nats_side.NatsTarget
    control: nats_side.Control = field(init=False)
    broker: str = "nats"

    def __post_init__(self) -> None:
        self.control = nats_side.Control(self.target.url)

    @property
    def url(self) -> str:
        return self.target.url


#: Serve the supervisor's Prometheus metrics during runs and read its own counters
#: (receive calls, settle batch sizes). Off by default: it is not free.
METRICS = False


def job_file(folder: Path, url: str, handler: str, prefetch: int, metrics_port: int = 0,
             coroutines: int = 1) -> Path:
    config = folder / "bench.toml"
    text = (
        f'[broker]\nurl = "{url}"\nnamespace = "{NAMESPACE}"\n'
        f'[job]\nqueue = "{QUEUE}"\nhandler = "{handler}"\ncoroutines = {coroutines}\n'
        f"prefetch = {prefetch}\nmax_attempts = {nats_side.MAX_ATTEMPTS}\n"
        f'[supervisor]\nlog_level = "warning"\nmetrics_port = {metrics_port}\n'
    )
    if url.startswith(("nats://", "tls://")):
        text += f"[nats]\nack_wait = {nats_side.ACK_WAIT_S}\n"
    config.write_text(text)
    return config


class OwnCounters:
    """The supervisor's own counters, read from its metrics endpoint (when ``METRICS``)."""

    WANTED = {
        ("queue_supervisor_deliveries_received_total", ""): "received",
        ("queue_supervisor_broker_call_seconds_count", "receive"): "receive_calls",
        ("queue_supervisor_settle_batch_size_count", ""): "settle_calls",
        ("queue_supervisor_settle_batch_size_sum", ""): "settled",
    }

    def __init__(self) -> None:
        self.port = free_port() if METRICS else 0

    def read(self) -> dict[str, float]:
        if not self.port:
            return {}
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as page:
            text = page.read().decode()
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            operation = re.search(r'operation="([^"]*)"', labels)
            key = (name, operation.group(1) if operation else "")
            if key in self.WANTED:
                found[self.WANTED[key]] = float(value)
        return found

    @staticmethod
    def fill(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
        if not after:
            return {}
        got = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        return {
            "own_receive_fill": got["received"] / got["receive_calls"]
            if got.get("receive_calls") else None,
            "own_settle_fill": got["settled"] / got["settle_calls"]
            if got.get("settle_calls") else None,
            "own_counters": got,
        }


def _figures(jobs: int, seconds: float, client_cpu: float | None, server: dict[str, Any]
             ) -> dict[str, Any]:
    return {
        "messages": jobs,
        "seconds": seconds,
        "jobs_per_s": jobs / seconds,
        "client_us_per_job": per_job(client_cpu, jobs, 1e6),
        "server_us_per_job": per_job(server.get("server_cpu_s"), jobs, 1e6),
        "requests_per_job": per_job(server.get("requests"), jobs),
        "bytes_in_per_job": per_job(server.get("bytes_in"), jobs),
        "bytes_out_per_job": per_job(server.get("bytes_out"), jobs),
        "server": server,
    }


@contextlib.contextmanager
def run_folder() -> Iterator[str]:
    """A run's temporary folder, removed only once no process names it any more: the
    stats-usage writer is the handlers' child, not ours, and after the stop it still moves
    its log into the engine there for a moment (removing the folder under it failed the
    cleanup and lost that configuration's latency row)."""
    with tempfile.TemporaryDirectory(prefix="bench-") as workdir:
        try:
            yield workdir
        finally:
            users = [process for process in psutil.process_iter(["cmdline"])
                     if any(workdir in part for part in process.info["cmdline"] or ())]
            psutil.wait_procs(users, timeout=15)


# -- the supervisor ----------------------------------------------------------------------------


def supervisor_redis(target: RedisTarget, prefetch: int, messages: int, handler: str,
                     history: bool = False, coroutines: int = 1) -> dict[str, Any]:
    client = target.client
    client.flushdb()
    if history:
        from bench.large_history import fill_history

        fill_history(client)
    redis_side.fill(client, STAGING, messages)
    with run_folder() as workdir:
        folder = Path(workdir)
        own = OwnCounters()
        config = job_file(folder, target.url, HANDLERS[handler], prefetch, own.port,
                          coroutines)
        child = start(["-m", "supervisor", str(config)], STATS_USAGE_DB=usage_db(folder, handler))
        store = None
        try:
            wait_until_title(child.pid, "running")
            store = usage_store_ready(folder, handler)
            time.sleep(SETTLE_AFTER_START)
            family = Family(child.pid)
            probe = redis_side.Probe(redis.Redis.from_url(target.url))
            own_before = own.read()
            redis_side.reset(client)
            before, cpu_before = redis_side.snapshot(client), family.cpu()
            root_before = family.root_cpu()
            began = time.perf_counter()
            client.rename(STAGING, KEYS.ready)
            until(lambda: probe.get_int(KEYS.stat("success")) >= messages, child, 600)
            seconds = time.perf_counter() - began
            cpu = family.cpu() - cpu_before
            root_cpu = family.root_cpu() - root_before
            after = redis_side.snapshot(client)
            rss_supervisor, rss_children = family.peak_rss()
            own_figures = OwnCounters.fill(own_before, own.read())
            # Every message is acknowledged, so flushed: read after the figures above.
            own_figures["totals_exact"] = usage_totals_exact(folder, handler, messages, store)
        finally:
            stop(child)
            if store is not None:
                store.close()
    server = redis_side.delta(before, after, target.internal, probe)
    result = _figures(messages, seconds, cpu, server)
    claimed = int(client.get(KEYS.stat("total")) or 0)
    result.update(
        broker="redis", system="queue-supervisor", handler=handler, prefetch=prefetch,
        coroutines=coroutines, history=history,
        supervisor_us_per_job=per_job(root_cpu, messages, 1e6),
        batch_fill=per_job(messages, server["claim_calls"] or 0),
        reserve_calls=server["reserve_calls"], settle_fill=per_job(messages,
                                                                   server["settle_calls"] or 0),
        rss_supervisor_mib=rss_supervisor, rss_children_mib=rss_children,
        redeliveries=max(0, claimed - messages),
        failed=int(client.get(KEYS.stat("failed")) or 0),
        script_usec_per_call=server["script_usec_per_call"],
        slow_calls=redis_side.slow_calls(client), **own_figures,
    )
    return result


def supervisor_nats(run: NatsTargetRun, prefetch: int, messages: int, handler: str,
                    coroutines: int = 1) -> dict[str, Any]:
    target = run.target
    run.control.prepare(messages)
    with run_folder() as workdir:
        folder = Path(workdir)
        own = OwnCounters()
        config = job_file(folder, target.url, HANDLERS[handler], prefetch, own.port,
                          coroutines)
        child = start(["-m", "supervisor", str(config)], STATS_USAGE_DB=usage_db(folder, handler))
        store = None
        try:
            wait_until_title(child.pid, "running")
            store = usage_store_ready(folder, handler)
            time.sleep(SETTLE_AFTER_START)
            family = Family(child.pid)
            own_before = own.read()
            before, cpu_before = nats_side.snapshot(target), family.cpu()
            root_before = family.root_cpu()
            began = time.perf_counter()
            run.control.resume()
            until(lambda: nats_side.stored_messages(target) == 0, child, 600, NATS_POLL)
            seconds = time.perf_counter() - began
            cpu = family.cpu() - cpu_before
            root_cpu = family.root_cpu() - root_before
            after = nats_side.snapshot(target)
            rss_supervisor, rss_children = family.peak_rss()
            own_figures = OwnCounters.fill(own_before, own.read())
        finally:
            stop(child)
            if store is not None:
                store.close()
    jobs = messages + 1  # the message that woke the held pulls
    server = nats_side.delta(before, after, seconds)
    result = _figures(jobs, seconds, cpu, server)
    consumer = nats_side.consumer_state(target)
    result.update(
        broker="nats", system="queue-supervisor", handler=handler, prefetch=prefetch,
        coroutines=coroutines, history=False,
        supervisor_us_per_job=per_job(root_cpu, jobs, 1e6),
        batch_fill=_nats_fill(jobs, server),
        rss_supervisor_mib=rss_supervisor, rss_children_mib=rss_children,
        redeliveries=consumer.get("num_redelivered"), failed=None, **own_figures,
    )
    result["settle_fill"] = result.get("own_settle_fill")
    return result


def _nats_fill(jobs: int, server: dict[str, Any]) -> float | None:
    """Messages per pull request, derived: client messages in = pulls + one ack per job
    (+ the few renewals, which make this figure a little low)."""
    pulls = server["in_msgs"] - jobs - 2  # the harness's resume request and last publish
    return jobs / pulls if pulls > 0 else None


# -- queue latency at a fixed publish rate -------------------------------------------------------


def latency_run(target: RedisTarget | NatsTargetRun, prefetch: int, handler: str, rate: float,
                messages: int, coroutines: int = 1) -> dict[str, Any]:
    """Start the supervisor on an empty queue, publish ``messages`` at ``rate``/s, and
    measure handler start minus publish time for each."""
    if isinstance(target, RedisTarget):
        target.client.flushdb()
        done = _redis_done(target, messages)
    else:
        target.control.prepare(0)
        target.control.run(_unpause(target))
        done = _nats_done(target)
    with run_folder() as workdir:
        folder = Path(workdir)
        config = job_file(folder, target.url, LATENCY_HANDLERS[handler], prefetch,
                          coroutines=coroutines)
        child = start(["-m", "supervisor", str(config)], STATS_USAGE_DB=usage_db(folder, handler),
                      BENCH_LATENCY_DIR=str(folder))
        store = None
        try:
            wait_until_title(child.pid, "running")
            store = usage_store_ready(folder, handler)
            time.sleep(SETTLE_AFTER_START)
            publisher = start(["-m", "bench.publisher", target.url, "--rate", str(rate),
                               "--messages", str(messages)], capture=True)
            until(lambda: publisher.poll() is not None and done(), child, 600)
            said = publisher.communicate()[0].split()
        finally:
            stop(child)
            if store is not None:
                store.close()
        samples = latency.read(str(folder))
    achieved = float(said[-1].removesuffix("/s")) if said else None
    return {**percentiles(samples), "rate": rate, "messages": messages,
            "achieved_rate": achieved}


async def _unpause(run: NatsTargetRun) -> None:
    subject = api.consumer_pause(nats_side.NAMES.stream, nats_side.NAMES.consumer)
    await nats_side._api(run.control.nc, subject, {})


def _redis_done(target: RedisTarget, messages: int):
    probe = redis_side.Probe(redis.Redis.from_url(target.url))
    return lambda: probe.get_int(KEYS.stat("success")) >= messages


def _nats_done(run: NatsTargetRun):
    return lambda: nats_side.stored_messages(run.target) == 0


# -- peers -------------------------------------------------------------------------------------


def peer_redis(target: RedisTarget, system: str, module: str, messages: int, extra: list[str],
               fill: Callable[[], list[tuple[str, str]]],
               done: Callable[[redis_side.Probe], bool], env: dict[str, str] | None = None,
               ) -> dict[str, Any]:
    """A peer worker process on Redis: it prints "ready" once it waits on the empty queue;
    ``fill()`` stores the messages under staging names and returns the RENAMEs that make
    them available; ``done(probe)`` says when all are acknowledged."""
    client = target.client
    client.flushdb()
    renames = fill()
    child = start(["-m", module, target.url, "--messages", str(messages), *extra], capture=True,
                  **(env or {}))
    try:
        wait_for_line(child, "ready")
        time.sleep(SETTLE_AFTER_START)
        family = Family(child.pid)
        probe = redis_side.Probe(redis.Redis.from_url(target.url))
        redis_side.reset(client)
        before, cpu_before = redis_side.snapshot(client), family.cpu()
        began = time.perf_counter()
        pipe = client.pipeline(transaction=True)
        for source, destination in renames:
            pipe.rename(source, destination)
        pipe.execute()
        until(lambda: done(probe), child, 600)
        seconds = time.perf_counter() - began
        cpu = family.cpu() - cpu_before
        after = redis_side.snapshot(client)
        rss, _ = family.peak_rss()
    finally:
        stop(child)
    server = redis_side.delta(before, after, target.internal, probe)
    result = _figures(messages, seconds, cpu, server)
    result.update(broker="redis", system=system, handler="noop", history=False,
                  rss_supervisor_mib=rss, rss_children_mib=0.0,
                  script_usec_per_call=server["script_usec_per_call"])
    return result


def peer_nats(run: NatsTargetRun, system: str, module: str, messages: int, extra: list[str]
              ) -> dict[str, Any]:
    target = run.target
    run.control.prepare(messages)
    child = start(["-m", module, target.url, "--messages", str(messages + 1), *extra],
                  capture=True)
    try:
        wait_for_line(child, "ready")
        time.sleep(SETTLE_AFTER_START)
        family = Family(child.pid)
        before, cpu_before = nats_side.snapshot(target), family.cpu()
        began = time.perf_counter()
        run.control.resume()
        until(lambda: nats_side.stored_messages(target) == 0, child, 600, NATS_POLL)
        seconds = time.perf_counter() - began
        cpu = family.cpu() - cpu_before
        after = nats_side.snapshot(target)
        rss, _ = family.peak_rss()
    finally:
        stop(child)
    jobs = messages + 1
    server = nats_side.delta(before, after, seconds)
    result = _figures(jobs, seconds, cpu, server)
    result.update(broker="nats", system=system, handler="noop", history=False,
                  batch_fill=_nats_fill(jobs, server), rss_supervisor_mib=rss,
                  rss_children_mib=0.0)
    return result
