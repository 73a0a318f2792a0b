"""Running jobs made visible (issue 38 part 3, SPEC §7): the table the supervisor builds from
its ledger, the slow-job warnings and their pace, the copy `status` and the dashboard read
(written to a private Redis), and, end to end with real processes, the warnings, `status`
(Redis and NATS), the handler titles and the metrics while a job runs past slow_job_after.

Timing in the end-to-end tests is whole seconds (slow_job_after = 2) with margins; the
pace is checked by what each warning says of the next, never by when it came."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from broker.base import Delivery
from broker.redis import RedisBroker, acl
from broker.redis.keys import QueueKeys
from supervisor import running
from supervisor.buffer import Buffer, State
from supervisor.config import loads
from supervisor.handlers import HandlerPlace, make_places
from supervisor.running import Job
from support.envelopes import publish
from support.nats_jobs import nats_config
from support.nats_jobs import publish as publish_nats
from support.prometheus import sample, scrape
from support.servers import free_port
from support.supervision import NAMESPACE, QUEUE, ROOT, keys, wait_for, write_config
from worker import titles

pytestmark = pytest.mark.usefixtures("no_url_override")

GATED = "tests.handlers.gated:handle"


# -- the table ---------------------------------------------------------------------------------


def ledger(pids: list[list[str]], starts: list[list[float]]) -> Buffer:
    """A ledger whose handler ``i`` was given ``pids[i]`` (their attempts: ``i``) and
    started the first of them at ``starts[i]`` (monotonic s), in order, as a plain
    handler's marks tell it."""
    buffer = Buffer(20, len(pids))
    for place, (given, started) in enumerate(zip(pids, starts, strict=True)):
        buffer.add([Delivery(pid, QUEUE, 1, place, {}, b"{}", "receipt") for pid in given])
        buffer.queue(place, len(given))
        for entry, at in zip(buffer.in_state(State.QUEUED, place), started, strict=False):
            buffer.started_up_to(place, entry.number, at)
    return buffer


def places(*pids: int) -> list[HandlerPlace]:
    made = make_places(len(pids), 64, 64)
    for place, pid in zip(made, pids, strict=True):
        place.started(pid)
    return made


def described(jobs: list[Job]) -> list[tuple[Any, ...]]:
    return [(j.handler, j.process, j.pid, j.attempt, j.elapsed, j.started, j.slow) for j in jobs]


def test_the_table_names_what_each_handler_process_runs_oldest_first():
    # Handler 0 started a1, then a2: a plain handler runs one at a time, so a1 returned
    # (it waits for flush()) and a2 runs. Handler 1 runs b1; b2 waits in its ring.
    buffer = ledger([["a1", "a2"], ["b1", "b2"]], [[100.0, 103.0], [101.0]])
    jobs = running.table(places(4001, 4002), buffer, concurrent=False, slow_after=8.0,
                         now=110.0, wall=5000.0)
    assert described(jobs) == [(1, 4002, "b1", 2, 9.0, 4991.0, True),
                               (0, 4001, "a2", 1, 7.0, 4993.0, False)]


def test_an_async_handlers_jobs_all_run_but_those_it_returned_for_flush():
    buffer = ledger([["a1", "a2", "a3"]], [[100.0, 101.0, 102.0]])
    [held] = [entry for entry in buffer if entry.delivery.pid == "a2"]
    buffer.held(0, held.id)
    jobs = running.table(places(4001), buffer, concurrent=True, slow_after=0.0, now=110.0,
                         wall=5000.0)
    assert [(job.pid, job.elapsed, job.slow) for job in jobs] == [("a1", 10.0, False),
                                                                  ("a3", 8.0, False)]


def test_a_dead_places_jobs_show_no_process():
    buffer = ledger([["a1"]], [[100.0]])
    [place] = make_places(1, 64, 64)  # no process now (it died, its replacement not started)
    [job] = running.table([place], buffer, concurrent=False, slow_after=0, now=101.0, wall=0.0)
    assert job.process == 0


# -- slow-job warnings -------------------------------------------------------------------------


def job_at(elapsed: float, after: float = 2.0, run: tuple[int, float] = (1, 0.0)) -> Job:
    return Job(0, 4001, "p1", 1, 0.0, elapsed, bool(after) and elapsed >= after, run)


