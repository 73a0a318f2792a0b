"""The supervisor's core (arbiter, buffer, settler) run in one process, for fast tests.

The real arbiter runs on the real rings with ``broker.memory.MemoryBroker``; only the
handler processes are played by the test: ``InProcessForkServer`` hands out
``PlayedProcess`` objects that read their ring and answer only when the test tells them
to (start the next delivery, finish one, die). Signals the arbiter sends reach them, never
a real process. The handler processes themselves are tested for real elsewhere
(tests/test_worker.py, tests/test_process_model.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections import deque
from collections.abc import Callable

from broker.failure import Failure
from broker.memory import MemoryBroker
from supervisor.arbiter import Arbiter
from supervisor.buffer import Buffer, State
from supervisor.config import Config, loads
from supervisor.handlers import HandlerPlace, make_places
from support.waiting import until
from worker import protocol
from worker.forkserver import SERVER_PLACE, Event, Spawner
from worker.ring import fence

FIRST_PID = 4_000_000_000  # above any real pid (pid_max is at most 2**22)


class PlayedProcess:
    """A handler process whose every step is the test's decision."""

    def __init__(self, server: InProcessForkServer, place: HandlerPlace, pid: int) -> None:
        self.server, self.place, self.pid = server, place, pid
        self.inbox: deque[tuple[int, int]] = deque()  # (delivery id, number): read, not started
        self.received = 0  # DELIVER records read: the number of the last one
        self.withdrawn: list[int] = []  # delivery ids it found taken back, in order
        self.reached: tuple[int, int] | None = None  # marked, its cut not read yet (``reach``)
        self.plain: dict[int, bool] = {}  # each delivery read: flagged plain?
        self.running: list[int] = []  # started, in order
        self.confirmed: list[tuple[int, bool]] = []
        self.exit_asked = False
        self.posted: list[str] = []  # kinds of the records it wrote, in order
        self.alive = True
        place.to_parent.put(protocol.encode_ready())

    def read(self) -> None:
        while records := self.place.to_child.get_many(256):
            for record in records:
                kind, delivery_id, data = protocol.decode(record)
                if kind == protocol.DELIVER:
                    self.received += 1
                    self.inbox.append((delivery_id, self.received))
                    self.plain[delivery_id] = protocol.deliver_plain(record)
                elif kind == protocol.CONFIRM:
                    self.confirmed.append((delivery_id, bool(data)))
                elif kind == protocol.EXIT:
                    self.exit_asked = True

    def start_next(self) -> bool:
        """Take the next delivery from the ring: started, withdrawn (the supervisor took it
        back), or skipped once a stop began (``reach`` then ``decide``)."""
        return self.reach() and self.decide()

    def reach(self) -> bool:
        """The first half of taking the next delivery, as worker.base does it: mark it
        reached (the cut is read in ``decide``: a take-back may come between)."""
        self.read()
        if not self.alive or not self.inbox:
            return False
        if self.reached is None:
            self.reached = self.inbox.popleft()
            self.place.to_parent.mark(self.reached[1])
        return True

    def decide(self) -> bool:
        """The second half: read the cut, then start, withdraw or skip what was reached."""
        if not self.alive or self.reached is None:
            return False
        (delivery_id, number), self.reached = self.reached, None
        fence()
        if number < self.place.to_child.marked:
            self.withdrawn.append(delivery_id)
            self.post(protocol.encode_withdrawn(delivery_id, number))
        elif self.place.to_child.stop_requested:
            self.post(protocol.encode_skipped(delivery_id))
        else:
            elsewhere = [process.place.index for process in self.server.living()
                         if delivery_id in process.running]
            assert not elsewhere, f"delivery {delivery_id} runs in handler {elsewhere} too"
            self.running.append(delivery_id)
            if self.server.concurrent:
                self.post(protocol.encode_started(delivery_id))
        return True

    def finish(self, ok: bool = True, which: int = 0, seconds: float = 0.0) -> bool:
        """The ``which``-th running delivery (oldest first) returns (after ``seconds``, as
        its DONE says) or raises."""
        if not self.alive or not self.running:
            return False
        delivery_id = self.running.pop(which % len(self.running))
        self.post(protocol.encode_done(delivery_id, seconds) if ok
                  else protocol.encode_failed(delivery_id,
                                                Failure("RuntimeError", "handler raised (played)")))
        return True

    def hold(self, which: int = 0) -> bool:
        """An async handler returned the ``which``-th running delivery to its event loop
        (it waits for ``flush()``): the process reports HELD."""
        if not self.alive or not self.running:
            return False
        self.post(protocol.encode_held(self.running[which % len(self.running)]))
        return True

    def exit_if_asked(self) -> bool:
        """Read the ring as the real loop does: skipped work first, then a requested exit."""
        self.read()
        while self.place.to_child.stop_requested and self.start_next():
            pass
        if (self.alive and self.exit_asked and not self.inbox and not self.running
                and self.reached is None):
            self.die(0)
            return True
        return False

    def work(self, ok: Callable[[int], bool] = lambda delivery_id: True) -> int:
        """Run everything in the ring to the end (a healthy, fast handler); returns how many."""
        done = 0
        while self.alive:
            running = len(self.running)
            if not self.start_next():
                break
            if len(self.running) > running:  # it started one (not skipped nor withdrawn)
                self.finish(ok(self.running[-1]), which=-1)
                done += 1
        self.exit_if_asked()
        return done

    def die(self, status: int) -> None:
        if self.alive:
            self.alive = False
            self.server.post(Event("exited", self.place.index, self.pid, status))

    def post(self, record: bytes) -> None:
        self.posted.append(protocol.KIND_NAMES[protocol.decode(record)[0]])
        if not self.place.to_parent.put(record):
            raise AssertionError(f"outcome ring of handler {self.place.index} full")


