"""The stats-usage store on ClickHouse: the embedded engine's one writer process, the
server path through clickhouse-connect, and the job end to end on the default store.

No ClickHouse server runs here (Debian's clickhouse-server is 18.16, which
clickhouse-connect no longer speaks to), so the server path is run through
clickhouse-connect's own chDB backend: the same client calls, without HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import zlib

import psutil
import pytest
from clickhouse_connect.driver.exceptions import ClickHouseError

from examples import stats_usage
from examples.stats_usage import make_payload
from examples.usage import NoTotals, Usage, open_store, wal, wire
from examples.usage.clickhouse import rows_of
from examples.usage.local import WriterError, WriterUnavailable
from examples.usage.writer import Engine
from support import processes
from support.envelopes import publish
from support.supervision import ROOT, counter, python_script, wait_for, write_config


def usage(pid: str, project: str = "p1", period: int = 0, **metrics: int) -> Usage:
    return Usage(pid, project, period, list(metrics.items()))


def writers(path) -> list[psutil.Process]:
    """The writer processes serving ``path``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "examples.usage.writer" in cmdline and str(path) in cmdline:
            found.append(process)
    return found


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "usage.chdb")


def test_rows_are_one_per_message_and_metric():
    rows = rows_of([usage("a", executions=1), usage("a", executions=1),
                    Usage("b", "p2", 3600, [("k", 2), ("k", 3), ("j", -1)])])
    assert rows == (  # JSONCompactEachRow, in COLUMNS order, the rows of a batch on one line
        b'["p1","executions",0,1,"a"],["p2","k",3600,5,"b"],["p2","j",3600,-1,"b"]\n')
    assert rows_of([Usage("c", "p", 0, [])]) == b""


@pytest.mark.slow
def test_batches_of_comma_separated_rows_go_into_the_engine_together(path):
    """The writer joins the batches of a round (and a move) end to end: one line each."""
    store = open_store(path)
    try:
        store.add([usage("w", executions=0)])  # the engine's own insert
        store.database.insert("usage", rows_of([usage("a", executions=1), usage("b", bytes=2)])
                              + rows_of([usage("c", executions=4)]))  # logged, then moved
        assert store.totals() == {("p1", "executions"): 5, ("p1", "bytes"): 2}
    finally:
        store.close()


@pytest.mark.slow
def test_one_writer_serves_every_client_and_stops_with_the_process_that_started_it(path):
    first = open_store(path)
    second = open_store(path)  # finds the first one's writer
    try:
        [writer] = writers(path)
        assert writer.ppid() == os.getpid()
        first.add([usage("a", executions=1)])
        second.add([usage("b", executions=2)])
        first.close()  # its writer stops; the next request of the second starts another
        wait_for(lambda: processes.gone(writer), 10, "the first writer to stop")
        assert second.totals() == {("p1", "executions"): 3}
        assert len(writers(path)) == 1
    finally:
        second.close()
    assert writers(path) == []


@pytest.mark.slow
def test_a_killed_writer_is_replaced_and_nothing_counts_twice(path):
    store = open_store(path)
    try:
        store.add([usage("a", executions=1), usage("b", executions=1)])
        [writer] = writers(path)
        writer.kill()
        # The same messages again (redelivered) and a new one: answered by a new writer.
        store.add([usage("a", executions=1), usage("b", executions=1),
                   usage("c", executions=1)])
        assert store.totals() == {("p1", "executions"): 3}
        assert [w.pid for w in writers(path)] != [writer.pid]
    finally:
        store.close()