def test_a_slow_job_is_told_at_slow_job_after_then_at_each_doubling_of_its_run_time():
    slow = running.SlowJobs(2.0)
    looks = (1.0, 1.9, 2.0, 2.5, 3.9, 4.0, 7.0, 8.1, 15.0, 16.5, 20.0)
    assert [at for at in looks if slow.check([job_at(at)])] == [2.0, 4.0, 8.1, 16.5]


def test_a_look_that_comes_late_tells_once_and_the_next_is_the_doubling_after_it():
    assert running.next_warning(2.0, 9.0) == 16.0
    slow = running.SlowJobs(2.0)
    assert slow.check([job_at(9.0)]) and not slow.check([job_at(15.9)])
    assert slow.check([job_at(16.0)])


def test_a_hung_job_is_told_at_least_hourly_not_ever_more_rarely():
    assert running.next_warning(3600.0, 3600.0) == 7200.0
    assert running.next_warning(7200.0, 7200.0) == 7200.0 + running.SLOW_REPEAT_MAX
    assert running.next_warning(60.0, 20000.0) == 21840.0  # 60 ... 3840, 7440 ... 18240


def test_each_run_is_told_at_its_own_pace_and_a_new_run_afresh():
    slow = running.SlowJobs(2.0)
    first, second = job_at(2.0, run=(1, 0.0)), job_at(3.0, run=(2, 0.0))
    assert slow.check([first, second]) == [first, second]
    assert slow.check([job_at(3.0, run=(1, 0.0)), job_at(4.0, run=(2, 0.0))]) == [
        job_at(4.0, run=(2, 0.0))]
    # Delivery 1 runs again (its handler process died): a run of its own, told afresh.
    again = job_at(2.5, run=(1, 50.0))
    assert slow.check([again]) == [again]


def test_slow_job_after_0_never_warns():
    slow = running.SlowJobs(0.0)
    assert slow.check([job_at(10**6, after=0.0)]) == []


def test_many_slow_jobs_at_once_are_a_few_lines_not_one_each(caplog):
    slow = running.SlowJobs(2.0)
    jobs = [Job(0, 4001, f"p{n}", 1, 0.0, 30.0 - n, True, (n, 0.0)) for n in range(8)]
    with caplog.at_level(logging.WARNING, logger="supervisor"):
        slow.tell(slow.check(jobs), QUEUE)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == running.NAMED + 1
    assert lines[0] == ("job p0 attempt 1 has run 30s in handler 0 (process 4001), past "
                        "[job] slow_job_after = 2s; told again at 32s if it still runs")
    assert lines[-1] == ("3 more jobs have run past [job] slow_job_after = 2s (up to 25s): "
                         "`status` lists the running jobs")
    assert caplog.records[0].pid == "p0" and caplog.records[0].queue == QUEUE


def test_handler_timeout_0_is_told_once_at_start_as_the_operators_choice():
    def job(lines: str) -> Any:
        text = f'[job]\nqueue = "q"\nhandler = "examples.noop:handle"\n{lines}\n'
        return loads(text, import_handler=False).job

    notice = running.timeout_notice(job(""))
    assert notice is not None and notice.startswith(
        "[job] handler_timeout = 0: no handler call is ever stopped, by the operator's choice")
    assert "holds its handler process until that process is killed or the supervisor stops"\
        in notice and "slow_job_after = 60s warns" in notice
    assert "nothing warns" in (running.timeout_notice(job("slow_job_after = 0")) or "")
    assert running.timeout_notice(job("handler_timeout = 30")) is None


# -- the copy ----------------------------------------------------------------------------------


def test_the_copy_reads_back_with_the_time_since_it_was_written_from_its_expiry():
    jobs = [Job(0, 4001, "p1", 2, 1000.0, 75.0, True, (1, 0.0)),
            Job(1, 4002, "p2", 1, 1050.0, 25.0, False, (2, 0.0))]
    copy = running.decode(running.encode(jobs, ttl=30, slow_after=60.0), pttl_ms=27_500)
    assert copy is not None and (copy.running, copy.age, copy.slow_job_after) == (2, 2.5, 60)
    assert described(copy.jobs) == [(0, 4001, "p1", 2, 77.5, 1000.0, True),
                                    (1, 4002, "p2", 1, 27.5, 1050.0, False)]


