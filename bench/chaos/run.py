"""One soak run against one broker: publish, inject faults, wait for recovery, check.

Timeline (seconds from the start, S = ``--seconds``):

- supervisors are started (``python -m supervisor``, the chaos handler) before 0;
- 0 .. 0.8 S: the N messages are published at a steady rate (the queue stays shallow, so a
  fault's recovery is measured, not a backlog);
- 2 .. S: faults at seeded moments (gaps drawn from ``--gap``), the kinds cycling through
  a seeded shuffle so that each kind comes up once before any comes up again;
- then: wait until every message is handled or failed for good and the broker holds
  nothing (that is maintenance's and the lease's work), SIGTERM the supervisors, read
  the broker, the ledger and the usage database (embedded ClickHouse or SQLite), and check.

Per fault, "recovery" is the time from the fault until the last handler call of any
message published before it: for a fault that lost deliveries, the time until they reached
a handler again (lease expiry, maintenance or redelivery), see ``Ledger.recoveries``. On
Redis, for a supervisor killed or stopped, "released" is the time until the broker held
nothing for its consumer id any more (no owned processing entry, no reserved payload).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import math
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.chaos.sides import Check, RedisSide
from bench.chaos.usage_db import NAMES, UsageReader
from support import processes
from support.soak_ledger import Ledger
from support.soak_workload import ENVELOPE_LIMIT, FLAKY, FLAKY_FAIL, INVALID, SLOW, generate
from support.supervision import Supervisor, write_config

QUEUE = "chaos"
HANDLER = "bench.chaos.handler:handle"
ASYNC_HANDLER = "bench.chaos.handler_async:handle"  # with Settings.tasks_per_process
SETTLE_ROUND = 5.0  # the supervisor's last settlement round at stop (supervisor.arbiter)
CAUSE_SLACK = 0.25  # seconds a fault may strike after the moment recorded for it
PROCESS_FAULTS = ("handler_kill", "supervisor_kill", "supervisor_term")
#: With the embedded ClickHouse store: SIGKILL of the writer process that holds the engine.
STORE_FAULTS = {"clickhouse": ("writer_kill",), "sqlite": ()}


@dataclass(slots=True)
class Settings:
    broker: str
    messages: int
    seconds: float
    seed: int
    supervisors: int = 2
    coroutines: int = 2
    tasks_per_process: int = 0  # above 0: the async handler, this many deliveries at once
    prefetch: int = 50
    lease: float = 3.0
    maintenance_interval: float = 1.0
    shutdown_deadline: float = 2.0
    block_timeout: float = 1.0
    max_attempts: int = 10
    gap: tuple[float, float] = (4.0, 8.0)
    publish_share: float = 0.8
    drain_timeout: float = 60.0
    work_ms: float = 5.0  # a handler call takes this long (sleep) besides its own work
    store: str = "clickhouse"  # the stats-usage store: the embedded engine, or "sqlite"
    handler: str = HANDLER
    faults: tuple[str, ...] = ()  # only these kinds (empty: every kind)
    nats_cluster: bool = False  # NATS: three servers, 3 replicas, the "failover" fault
    log_level: str = "warning"  # the supervisors' (their logs are kept with a failed run)
    sabotage: bool = False  # self-test: drop one message unpublished, corrupt one total
    keep: bool = False
    quiet: bool = False

    @property
    def stop_bound(self) -> float:
        """The longest a SIGTERM may take: receive in flight, deadline, settle round."""
        return max(self.block_timeout + 1, self.shutdown_deadline) + SETTLE_ROUND + 3


@dataclass(slots=True)
class Fault:
    kind: str
    at: float  # unix time
    detail: str = ""
    recovery: float | None = None
    released: float | None = None  # Redis, stopped supervisors: until nothing is theirs
    overlapped: bool = False


@dataclass(slots=True)
class Outcome:
    ok: bool
    report: str


def make_side(broker: str, nats_cluster: bool = False) -> Any:
    if broker == "redis":
        return RedisSide(QUEUE)
    if broker == "redis-cluster":
        from bench.chaos.cluster_side import RedisClusterSide

        return RedisClusterSide(QUEUE)
    if broker == "nats":
        from bench.chaos.nats_side import NatsSide

        return NatsSide(QUEUE, cluster=nats_cluster)
    raise ValueError(f"unknown broker {broker!r}")


class Fleet:
    """The running supervisors, their replacements, and what went wrong with them."""

    def __init__(self, settings: Settings, config: Path, workdir: Path, url: str,
                 env: dict[str, str]) -> None:
        self.settings = settings
        self.config = config
        self.workdir = workdir
        self.url = url
        self.env = env
        self.members: list[Supervisor] = []
        self.everyone: list[Supervisor] = []
        self.problems: list[str] = []
        self.stops: list[float] = []  # durations of graceful stops
        self.unreachable = 0  # supervisors that exited 1 at start: the broker was down
        self.pending: set[asyncio.Task] = set()

    def start_one(self) -> Supervisor:
        supervisor = Supervisor(self.config, self.workdir, self.url, **self.env)
        self.members.append(supervisor)
        self.everyone.append(supervisor)
        return supervisor

    async def wait_consuming(
            self, timeout: float = 30.0,  # noqa: ASYNC109 - a late one fails showing its output
    ) -> None:
        deadline = time.monotonic() + timeout
        for supervisor in list(self.members):
            while not running(supervisor):
                exited = supervisor.process.poll() is not None
                late = time.monotonic() > deadline
                if exited and not late and self._unreachable(supervisor):
                    # Exit 1, its documented answer (e.g. a JetStream cluster still creating
                    # the replicated streams another supervisor asked for): as systemd would.
                    self.members.remove(supervisor)
                    supervisor = self.start_one()
                    continue
                if exited or late:
                    raise RuntimeError("a supervisor did not start:\n" + supervisor.output())
                await asyncio.sleep(0.1)

    def _unreachable(self, supervisor: Supervisor) -> bool:
        if supervisor.process.returncode == 1 and "cannot connect to the broker" in (
                supervisor.output()):
            self.unreachable += 1
            return True
        return False

    def watch(self) -> None:
        """A member that exited without being told to is a finding; it is replaced."""
        for supervisor in list(self.members):
            code = supervisor.process.poll()
            if code is not None:
                self.members.remove(supervisor)
                output = supervisor.output()
                # Started while the broker restarted: exit 1 is its documented answer.
                if not self._unreachable(supervisor):
                    tail = output.strip().splitlines()[-5:]
                    self.problems.append(
                        f"supervisor {supervisor.pid} exited on its own with code {code}: "
                        + " | ".join(tail)
                    )
                self.start_one()

    def spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    # -- process faults ------------------------------------------------------------------

    def kill_handler(self, rng: random.Random) -> str:
        candidates = []
        for supervisor in self.members:
            for process in handlers(supervisor):
                with contextlib.suppress(psutil.Error):
                    busy = "busy" in " ".join(process.cmdline())
                    candidates.append((busy, supervisor, process))
        busy = [c for c in candidates if c[0]]
        if not candidates:
            return "skipped: no handler process"
        _, supervisor, process = rng.choice(busy or candidates)
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
        state = "busy" if busy else "idle"
        return f"SIGKILL {state} handler {process.pid} of supervisor {supervisor.pid}"

    def pick(self, rng: random.Random, consuming: bool = False) -> Supervisor | None:
        """A member at random; ``consuming``: only one whose loop runs (a SIGTERM before
        the supervisor installed its handlers ends it by the default action, -15)."""
        members = [m for m in self.members if running(m)] if consuming else self.members
        return rng.choice(members) if members else None

    def kill_supervisor(self, victim: Supervisor) -> str:
        family = victim.family()[1:]
        victim.process.kill()
        victim.wait(10)
        self.members.remove(victim)
        self.start_one()
        self.spawn(self._no_survivors(victim.pid, family))
        return f"SIGKILL supervisor {victim.pid} ({len(family)} children), replacement started"

    async def _no_survivors(self, pid: int, family: list[psutil.Process]) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            alive = [p for p in family if _alive(p)]
            if not alive:
                return
            await asyncio.sleep(0.1)
        self.problems.append(
            f"processes {[p.pid for p in alive]} survived the SIGKILL of supervisor {pid} by 5 s"
        )
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()

    def term_supervisor(self, victim: Supervisor) -> str:
        self.members.remove(victim)
        victim.signal(signal.SIGTERM)
        self.spawn(self._stopped_then_replaced(victim))
        return f"SIGTERM supervisor {victim.pid} (deadline {self.settings.shutdown_deadline}s)"

    async def _stopped_then_replaced(self, victim: Supervisor) -> None:
        began = time.monotonic()
        bound = self.settings.stop_bound
        code = await asyncio.to_thread(_wait_quietly, victim, bound)
        took = time.monotonic() - began
        self.stops.append(took)
        if code is None:
            self.problems.append(f"supervisor {victim.pid} still running {bound:.0f}s "
                                 "after SIGTERM")
            victim.stop()
        elif code != 0:
            self.problems.append(f"supervisor {victim.pid} exited {code} after SIGTERM")
        self.start_one()

    async def stop_all(self) -> None:
        """SIGTERM every member; each must exit 0 within the stop bound."""
        for task in list(self.pending):
            await task
        # A supervisor still starting would die of the signal's default action (-15).
        await self.wait_consuming()
        stopping = list(self.members)
        self.members.clear()
        for supervisor in stopping:
            supervisor.signal(signal.SIGTERM)
        codes = await asyncio.gather(*(
            asyncio.to_thread(_wait_quietly, s, self.settings.stop_bound) for s in stopping
        ))
        for supervisor, code in zip(stopping, codes, strict=True):
            if code != 0:
                self.problems.append(f"final stop of supervisor {supervisor.pid}: exit {code}")

    def cleanup(self) -> None:
        for supervisor in self.everyone:
            with contextlib.suppress(Exception):
                supervisor.stop()


def running(supervisor: Supervisor) -> bool:
    """The supervisor's title says "running" once its loop consumes."""
    try:
        return "running" in " ".join(psutil.Process(supervisor.pid).cmdline())
    except psutil.Error:
        return False