class InProcessForkServer:
    """Stands where ``worker.forkserver.ForkServer`` does (a ``Spawner``); its children are
    played."""

    def __init__(self, places: list[HandlerPlace]) -> None:
        self.places = places
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self._events: list[Event] = []
        self._next_pid = FIRST_PID
        self.processes: dict[int, PlayedProcess] = {}  # place index -> current process
        self.spawned = 0
        self.concurrent = False  # async handlers report STARTED; plain ones only mark it
        # Reloads: the test ends each import it asked for (``loaded``, ``load_failed``).
        self.generation = 1
        self.loads: list[int] = []  # generations asked for, in order
        self.adopted: list[int] = []
        self.discarded: list[int] = []
        self.generation_of: dict[int, int] = {}  # pid -> the generation that forked it
        for place in places:
            place.send_signal = self.signal

    @property
    def events_fd(self) -> int:
        return self._read

    def spawn(self, index: int) -> None:
        self._next_pid += 1
        self.spawned += 1
        process = PlayedProcess(self, self.places[index], self._next_pid)
        self.processes[index] = process
        self.generation_of[process.pid] = self.generation
        self.post(Event("started", index, process.pid, generation=self.generation))

    def reload(self) -> int:
        self.loads.append(max([self.generation, *self.loads]) + 1)
        return self.loads[-1]

    def loaded(self, generation: int, report: str) -> None:
        self.post(Event("loaded", SERVER_PLACE, 0, generation=generation, detail=report))

    def load_failed(self, generation: int, why: str) -> None:
        self.post(Event("load_failed", SERVER_PLACE, 0, generation=generation, detail=why))

    def adopt(self, generation: int) -> None:
        self.generation = generation
        self.adopted.append(generation)

    def discard(self, generation: int) -> None:
        self.discarded.append(generation)

    def signal(self, pid: int, sig: int) -> None:
        for process in self.processes.values():
            if process.pid == pid and process.alive:
                process.die(-sig)
                return
        raise ProcessLookupError(pid)

    def post(self, event: Event) -> None:
        self._events.append(event)
        os.write(self._write, b"e")

    def read_events(self) -> list[Event]:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)
        events, self._events = self._events, []
        return events

    def living(self) -> list[PlayedProcess]:
        return [process for process in self.processes.values() if process.alive]

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