def test_the_copy_holds_the_oldest_and_says_how_many_run():
    jobs = [job_at(100.0 - n, run=(n, 0.0)) for n in range(running.SHOWN + 10)]
    copy = running.decode(running.encode(jobs, ttl=3, slow_after=2.0), pttl_ms=3000)
    assert copy is not None and copy.running == running.SHOWN + 10
    assert [job.elapsed for job in copy.jobs] == [100.0 - n for n in range(running.SHOWN)]


@pytest.mark.parametrize("raw", [None, b"not json", b"[]", b'{"jobs": "many"}',
                                 b'{"jobs": []' + b" " * running.RECORD_LIMIT + b"}"])
def test_what_is_not_a_copy_of_ours_reads_as_none(raw):
    assert running.decode(raw, pttl_ms=1000) is None


def test_a_crafted_copy_reads_as_data_within_bounds():
    raw = json.dumps({"ttl": "x", "running": -5, "slow_job_after": True, "jobs": [
        {"pid": 5}, "job", {"pid": "\x1b[2J", "elapsed": "NaN", "handler": True, "attempt": "2",
                            "started": -1}]}).encode()
    copy = running.decode(raw, pttl_ms=-1)  # no expiry: not ours either, but readable
    assert copy is not None and copy.running == 1 and copy.age == 0.0
    assert described(copy.jobs) == [(0, 0, "\x1b[2J", 0, 0.0, 0.0, False)]


async def test_the_copy_is_written_when_the_table_changes_refreshed_and_deleted(
        redis_brokers, redis_client):
    broker = await redis_brokers(QUEUE, namespace=NAMESPACE, consumer_id="sup-a", lease=30)
    publisher = running.Publisher(broker.publish_running, ttl=30, slow_after=2.0)
    key = keys().running("sup-a")

    async def look(jobs: list[Job], now: float) -> running.Copy | None:
        publisher.update(jobs, now)
        if publisher._task is not None:
            await publisher._task
        return running.decode(await redis_client.get(key), await redis_client.pttl(key))

    assert await look([], 0.0) is None and publisher._task is None  # nothing runs: no copy
    copy = await look([job_at(1.0)], 0.0)
    assert copy is not None and copy.running == 1 and copy.jobs[0].pid == "p1"
    assert 28_000 < await redis_client.pttl(key) <= 30_000
    # Marked: a look that writes replaces the mark.
    await redis_client.set(key, running.encode([], 30, 2.0), keepttl=True)
    unchanged = await look([job_at(5.0)], 4.0)  # the same run, 4 s later: not written
    assert unchanged is not None and unchanged.running == 0
    refreshed = await look([job_at(11.0)], 10.0)  # a third of the expiry later: rewritten
    assert refreshed is not None and refreshed.jobs[0].elapsed == pytest.approx(11.0, abs=1)
    both = await look([job_at(12.0), job_at(1.0, run=(2, 0.0))], 10.5)  # a change: at once
    assert both is not None and both.running == 2
    assert await look([], 11.0) is None and not await redis_client.exists(key)


async def test_a_copy_the_broker_could_not_take_is_tried_again_at_the_next_look():
    with socket.socket() as probe:  # a port nobody listens on: the broker is down
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    broker = RedisBroker(f"redis://127.0.0.1:{port}/0", QUEUE, namespace=NAMESPACE)
    try:
        publisher = running.Publisher(broker.publish_running, ttl=3, slow_after=2.0)
        tries = []
        for now in (0.0, 1.0, 2.0):  # the same table each look: not written, so tried again
            publisher.update([job_at(3.0 + now)], now)
            assert publisher._task is not None and publisher._task not in tries
            tries.append(publisher._task)
            await publisher._task  # failed quietly: the loops that own the outage tell it
        assert not publisher.disabled
    finally:
        await broker.close()