@pytest.mark.slow
def test_the_writer_dies_with_the_process_that_started_it(path):
    code = textwrap.dedent(f"""
        import time
        from examples.usage import open_store
        store = open_store({path!r})
        print("ready", flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout.readline() == "ready\n"
        [writer] = writers(path)
        owner.kill()
        owner.wait(10)
        writer.wait(10)  # SIGTERM from the kernel when its parent died, then a clean stop
    finally:
        owner.kill()
    assert writers(path) == []


def test_an_engine_error_fails_at_once(path):
    store = open_store(path)
    try:
        began = time.monotonic()
        with pytest.raises(WriterError, match="UNKNOWN_TABLE"):
            store.database.select("SELECT 1 FROM no_such_table")
        assert time.monotonic() - began < 5
        assert store.totals() == {}  # the connection is still good
    finally:
        store.close()


def test_a_writer_that_cannot_start_fails_the_store_at_once(path, tmp_path, monkeypatch):
    shadow = tmp_path / "shadow" / "chdb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no engine in this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    began = time.monotonic()
    with pytest.raises(WriterUnavailable, match="exited with code 2"):
        open_store(path)
    assert time.monotonic() - began < 30


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_the_writer_answers_only_its_own_user(path):
    store = open_store(path)
    try:
        child = os.fork()
        if child == 0:  # another user: the writer must close the connection unanswered
            code = 1
            try:
                os.setuid(65534)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(10)
                sock.connect(wire.address(path))
                try:
                    sock.sendall(wire.frame(wire.SELECT, b"SELECT 1"))
                    answered = sock.recv(1) != b""
                except (BrokenPipeError, ConnectionResetError):  # closed before or after
                    answered = False                               # our request: refused
                code = 1 if answered else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.totals() == {}
    finally:
        store.close()


NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to run the squatter as another user")


class Squatter:
    """Another local user's process (issue 28, H2), forked from the test as uid 65534
    (no interpreter of this test is readable by that user): it binds the writer's socket
    name first and answers OK to every request, telling the test the kind of each."""

    def __init__(self, address: str) -> None:
        self._reader, writer = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self._reader)
                self._serve(address, writer)
            finally:
                os._exit(1)
        self._running = True
        os.close(writer)
        self._lines = os.fdopen(self._reader, "r")
        assert self._lines.readline() == "listening\n"

    @staticmethod
    def _serve(address: str, out: int) -> None:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(16)
        os.write(out, b"listening\n")
        while True:
            conn, _ = listener.accept()
            with conn:
                reader = wire.FrameReader()
                while data := conn.recv(1 << 16):
                    for kind, _ in reader.feed(data):
                        os.write(out, b"request " + kind + b"\n")
                        conn.sendall(wire.frame(wire.OK, b"[]"))

    def requests(self) -> list[str]:
        """The requests it got (it is stopped first)."""
        self.stop()
        return [line.strip() for line in self._lines]

    def stop(self) -> None:
        if self._running:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._running = False


@pytest.fixture
def squatter(path):
    """The squatter holding the writer's socket name for ``path``."""
    process = Squatter(wire.address(path))
    yield process
    process.stop()


@needs_root
def test_the_client_sends_nothing_to_a_writer_of_another_user(path, squatter):
    began = time.monotonic()
    with pytest.raises(WriterUnavailable) as raised:
        open_store(path)
    message = str(raised.value)
    assert f"pid {squatter.pid} of uid {NOBODY}" in message and "not by this user" in message
    assert time.monotonic() - began < 10  # at once, not after CALL_TIMEOUT
    assert squatter.requests() == []
    assert writers(path) == []


@needs_root
def test_a_writer_that_finds_its_name_held_by_another_user_says_so_and_fails(path, squatter):
    done = subprocess.run([sys.executable, "-m", "examples.usage.writer", path,
                           str(os.getpid())], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    assert f"held by pid {squatter.pid} of uid {NOBODY}" in done.stderr
    assert squatter.requests() == []


@needs_root
def test_a_squatted_writer_name_stops_the_job_before_anything_is_acknowledged(
        redis_url, client, tmp_path, path, squatter, supervisors):
    """The job as the review ran it: with the name squatted, init() fails (exit 3, which
    systemd does not restart), the messages stay ready, the squatter gets no row."""
    config = write_config(tmp_path, redis_url, handler="examples.stats_usage:handle")
    publish(client, [make_payload("p1", {"executions": 1}) for _ in range(20)])
    supervisor = supervisors(config, redis_url, STATS_USAGE_DB=path)
    assert supervisor.wait(60) == 3, supervisor.output()
    assert f"uid {NOBODY}" in supervisor.output()
    from support.supervision import keys

    assert client.llen(keys().ready) == 20
    assert counter(client, "success") == 0
    assert squatter.requests() == []


@pytest.mark.slow
def test_a_name_held_by_a_socket_that_accepts_nothing_fails_the_store_clearly(path):
    """Bound, never listening: connections are refused, so the client starts a writer,
    which finds the name taken and no writer behind it; it says so and exits 3 (before,
    it returned 0 and the client retried for CALL_TIMEOUT)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.bind(wire.address(path))
        began = time.monotonic()
        with pytest.raises(WriterUnavailable, match="exited with code 3"):
            open_store(path)
        assert time.monotonic() - began < 30


def test_totals_per_hour_and_a_redelivery_in_a_later_hour_counts_once(path):
    store = open_store(path)
    try:
        store.add([usage("a", period=0, executions=1), usage("b", period=3600, executions=2)])
        store.add([usage("a", period=7200, executions=1)])  # requeued: a new timestamp
        assert store.totals() == {("p1", "executions"): 3}
        assert sum(store.totals_by_period().values()) == 3
        assert store.seen() == {"a", "b"}
    finally:
        store.close()


def test_reading_a_folder_without_the_table_is_no_totals(path):
    os.makedirs(path)
    with pytest.raises(NoTotals):
        open_store(path, create=False)
    assert writers(path) == []


@pytest.mark.slow
def test_the_server_store_through_clickhouse_connect(tmp_path):
    """ClickHouseStore over a clickhouse-connect client (its chDB backend, in a process of
    its own: the engine stays out of the test process that forks)."""
    code = textwrap.dedent(f"""
        import clickhouse_connect
        from examples.usage import Usage
        from examples.usage.clickhouse import ClickHouseStore, ServerDatabase
        client = clickhouse_connect.get_client(dsn="chdb://{tmp_path}/server.chdb")
        store = ClickHouseStore(ServerDatabase("", client=client))
        store.add([Usage("a", "p1", 0, [("executions", 1), ("executions", 1)]),
                   Usage("b", "p1", 0, [("bandwidth", -5)])])
        store.add([Usage("a", "p1", 3600, [("executions", 2)])])  # redelivered
        print(sorted(store.totals().items()), sorted(store.seen()))
        store.close()
    """)
    done = python_script(code)
    assert done.stdout == ("[(('p1', 'bandwidth'), -5), (('p1', 'executions'), 2)] "
                           "['a', 'b']\n")


def test_a_server_url_goes_to_clickhouse_connect():
    with pytest.raises(ClickHouseError):  # the base of every clickhouse_connect error
        open_store("clickhouse://default:secret@127.0.0.1:1/default")


@pytest.mark.slow
@pytest.mark.parametrize(("coroutines", "prefetch"), [(2, 20), (4, 8)])
def test_the_job_counts_exactly_on_the_default_store_with_several_handler_processes(
        redis_url, client, tmp_path, supervisors, coroutines, prefetch):
    """The quick start's job, end to end on the embedded engine: the handler processes
    share one writer (at prefetch 8 over 4, dispatch gives one process the whole batch);
    a message published twice (a redelivery as the handler sees it) counts once; the stop
    leaves no writer; the command prints the totals."""
    db = tmp_path / "usage.chdb"
    config = write_config(tmp_path, redis_url, handler="examples.stats_usage:handle",
                          job={"coroutines": coroutines, "prefetch": prefetch})
    payloads = [make_payload(f"p{n % 3}", {"executions": 1, "bandwidth": n}) for n in range(300)]
    supervisor = supervisors(config, redis_url, STATS_USAGE_DB=str(db))
    publish(client, payloads)
    from broker import envelope
    from support.supervision import keys

    again = envelope.build("e2e", make_payload("p0", {"executions": 1000}))[1]
    client.lpush(keys().ready, again, again)
    wait_for(lambda: counter(client, "success") == 302, 90, "302 messages committed")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()
    # The writer got SIGTERM when its handler process exited: it closes the engine and goes.
    wait_for(lambda: writers(db) == [], 10, "the writer to stop")
    done = subprocess.run([sys.executable, "-m", "examples.stats_usage", str(db)],
                          cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    expected = {}
    for n in range(300):
        for metric, value in (("executions", 1), ("bandwidth", n)):
            expected[(f"p{n % 3}", metric)] = expected.get((f"p{n % 3}", metric), 0) + value
    expected[("p0", "executions")] += 1000
    assert done.stdout == "".join(f"{p}\t{m}\t{v}\n" for (p, m), v in sorted(expected.items()))
    assert stats_usage.ENV_DB == "STATS_USAGE_DB"


@pytest.mark.slow
def test_a_store_that_cannot_start_stops_the_job_with_exit_3(redis_url, tmp_path, supervisors):
    """The writer cannot make its folder (a file is in the way): init() fails at once and
    the supervisor stops with the code for a failed init(), which systemd does not restart."""
    (tmp_path / "a-file").write_text("")
    config = write_config(tmp_path, redis_url, handler="examples.stats_usage:handle")
    supervisor = supervisors(config, redis_url, STATS_USAGE_DB=str(tmp_path / "a-file" / "db"))
    assert supervisor.wait(60) == 3, supervisor.output()
    assert "stats-usage writer" in supervisor.output()


def log_segments(path) -> list[str]:
    return [segment for _, segment in wal.Log(path).segments()]


@pytest.fixture
def unmoved(monkeypatch):
    """The writers started from here move their log into the engine only when asked."""
    monkeypatch.setenv("STATS_USAGE_MOVE_AGE", "600")


@pytest.mark.slow
def test_an_answered_insert_is_in_the_log_and_survives_a_killed_writer(path, unmoved):
    """The writer answers once the rows are fsynced in its log and moves them into the
    engine later; killed before the move, the next writer moves them before it answers."""
    store = open_store(path)
    try:
        store.add([usage("w", executions=0)])  # the first insert goes to the engine itself
        store.add([usage("a", executions=1), usage("b", executions=2)])
        [writer] = writers(path)
        writer.kill()
        [segment] = log_segments(path)
        assert sorted(wal.read(segment)) == ["usage"]
        assert store.totals() == {("p1", "executions"): 3}  # a new writer, the log moved
        assert log_segments(path) == []
    finally:
        store.close()


@pytest.mark.slow
def test_a_log_moved_twice_counts_once(path, tmp_path, unmoved):
    """Killed between its INSERT and the segment's delete, a writer leaves rows that are
    in the engine already: the next one moves them again, and they count once."""
    store = open_store(path)
    try:
        store.add([usage("w", executions=0)])
        store.add([usage("a", executions=1), usage("b", executions=2)])
        [writer] = writers(path)
        writer.kill()
        [segment] = log_segments(path)
        shutil.copyfile(segment, tmp_path / "kept")
        assert store.totals() == {("p1", "executions"): 3}
        store.close()
        os.rename(tmp_path / "kept", segment)  # as if the delete had not happened
        store = open_store(path)
        store.add([usage("c", executions=4)])
        assert store.totals() == {("p1", "executions"): 7}
    finally:
        store.close()


def test_a_torn_record_at_the_end_of_the_log_is_left_out(tmp_path):
    """A record is answered only after its sync: one cut short (the writer died while
    writing it) or damaged was never answered, and reading stops before it."""
    log = wal.Log(str(tmp_path))
    log.append([("usage", b'{"n":1}\n'), ("other", b'{"n":2}\n')])
    log.append([("usage", b'{"n":3}\n')])
    segment = log.rotate()
    assert segment is not None and segment.endswith("000000000001.wal")
    with open(segment, "rb") as file:
        good = file.read().rstrip(b"\0")
    for tail in (b"\x00\x00", wal._record("usage", b'{"n":4}\n', 1)[:-3],
                 wal.RECORD.pack(8, 0) + b'usage\n{}'):
        with open(segment, "wb") as file:
            file.write(good + tail)
        assert wal.read(segment) == {"usage": [b'{"n":1}\n', b'{"n":3}\n'],
                                     "other": [b'{"n":2}\n']}
    assert log.rotate() is None  # nothing open: the next append opens a new segment
    log.append([("usage", b"x\n")])
    assert [seq for seq, _ in log.segments()] == [1, 2]


def test_a_reused_segment_shows_none_of_what_it_held_before(tmp_path):
    """A moved segment is written over as a later one (its blocks exist: a sync without
    the journal); its old records, seeded with another seq, are never read again, not
    even from where the new ones end, and a restarted log never reuses a seq."""
    log = wal.Log(str(tmp_path))
    log.append([("usage", b'["old",1]\n' * 50)])
    log.append([("usage", b'["old",2]\n')])
    first = log.rotate()
    assert os.path.getsize(first) == wal.SEGMENT_BYTES  # written full of zeros when made
    log.remove(first)
    assert log.segments() == [] and len(log.free()) == 1
    log.append([("usage", b'["new",1]\n')])
    [(seq, second)] = log.segments()
    assert seq == 2 and log.free() == []
    with open(second, "rb") as file:
        assert b'["old",2]' in file.read()  # written over from its start only
    assert wal.read(second) == {"usage": [b'["new",1]\n']}
    # A record that ends where an old one began is followed by that old record, whole.
    log.rotate()
    log.remove(second)
    log = wal.Log(str(tmp_path))  # restarted: past the seq of the kept file too
    log.append([("usage", b'["old",1]\n' * 50)])
    [(seq, third)] = log.segments()
    assert seq == 3 and wal.read(third) == {"usage": [b'["old",1]\n' * 50]}
    # Beyond KEEP_FREE, moved segments are deleted; a writer's .log segments are read
    # with their own rule (CRC of the body alone) and never kept.
    legacy = os.path.join(log.folder, "000000000009.log")
    with open(legacy, "wb") as file:
        body = b'usage\n["legacy",1]\n'
        file.write(wal.RECORD.pack(len(body), zlib.crc32(body)) + body)
    assert wal.read(legacy) == {"usage": [b'["legacy",1]\n']}
    log.remove(legacy)
    assert not os.path.exists(legacy)
    closed = [log.rotate()]
    for _ in range(wal.KEEP_FREE):
        log.append([("usage", b"x\n")])
        closed.append(log.rotate())
    for segment in closed:  # moved together
        log.remove(segment)
    assert len(log.free()) == wal.KEEP_FREE and log.segments() == []


def test_an_insert_after_a_statement_goes_to_the_engine_and_fails_as_it_did(path):
    """After a statement (a table dropped), the first insert is the engine's own, so its
    refusal fails the flush at once rather than sitting in the log."""
    store = open_store(path)
    try:
        store.add([usage("a", executions=1)])
        store.add([usage("b", executions=1)])  # logged
        store.database.execute("DROP TABLE usage")  # what was logged moved first
        with pytest.raises(WriterError, match="UNKNOWN_TABLE"):
            store.add([usage("c", executions=1)])
        assert log_segments(path) == []
    finally:
        store.close()


def test_the_writer_loads_the_engine_without_dataframe_libraries(path):
    """chDB's Python layer imports pyarrow, pandas and numpy when installed (39 MiB of the
    writer's memory), for results the writer never asks for: it runs without them."""
    store = open_store(path)
    try:
        store.add([usage("a", executions=1)])
        [writer] = writers(path)
        mapped = {os.path.basename(m.path) for m in writer.memory_maps()}
        assert any(name.startswith("_chdb") for name in mapped)
        assert not [name for name in mapped if name.startswith(("libarrow", "_multiarray"))]
        assert store.totals() == {("p1", "executions"): 1}
    finally:
        store.close()


class RecordingSession:
    """An engine session that records what the writer asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def query(self, sql: str, *args: object) -> None:
        raise AssertionError(f"the rows went into the text of a query: {sql[:40]!r}")

    def send_insert(self, query: str, fmt: str) -> RecordingSession:
        self.calls.append(("send_insert", query, fmt))
        return self

    def append(self, data: bytes) -> None:
        self.calls.append(("append", data))

    def finish(self) -> None:
        self.calls.append(("finish",))

    def __enter__(self) -> RecordingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.calls.append(("closed",))


def test_the_writer_streams_the_rows_into_the_engine():
    """An INSERT whose text holds the rows costs copies of them and the engine's parse of
    that query (~65 MiB more peak memory for 6 MiB of rows): the rows are streamed."""
    session = RecordingSession()
    rows = rows_of([usage("a", executions=1), usage("b", executions=2)])
    Engine(session).insert("usage", rows)
    assert session.calls == [("send_insert", "INSERT INTO usage", "JSONCompactEachRow"),
                             ("append", rows), ("finish",), ("closed",)]


PEAK_OF_AN_INSERT = """
import os, sys, tempfile
from examples.usage.clickhouse import SCHEMA, TABLE
from examples.usage.writer import Engine, Stop

def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

engine = Engine.open(os.path.join(tempfile.mkdtemp(), "usage.chdb"), Stop())
engine.execute(SCHEMA)
rows = b",".join(b'["p%d","executions",0,%d,"pid-%d"]' % (i % 50, i, i)
                 for i in range(160000)) + b"\\n"
before = peak()
engine.insert(TABLE, rows)
assert engine.select(f"SELECT count() FROM {TABLE}") == [[160000]]
print(len(rows), (peak() - before) * 1024)
engine.close()
"""


@pytest.mark.slow
def test_a_large_insert_costs_the_writer_little_more_than_its_rows():
    """6 MiB of rows (a move of the log is up to 8 MiB) raised the writer's peak by 66-71
    MiB as the text of a query, by 14-17 MiB streamed: less than five times the rows."""
    size, grew = map(int, python_script(PEAK_OF_AN_INSERT).stdout.split())
    assert grew < 5 * size, f"{grew >> 20} MiB more peak for {size >> 20} MiB of rows"


ARENAS_OF_EIGHT_THREADS = """
import ctypes, sys, threading
from examples.usage import writer

if sys.argv[1:] == ["fewer"]:
    writer._fewer_malloc_arenas()
started = threading.Barrier(9)

def allocate():
    held = [bytes(1000) for _ in range(100)]
    started.wait()  # every thread holds memory of its arena at once
    started.wait()

threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
started.wait()
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" paragraph per arena, on stderr
started.wait()
"""


def test_the_writer_keeps_the_engine_threads_to_two_malloc_arenas():
    """glibc gives each thread an arena up to 8 per core; the engine runs 28 threads."""
    def arenas(*args: str) -> int:
        return python_script(ARENAS_OF_EIGHT_THREADS, *args, timeout=60).stderr.count("Arena ")

    assert arenas() > 2  # glibc's default here
    assert arenas("fewer") == 2