async def completed_buffer(broker: MemoryBroker, count: int, failed: int = -1) -> Buffer:
    """``count`` jobs published, received and completed in a buffer of one handler: a
    success each, but the ``failed``-th (0-based; -1: none), which failed."""
    await broker.publish_many("jobs", [{"n": n} for n in range(count)])
    received = await broker.receive(count, 0.01)
    buffer = Buffer(prefetch=count, handlers=1)
    buffer.add(received.deliveries)
    buffer.queue(0, count)
    for queued in buffer.in_state(State.QUEUED, 0):
        buffer.started(0, queued.id)
        buffer.finished(0, queued.id, "boom" if queued.id == failed + 1 else None)
    return buffer


def core_config(
    prefetch: int = 10,
    coroutines: int = 2,
    shutdown_deadline: float = 2.0,
    handler: str = "tests.handlers.noop:handle",
    **job: object,
) -> Config:
    settings = "".join(f"{name} = {value!r}\n".replace("'", '"') for name, value in job.items())
    return loads(
        f"""
[broker]
url = "redis://127.0.0.1:1"
block_timeout = 0.05
[job]
queue = "jobs"
handler = "{handler}"
prefetch = {prefetch}
coroutines = {coroutines}
{settings}
[supervisor]
shutdown_deadline = {shutdown_deadline}
maintenance_interval = 0.2
lease = 3
progress_interval = 0
ring_slots = 1024
ring_slot_size = 1024
""",
        environ={},
    )


class Core:
    """An arbiter with a memory broker and played handler processes, on the running loop."""

    def __init__(self, config: Config, broker: MemoryBroker) -> None:
        self.config, self.broker = config, broker
        self.places = make_places(config.job.coroutines, config.supervisor.ring_slots,
                                  config.supervisor.ring_slot_size)
        self.server = InProcessForkServer(self.places)
        spawner: Spawner = self.server  # the arbiter's view of it, checked by mypy
        # The config's handler, as the supervisor's, without on_success: the played
        # processes answer no confirmations.
        assert config.handler is not None
        handler = dataclasses.replace(config.handler, on_success=None)
        self.server.concurrent = handler.is_async
        self.arbiter = Arbiter(config, broker, self.places, spawner, handler)
        #: The dispatcher's clock, still unless the test moves it (``advance``): a played
        #: process is stalled only when the test says so.
        self.now = 1000.0
        self.arbiter.dispatcher.clock = lambda: self.now
        self.run: asyncio.Task[int] | None = None

    def advance(self, seconds: float) -> None:
        """The dispatcher's clock moves on; the next dispatch looks at the processes anew."""
        self.now += seconds
        self.arbiter.dispatch()

    async def start(self) -> None:
        self.run = asyncio.create_task(self.arbiter.run())
        await self.settle_down()

    async def settle_down(self, turns: int = 20) -> None:
        """Let the loop run its callbacks (readers, settlement) a few turns."""
        for _ in range(turns):
            await asyncio.sleep(0)

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds (up to 5 s: a tighter bound is the caller's
        ``asyncio.timeout``), checked every millisecond as the loop runs the core."""
        await until(condition, 5.0, "the core's state", every=0.001)

    def process(self, index: int) -> PlayedProcess:
        return self.server.processes[index]

    async def stop(self, work: bool = True) -> int:
        """SIGTERM, then (with ``work``) let the handlers finish what they have; the exit code
        (a stop not over within 15 s fails the test)."""
        assert self.run is not None
        self.arbiter.handle_stop_signal(signal.SIGTERM)
        async with asyncio.timeout(15.0):
            while not self.run.done():
                if work:
                    for process in self.server.living():
                        process.work()
                else:
                    for process in self.server.living():
                        process.exit_if_asked()
                await asyncio.sleep(0.001)
        self.server.close()
        return self.run.result()