def test_an_acl_user_made_before_the_copy_gets_one_warning_and_its_supervisor_goes_on(
        own_redis_server, caplog):
    import asyncio

    admin = redis.Redis(port=own_redis_server.port)
    queue_keys = QueueKeys(NAMESPACE, QUEUE)
    old_rules = [rule for rule in acl.rules(acl.BY_NAME["job"], queue_keys, "pw")
                 if "supervisor-running" not in rule]
    admin.execute_command("ACL", "SETUSER", "old-job", *old_rules)
    url = f"redis://old-job:pw@127.0.0.1:{own_redis_server.port}/0"

    async def run() -> None:
        broker = RedisBroker(url, QUEUE, namespace=NAMESPACE, consumer_id="old")
        await broker.connect()
        try:
            await broker.extend([])  # its record, as at the start
            publisher = running.Publisher(broker.publish_running, ttl=3, slow_after=2.0)
            for now in (0.0, 1.0, 2.0):
                publisher.update([job_at(now + 1, run=(int(now), 0.0))], now)
                if publisher._task is not None:
                    await publisher._task
            assert publisher.disabled
            await broker.abandon([])  # the stop: its record goes; the copy's refusal is quiet
        finally:
            await broker.close()

    with caplog.at_level(logging.WARNING, logger="supervisor"):
        asyncio.run(run())
    told = [r.getMessage() for r in caplog.records if "running jobs' copy" in r.getMessage()]
    assert len(told) == 1 and "no permissions" in told[0].lower(), told
    assert not admin.exists(queue_keys.supervisor("old"), queue_keys.running("old"))
    # Refused its writes of the copy (SET, then the DEL at the stop), and nothing else.
    assert {entry["object"] for entry in admin.acl_log()} == {queue_keys.running("old")}
    assert {entry["context"] for entry in admin.acl_log()} == {"toplevel"}
    admin.close()


# -- end to end --------------------------------------------------------------------------------


def status(config: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "supervisor", "status", str(config), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def status_json(config: Path) -> dict[str, Any]:
    return json.loads(status(config, "--json"))


def title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline()).strip()


WARNING = re.compile(r"job (\S+) attempt 1 has run (\d+)s in handler 0 \(process (\d+)\), "
                     r"past \[job\] slow_job_after = 2s; told again at (\d+)s if it still runs")


@pytest.mark.slow
@pytest.mark.timeout(180)  # measured 25-45 s on a loaded 2-core machine
def test_a_job_past_slow_job_after_is_warned_about_and_shown_everywhere_while_it_runs(
        tmp_path, redis_url, client, supervisors):
    gate, port = tmp_path / "gate", free_port()
    config = write_config(tmp_path, redis_url, handler=GATED, job={"slow_job_after": 2},
                          supervisor={"metrics_port": port})
    [pid] = publish(client, [{"gate": str(gate)}])
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: len(WARNING.findall(supervisor.output())) >= 2, 30, "two warnings")
    (first_pid, first, process, next_at), (_, second, again, then_at) = \
        WARNING.findall(supervisor.output())[:2]
    # Told at 2 s, again at 4 s, next at 8 s (each look a second apart: whole-second margins).
    assert first_pid == pid and process == again and (next_at, then_at) == ("4", "8")
    assert 2 <= int(first) < 4 <= int(second) < 8
    assert int(process) in [p.pid for p in supervisor.family()]
    assert "[job] handler_timeout = 0: no handler call is ever stopped, by the operator's " \
           "choice" in supervisor.output()

    # status: the job, below its supervisor's record (JSON and text)
    [record] = status_json(config)["supervisors"]
    [job] = record["running"]["jobs"]
    assert (job["pid"], job["attempt"], job["handler"], job["process"], job["slow"]) == (
        pid, 1, 0, int(process), True)
    assert job["elapsed"] >= 4 and record["running"]["running"] == 1
    text = status(config)
    assert re.search(r"\n  running       1 job, the oldest \d+s, 1 past slow_job_after\n", text)
    [line] = [line for line in text.splitlines() if pid in line]
    assert re.fullmatch(rf"      job {re.escape(pid)}  attempt 1  \d+s \(since \d\d:\d\d:\d\d "
                        rf"UTC\)  handler 0, process {process}  past slow_job_after \(2s\)",
                        line), line
    # its handler process's title, and the metrics
    assert title(int(process)).startswith(
        f"queue-supervisor: {QUEUE} handler 0 busy: job {pid} attempt 1 since ")
    samples = scrape(port)
    assert sample(samples, "oldest_running_seconds", queue=QUEUE) >= 4
    assert sample(samples, "slow_jobs", queue=QUEUE) == 1

    gate.touch()  # it ends: gone from the copy (kept for its figures), the metrics, the title
    wait_for(lambda: status_json(config)["supervisors"][0]["running"]["running"] == 0, 15,
             "no job in the copy")
    wait_for(lambda: sample(scrape(port), "slow_jobs", queue=QUEUE) == 0, 15, "no slow job")
    assert "  running       none\n" in status(config)
    wait_for(lambda: title(int(process)).endswith("handler 0 idle"), 15, "the title idle")