def handlers(supervisor: Supervisor) -> list[psutil.Process]:
    """The handler processes of a supervisor, by their titles: not its fork server nor its
    handler servers (a SIGKILL of one of those stops the supervisor, exit 4: that is a
    fault of its own kind), nor the stats-usage writer a handler process may have started."""
    return processes.handlers(supervisor.pid, QUEUE)


def kill_writer(db: Path) -> str:
    """SIGKILL the process that holds the embedded engine (whoever started it)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "examples.usage.writer" in cmdline and str(db) in cmdline:
            with contextlib.suppress(psutil.Error):
                process.kill()
                return f"SIGKILL writer {process.pid} (parent {process.ppid()})"
    return "skipped: no writer running"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_quietly(supervisor: Supervisor, timeout: float) -> int | None:
    try:
        return supervisor.wait(timeout)
    except Exception:
        return None


class Soak:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.side = make_side(settings.broker, settings.nats_cluster)
        self.messages = generate(QUEUE, settings.messages, settings.seed)
        self.rng = random.Random(f"faults:{settings.seed}")
        self.workdir = Path(tempfile.mkdtemp(prefix=f"chaos-{settings.broker}-"))
        self.db = self.workdir / NAMES[settings.store]
        self.usage = UsageReader(self.db)
        self.ledger = Ledger(self.workdir / "ledger")
        self.published_at: dict[int, float] = {}  # message index -> unix time
        self.uncertain: list[int] = []  # indices whose publish reply was lost
        self.faults: list[Fault] = []
        self.missing: set[str] = set()  # countable pids acknowledged and never counted
        self.fleet: Fleet | None = None
        self.began = 0.0
        self.published = asyncio.Event()  # set (and replaced) after each burst
        self.publishing_done = False

    def log(self, text: str) -> None:
        if not self.settings.quiet:
            elapsed = time.time() - self.began if self.began else 0.0
            print(f"[{self.settings.broker} {elapsed:6.1f}s] {text}", file=sys.stderr, flush=True)

    async def run(self) -> Outcome:
        s = self.settings
        await self.side.start()
        try:
            sections: dict[str, dict[str, Any]] = {
                "broker": {"block_timeout": s.block_timeout},
                "job": {"queue": QUEUE, "coroutines": s.coroutines, "prefetch": s.prefetch,
                        "max_attempts": s.max_attempts},
                "supervisor": {"lease": s.lease, "maintenance_interval": s.maintenance_interval,
                               "max_envelope_bytes": ENVELOPE_LIMIT,  # oversized: parked
                               "shutdown_deadline": s.shutdown_deadline,
                               "log_level": s.log_level},
            }
            for name, values in self.side.config_sections(s).items():
                sections.setdefault(name, {}).update(values)
            handler = s.handler
            if s.tasks_per_process:
                handler = ASYNC_HANDLER
                sections["job"]["tasks_per_process"] = s.tasks_per_process
                sections["job"]["prefetch"] = max(s.prefetch, s.coroutines * s.tasks_per_process)
            config = write_config(self.workdir, self.side.supervisor_url, handler=handler,
                                  **sections)
            env = {"STATS_USAGE_DB": str(self.db), "CHAOS_LEDGER": str(self.ledger.path),
                   "CHAOS_SEED": str(s.seed), "CHAOS_WORK_MS": str(s.work_ms)}
            self.fleet = Fleet(s, config, self.workdir, self.side.supervisor_url, env)
            for _ in range(s.supervisors):
                self.fleet.start_one()
            await self.fleet.wait_consuming()
            await self.side.ready()
            self.began = time.time()
            self.log(f"{len(self.messages)} messages, {s.supervisors} supervisors, seed {s.seed}")
            await asyncio.gather(self.publish(), self.inject(), self.watch(s.seconds))
            drained = await self.drain()
            await self.fleet.stop_all()
            if s.sabotage:
                self.usage.corrupt_one_total()
            return await self.check(drained)
        finally:
            if self.fleet is not None:
                self.fleet.cleanup()
            self.usage.close()
            await self.side.close()

    async def publish(self) -> None:
        """N messages at a steady rate, in bursts that fill every supervisor's prefetch."""
        s = self.settings
        count = len(self.messages)
        rate = count / max(s.seconds * s.publish_share, 0.1)
        size = max(math.ceil(rate), s.supervisors * s.prefetch * 3 // 2)
        lost = next((i for i, m in enumerate(self.messages) if m.countable), -1)
        for burst, start in enumerate(range(0, count, size)):
            await asyncio.sleep(max(0.0, self.began + burst * size / rate - time.time()))
            for chunk in range(start, min(count, start + size), 1000):
                batch = list(range(chunk, min(count, start + size, chunk + 1000)))
                if s.sabotage and chunk == 0:  # "published", but the broker never sees it
                    batch = [i for i in batch if self.messages[i].pid is None or i != lost]
                    self.log(f"sabotage: message {lost} ({self.messages[lost].pid}) dropped")
                try:
                    await self.side.publish([self.messages[i] for i in batch])
                except Exception as error:  # reply lost: published or not, we cannot tell
                    self.log(f"publish of {len(batch)} messages uncertain: {error!r}")
                    self.uncertain += batch
                now = time.time()
                if s.sabotage and chunk == 0:
                    batch.append(lost)
                for index in batch:
                    self.published_at[index] = now
            published, self.published = self.published, asyncio.Event()
            published.set()
        self.publishing_done = True
        self.log(f"published {count} messages in bursts of {size}")

    async def inject(self) -> None:
        """Faults at seeded moments: after each gap, a seeded instant just after the next
        burst (while the supervisors hold work), or at once when publishing has ended."""
        s = self.settings
        kinds = list(PROCESS_FAULTS) + list(STORE_FAULTS[s.store]) + list(self.side.faults)
        if s.faults:
            kinds = [kind for kind in kinds if kind in s.faults]
        if not kinds:  # e.g. --faults connection_cut, which only NATS has, on Redis
            self.log("no fault of the kinds asked for applies to this broker")
            return
        cycle: list[str] = []
        at = 2.0 + self.rng.uniform(*s.gap) / 2
        while at < s.seconds:
            await asyncio.sleep(max(0.0, self.began + at - time.time()))
            pause = self.rng.uniform(0.0, 0.25)
            if not self.publishing_done:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.published.wait(), s.gap[1])
                await asyncio.sleep(pause)
            if not cycle:
                cycle = self.rng.sample(kinds, len(kinds))
            kind = cycle.pop()
            fault = Fault(kind, time.time())
            fault.detail = await self.apply(fault)
            self.faults.append(fault)
            self.log(f"fault {kind}: {fault.detail}")
            at = max(at + self.rng.uniform(*s.gap), time.time() - self.began + s.gap[0] / 2)

    async def apply(self, fault: Fault) -> str:
        assert self.fleet is not None
        kind = fault.kind
        try:
            if kind == "handler_kill":
                return self.fleet.kill_handler(self.rng)
            if kind == "writer_kill":
                return kill_writer(self.db)
            if kind in ("supervisor_kill", "supervisor_term"):
                victim = self.fleet.pick(self.rng, consuming=kind == "supervisor_term")
                if victim is None:
                    return "skipped: no supervisor running"
                consumer = await self.side.consumer_of(victim.pid)
                if kind == "supervisor_kill":
                    detail = self.fleet.kill_supervisor(victim)
                else:
                    detail = self.fleet.term_supervisor(victim)
                if consumer is not None:
                    self.fleet.spawn(self.track_release(fault, consumer))
                return detail
            return await self.side.inject(kind)
        except Exception as error:
            self.fleet.problems.append(f"fault {kind} could not be injected: {error!r}")
            return f"failed: {error!r}"

    async def track_release(self, fault: Fault, consumer: str) -> None:
        """Until the broker holds nothing for the stopped supervisor's consumer id: its
        deliveries were recovered (or released) for other consumers to take."""
        deadline = time.time() + 60
        while time.time() < deadline:
            with contextlib.suppress(Exception):  # a restart of the server meanwhile
                if not await self.side.held_by(consumer):
                    fault.released = time.time() - fault.at
                    return
            await asyncio.sleep(0.05)

    async def watch(self, seconds: float) -> None:
        assert self.fleet is not None
        end = self.began + seconds
        last = 0.0
        while time.time() < end:
            self.fleet.watch()
            if time.time() - last >= 10:
                last = time.time()
                self.ledger.update()
                self.log(f"{len(self.published_at)} published, {len(self.ledger.commits)} "
                         f"flushed, {len(self.faults)} faults")
            await asyncio.sleep(0.2)

    async def drain(self) -> float:
        """Wait until every message is handled or failed for good and nothing is held."""
        assert self.fleet is not None
        began = time.monotonic()
        deadline = began + self.settings.drain_timeout
        pids = {m.pid for m in self.messages if m.pid is not None}
        while time.monotonic() < deadline:
            self.fleet.watch()
            counts = await self.side.outstanding()
            if not any(counts.values()):
                done = self.usage.seen() | await self.side.failed_now()
                if pids <= done:
                    took = time.monotonic() - began
                    self.log(f"drained {took:.1f}s after the last fault window")
                    return took
            await asyncio.sleep(0.25)
        self.log(f"not drained after {self.settings.drain_timeout}s: {counts}")
        return float("nan")

    # -- checking -------------------------------------------------------------------------

    async def check(self, drained: float) -> Outcome:
        s = self.settings
        assert self.fleet is not None
        self.ledger.update()
        final = await self.side.final_state(self.messages, s.max_attempts)
        seen = self.usage.seen()
        failed = final.failed_pids
        countable = {m.pid: m for m in self.messages if m.countable}
        invalid = {m.pid for m in self.messages if m.kind == INVALID}
        uncertain = {self.messages[i].pid for i in self.uncertain}
        lost = sorted(set(countable) - seen - failed - uncertain)
        lost += sorted(invalid - failed - uncertain)
        failed_countable = (set(countable) & failed) - seen
        unexpected_failed = [p for p in failed_countable if countable[p].kind != FLAKY]
        strangers = seen - set(countable)
        expected = totals_of(countable[pid] for pid in seen & set(countable))
        published = totals_of(countable.values())
        actual = self.usage.totals()
        wrong = sorted(key for key in set(expected) | set(actual)
                       if expected.get(key, 0) != actual.get(key, 0))
        valid_count = len(countable) + len(invalid)
        flaky = sum(1 for m in countable.values() if m.kind == FLAKY)
        # Each flaky message fails every attempt with this chance: more is a finding.
        allowed = 2 + math.ceil(10 * flaky * FLAKY_FAIL ** s.max_attempts)
        checks = [
            Check("messages published (valid envelopes)", valid_count,
                  valid_count - len(uncertain), not uncertain,
                  f"{len(uncertain)} uncertain" if uncertain else ""),
            Check("countable handled (seen) or failed for good", len(countable),
                  len(set(countable) & (seen | failed)), not lost),
            Check("invalid payloads in failed/dead, not counted", len(invalid),
                  len(invalid & failed), invalid <= failed and not invalid & seen),
            Check("pids in seen that must not be counted", 0, len(strangers), not strangers),
            Check("countable failed max_attempts times (flaky)", f"<= {allowed}",
                  len(failed_countable), not unexpected_failed
                  and len(failed_countable) <= allowed,
                  f"{len(unexpected_failed)} not flaky" if unexpected_failed else
                  f"chance {FLAKY_FAIL}^{s.max_attempts} each: do handlers see attempts "
                  "rise?" if len(failed_countable) > allowed else ""),
            Check("counted, then failed for good", "rare", len(seen & failed), True,
                  "flushed, commit lost, then failed on redelivery" if seen & failed else ""),
            Check("usage totals = sum over seen pids", len(expected), len(actual),
                  not wrong, f"{len(wrong)} totals differ" if wrong else "exact"),
            *final.checks,
            Check("supervisor problems", 0, len(self.fleet.problems), not self.fleet.problems),
        ]
        ok = all(check.ok for check in checks)
        missing = set(countable) - seen - failed - uncertain
        self.missing = missing
        report = self.report(checks, published, expected, actual, failed_countable, drained,
                             len(missing), len(countable))
        details = []
        for pid in lost[:20]:
            index = next(i for i, m in enumerate(self.messages) if m.pid == pid)
            details.append(
                f"LOST {pid} (message {index}, published at "
                f"{self.published_at.get(index, 0):.3f}): ledger: {self.ledger.last_seen(pid)}; "
                f"broker: {await self.side.locate(pid)}"
            )
        details += [f"TOTAL {key}: expected {expected.get(key, 0)}, database "
                    f"{actual.get(key, 0)}" for key in wrong[:20]]
        details += [f"PROBLEM {problem}" for problem in self.fleet.problems]
        if not ok or s.keep:
            self.save_timeline()
            details.append(f"kept: logs, ledger, timeline and database in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        verdict = "PASS" if ok else "FAIL"
        return Outcome(ok, "\n".join([report, *details, f"result ({s.broker}): {verdict}"]))

    def save_timeline(self) -> None:
        """timeline.json: the faults and when each message was published (unix times)."""
        timeline = {
            "began": self.began,
            "faults": [{"kind": f.kind, "at": f.at, "detail": f.detail,
                        "recovery": f.recovery, "released": f.released} for f in self.faults],
            "published": {m.pid or f"malformed-{n}": self.published_at.get(n)
                          for n, m in enumerate(self.messages)},
            "kinds": {m.pid: m.kind for m in self.messages if m.pid},
        }
        (self.workdir / "timeline.json").write_text(json.dumps(timeline))

    def report(self, checks: list[Check], published: Counter, expected: Counter,
               actual: dict, failed_countable: set[str], drained: float, missing: int,
               countable: int) -> str:
        s = self.settings
        kinds = Counter(m.kind for m in self.messages)
        lines = [
            f"== chaos soak: {s.broker}, {len(self.messages)} messages "
            f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), {s.seconds:.0f}s, "
            f"seed {s.seed}, {s.supervisors} supervisors x {s.coroutines} handlers"
            f"{f' x {s.tasks_per_process} async tasks' if s.tasks_per_process else ''}, "
            f"prefetch {s.prefetch}, lease {s.lease}s, maintenance {s.maintenance_interval}s, "
            f"max_attempts {s.max_attempts}",
            f"{'check':<46} {'expected':>10} {'actual':>10}  ok",
        ]
        for check in checks:
            mark = "ok" if check.ok else "FAIL"
            note = f"  ({check.note})" if check.note else ""
            lines.append(f"{check.name:<46} {check.expected!s:>10} {check.actual!s:>10}  "
                         f"{mark}{note}")
        lines.append(f"{'metric':<14} {'published':>14} {'failed (flaky)':>14} "
                     f"{'expected':>14} {'database':>14} {'missing':>14}")
        failed_sums = Counter()
        for message in self.messages:
            if message.pid in failed_countable:
                for metric, value in message.metrics.items():
                    failed_sums[metric] += value
        for metric in sorted({metric for _, metric in published}):
            def total(table: Any, metric: str = metric) -> int:
                return sum(v for (_, m), v in table.items() if m == metric)
            missing_usage = total(published) - failed_sums[metric] - total(actual)
            lines.append(f"{metric:<14} {total(published):>14} {failed_sums[metric]:>14} "
                         f"{total(expected):>14} {total(actual):>14} {missing_usage:>14}")
        # "missing" = published - failed for good - database: usage acknowledged, never counted.
        lines.append(f"lost: {missing} of {countable} countable messages acknowledged and "
                     f"never counted ({100 * missing / max(1, countable):.2f}%)")
        lines += self.fault_table(drained)
        return "\n".join(lines)

    def fault_table(self, drained: float) -> list[str]:
        self.measure_recoveries()
        times = [fault.at for fault in self.faults]

        def attribute(events: list[tuple[float, float, str]]) -> Counter:
            """To the first fault between the lost result and its repetition (a fault is
            recorded just before it is applied: up to CAUSE_SLACK earlier)."""
            counts: Counter = Counter()
            for lost, repeated, _ in events:
                index = bisect.bisect_left(times, lost - CAUSE_SLACK)
                if index < len(times) and times[index] <= repeated:
                    counts[self.faults[index].kind] += 1
                else:
                    counts["(no fault)"] += 1
            return counts

        dups = attribute(self.ledger.duplicate_commits())
        reruns = attribute(self.ledger.reruns())
        lost = self.lost_by_fault(times)
        by_kind: dict[str, list[Fault]] = defaultdict(list)
        for fault in self.faults:
            by_kind[fault.kind].append(fault)
        committed = max(1, len(self.ledger.commits))
        lines = [f"{'fault':<18} {'count':>5} {'dup commits':>11} {'dup/fault':>9} "
                 f"{'re-runs':>7} {'recovery: worst':>15} {'alone':>6} {'mean':>6} "
                 f"{'released: worst':>15} {'lost':>5}"]
        for kind in sorted(set(by_kind) | set(dups) | set(reruns) | set(lost)):
            faults = by_kind.get(kind, [])
            drains = [f.recovery for f in faults if f.recovery is not None]
            worst = max(drains) if drains else 0.0
            mean = sum(drains) / len(drains) if drains else 0.0
            per = dups[kind] / len(faults) if faults else 0.0
            alone = max((f.recovery or 0.0 for f in faults if not f.overlapped), default=0.0)
            released = [f.released for f in faults if f.released is not None]
            shown = f"{max(released):.2f}" if released else "-"
            lines.append(f"{kind:<18} {len(faults):>5} {dups[kind]:>11} {per:>9.2f} "
                         f"{reruns[kind]:>7} {worst:>15.2f} {alone:>6.2f} {mean:>6.2f} "
                         f"{shown:>15} {lost[kind]:>5}")
        total_dups = sum(dups.values())
        lines.append("recovery: until the last message published before the fault reached a "
                     "handler again (alone: not overlapping the next fault); released (Redis): "
                     "until a stopped supervisor's consumer held nothing; lost: messages "
                     "acknowledged and never counted, by the first fault after their last call")
        lines.append(f"duplicate commits: {total_dups} of {committed} messages flushed "
                     f"({100 * total_dups / committed:.2f}%); re-runs {sum(reruns.values())}")
        if self.faults:
            worst = max(self.faults, key=lambda f: f.recovery or 0.0)
            note = " (the next fault came before it recovered)" if worst.overlapped else ""
            lines.append(f"worst fault-to-recovery: {worst.recovery or 0:.2f}s after "
                         f"{worst.kind} at +{worst.at - self.began:.1f}s{note}")
        if self.fleet is not None and self.fleet.stops:
            lines.append(f"graceful stops: {len(self.fleet.stops)}, longest "
                         f"{max(self.fleet.stops):.2f}s (bound {self.settings.stop_bound:.0f}s)")
        if self.fleet is not None and self.fleet.unreachable:
            lines.append(f"supervisors started while the broker was down (exit 1, replaced): "
                         f"{self.fleet.unreachable}")
        lines.append(f"final drain after the fault window: {drained:.1f}s")
        return lines

    def lost_by_fault(self, times: list[float]) -> Counter:
        """Each lost message to the first fault after its last handler call: the one that
        took its uncounted result (the unsafe handler's buffer) with it."""
        counts: Counter = Counter()
        for pid in self.missing:
            calls = self.ledger.calls.get(pid)
            if not calls:
                counts["(never called)"] += 1
                continue
            last = max(call.time for call in calls)
            index = bisect.bisect_left(times, last - CAUSE_SLACK)
            counts[self.faults[index].kind if index < len(times) else "(no fault)"] += 1
        return counts

    def measure_recoveries(self) -> None:
        """See ``Ledger.recoveries``; a recovery that outlasted the gap to the next fault
        is marked overlapped (the next fault may have lengthened it)."""
        published = {m.pid: self.published_at[n] for n, m in enumerate(self.messages)
                     if m.pid is not None and n in self.published_at}
        slow = {m.pid for m in self.messages if m.kind == SLOW and m.pid is not None}
        times = [fault.at for fault in self.faults]
        for n, recovery in enumerate(self.ledger.recoveries(times, published, slow)):
            fault = self.faults[n]
            fault.recovery = recovery
            following = times[n + 1] if n + 1 < len(times) else float("inf")
            fault.overlapped = fault.at + recovery > following


def totals_of(messages: Any) -> Counter:
    totals: Counter = Counter()
    for message in messages:
        for metric, value in message.metrics.items():
            totals[(message.project, metric)] += value
    return totals


async def soak(settings: Settings) -> Outcome:
    return await Soak(settings).run()


def run_all(brokers: list[str], base: Settings) -> int:
    """Run each broker in turn; print each report; 0 only if every run passed."""
    results = []
    for broker in brokers:
        settings = dataclasses.replace(base, broker=broker)
        outcome = asyncio.run(soak(settings))
        print(outcome.report, flush=True)
        results.append(outcome.ok)
    return 0 if all(results) else 1