@pytest.mark.slow
def test_the_copy_of_a_killed_supervisor_expires_with_its_record(
        tmp_path, redis_url, client, supervisors):
    config = write_config(tmp_path, redis_url, handler=GATED)  # lease 3 s
    publish(client, [{"gate": str(tmp_path / "never")}])
    supervisor = supervisors(config, redis_url)
    [copy] = wait_for(lambda: list(client.scan_iter(match=keys().running("") + "*")), 30,
                      "the copy of the running job")
    assert 0 < client.pttl(copy) <= 3000
    for process in supervisor.family():  # kill -9: nothing deletes it
        process.send_signal(signal.SIGKILL)
    wait_for(lambda: not client.exists(copy), 3 + 5, "the copy to expire with the lease")
    state = status_json(config)
    assert state["supervisors"] == []


@pytest.mark.slow
def test_status_on_nats_names_the_jobs_this_hosts_supervisors_run(
        tmp_path, nats_server, supervisors):
    gate = tmp_path / "gate"
    config = nats_config(tmp_path, nats_server, handler=GATED, job={"slow_job_after": 2})
    [pid] = publish_nats(nats_server, [{"gate": str(gate)}])
    supervisor = supervisors(config)

    def jobs() -> list[dict[str, Any]]:
        """Ours: other supervisors of a queue of this name may run on this host (other
        tests'), and status lists them too, as it says."""
        return [job for found in status_json(config)["this_host"] for job in found["jobs"]
                if found["pid"] == supervisor.pid]

    [job] = wait_for(lambda: [job for job in jobs() if job["slow"]], 30, "the job past 2 s")
    handler = next(p for p in supervisor.family()[1:] if "handler 0" in title(p.pid))
    assert (job["pid"], job["attempt"], job["handler"], job["process"]) == (
        pid, 1, 0, handler.pid)
    assert job["elapsed"] >= 2 and job["in_process"] == 1
    text = status(config)
    assert re.search(rf"\n  this host     \d+ supervisors? of {QUEUE} \(by their process "
                     r"titles: run status on each host for its own\), running \d+ jobs?", text)
    assert f"\n    pid {supervisor.pid}  running [buffer 1/10, 1/1 busy]\n" in text
    assert re.search(rf"\n      job {re.escape(pid)}  attempt 1  \d+s \(since .* UTC\)  "
                     rf"handler 0, process {handler.pid}  past slow_job_after \(2s\)\n", text)
    gate.touch()
    wait_for(lambda: not jobs(), 15, "nothing running")


def test_a_title_of_another_version_or_cut_short_is_not_read_as_a_job():
    assert titles.parse("0 busy: job p attempt 2 since 2026-12-01T14:03:07") is None
    assert titles.parse("0 busy: job p attempt 2 since 2026-12-01T14:0") is None
    assert titles.parse("0 busy") == titles.HandlerTitle(0, True, 1)
    assert titles.parse("3 busy: 7 running") == titles.HandlerTitle(3, True, 7)
    # The pid is read from the end back: one holding our own words stays whole.
    read = titles.parse("0 busy: job a attempt 9 since x attempt 2 since 2026-12-01T14:03:07Z")
    assert read is not None and (read.pid, read.attempt) == ("a attempt 9 since x", 2)
    assert read.since == 1796133787.0


def test_redis_keys_and_acl_name_the_copy():
    assert keys().running("sup-a") == f"{NAMESPACE}.supervisor-running.{QUEUE}.sup-a"
    for role in ("job", "status", "dashboard"):
        assert any("supervisor-running" in rule
                   for rule in acl.patterns(acl.BY_NAME[role], keys())), role
    assert not any("supervisor-running" in rule
                   for rule in acl.patterns(acl.BY_NAME["drain"], keys()))
