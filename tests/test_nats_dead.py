"""``failed`` / ``dead JOB ACTION`` and ``retry`` on NATS: the dead stream, read, deleted and
re-driven to the work stream (queue 5's dead-to-work move), against a private nats-server.

Dead letters are made by the real NatsBroker (reject at max_attempts = 1), or published to
the dead subject as a PHP queue-5 worker parks them (the bytes, no header).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import orjson
import pytest

from broker import envelope
from broker.base import Action, Settlement
from broker.failure import NATS_HEADER, Failure
from broker.nats import admin as nats_dead
from supervisor import cli
from support.brokers import receive_all
from support.nats_dead_letters import NAMES, bury, dead_pids, work_messages
from support.supervision import QUEUE, ROOT, write_config
from support.waiting import until

pytestmark = pytest.mark.usefixtures("no_url_override")

BIDI = "\u202e"


@pytest.fixture
def conf(tmp_path: Path, nats_server) -> str:
    return str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle"))




async def test_list_and_show_read_the_dead_stream(conf, run, nats_brokers, js):
    _, pids = await bury(nats_brokers, 2)
    php_pid, raw = envelope.build(QUEUE, {"from": "php", "bidi": BIDI + "x" * 100_000})
    await js.publish(NAMES.dead_subject, raw)  # as queue 5 parks it: no header
    failure = Failure(error="ValueError", message="bad input", where="jobs.py:3 in handle",
                      traceback="Traceback ...\n" + "  Ünïcode frame\n" * 1000
                      + "ValueError: bad input", attempt=1, at=1_700_000_000.0,
                      outcome="dead")
    recorded, raw = envelope.build(QUEUE, {"n": "recorded"})
    await js.publish(NAMES.dead_subject, raw, headers={NATS_HEADER: failure.encode().decode()})
    await js.publish(NAMES.dead_subject, b"{not json")

    code, out = await run("dead", conf, "list")
    assert code == 0
    title, *rows = out.splitlines()
    assert f"{NAMES.dead_stream}" in title and ": 5," in title and "oldest first" in title
    assert [row.split()[2] for row in rows[:4]] == [*pids, php_pid, recorded]
    assert [row.split()[1] for row in rows] == ["1", "2", "3", "4", "5"]  # seq
    assert f"boom {pids[0]}" in rows[0]  # older supervisors' Queue-Reason header
    assert "attempt 1" in rows[0] and "failed 20" in rows[0]  # deliveries; when it was stored
    assert "(no record)" in rows[2] and "ValueError: bad input" in rows[3]
    assert "(no pid)" in rows[4] and "(undecodable)" in rows[4]
    assert BIDI not in out and "\\u202e" in out and len(rows[2]) < 600

    code, out = await run("failed", conf, "list", "--json", "--limit", "1")  # the same stream
    state = orjson.loads(out)
    assert code == 0 and state["total"] == 5 and [j["pid"] for j in state["jobs"]] == pids[:1]

    code, out = await run("dead", conf, "show", recorded)
    assert code == 0 and "jobs.py:3 in handle" in out and "ValueError: bad input" in out
    assert "  Ünïcode frame" in out  # a header value that is not ASCII, read as UTF-8
    assert "stream seq   4" in out
    code, out = await run("dead", conf, "show", recorded, "--json")
    assert orjson.loads(out)["error"]["traceback"] == failure.bounded().traceback
    code, out = await run("dead", conf, "show", "seq:5", "--json")
    assert code == 0 and orjson.loads(out)["envelope"] == "{not json"
    code, out = await run("dead", conf, "show", "nobody")
    assert code == 1 and "no dead job nobody" in out


async def test_delete_by_pid_seq_and_count_with_dry_run(conf, run, nats_brokers, js):
    _, pids = await bury(nats_brokers, 4)
    code, out = await run("dead", conf, "delete", pids[1], "--dry-run")
    assert code == 0 and "would delete (dry run, nothing changed) 1" in out
    assert await dead_pids(js) == pids
    code, out = await run("dead", conf, "delete", pids[1], "seq:4", "nobody")
    assert code == 1 and "deleted 2" in out and "nobody" in out
    assert "seq:4" not in out  # found by its sequence: not reported missing as well
    assert await dead_pids(js) == [pids[0], pids[2]]
    code, out = await run("dead", conf, "delete", "--count", "1")
    assert code == 0 and await dead_pids(js) == [pids[2]]
    code, out = await run("dead", conf, "delete", "--all")
    assert code == 0 and await dead_pids(js) == []


@pytest.mark.slow
async def test_retry_re_drives_dead_letters_to_work_and_they_run_again(conf, run, nats_brokers,
                                                                       js):
    broker, pids = await bury(nats_brokers, 3)
    code, out = await run("dead", conf, "retry", pids[0], "--dry-run")
    assert code == 0 and await work_messages(js) == 0 and await dead_pids(js) == pids

    code, out = await run("dead", conf, "retry", pids[0])
    assert code == 0 and "moved 1 dead letters" in out and NAMES.subject in out
    assert await dead_pids(js) == pids[1:]
    [again] = await receive_all(broker, 1)
    assert (again.pid, again.attempts, again.payload) == (pids[0], 0, {"n": 0})
    await broker.settle([Settlement(Action.COMMIT, again)])

    code, out = await run("dead", conf, "retry", pids[0])  # done already: not doubled
    assert code == 1 and "untouched" in out and await work_messages(js) == 0

    code, out = await run("retry", conf, "--from", "dead")  # the old command, on NATS now
    assert code == 0 and "moved 2 dead letters" in out
    assert await dead_pids(js) == []
    assert sorted(d.pid for d in await receive_all(broker, 2)) == sorted(pids[1:])


async def test_killed_between_publish_and_delete_leaves_a_duplicate_never_a_loss(
        conf, run, nats_brokers, js, monkeypatch):
    _, pids = await bury(nats_brokers, 1)

    async def killed(self, letter):  # the process dies right after the acknowledged publish
        raise OSError("killed")

    original = nats_dead.DeadStream.delete
    monkeypatch.setattr(nats_dead.DeadStream, "delete", killed)
    code, _ = await run("dead", conf, "retry", pids[0])
    assert code == 1
    assert await work_messages(js) == 1 and await dead_pids(js) == pids  # in both: no loss

    monkeypatch.setattr(nats_dead.DeadStream, "delete", original)
    code, out = await run("dead", conf, "retry", pids[0])  # run again, within 120 s
    assert code == 0 and "published already by another retry" in out
    assert await work_messages(js) == 1  # the message id kept it to one copy
    assert await dead_pids(js) == []


async def test_a_publish_that_fails_keeps_the_dead_letter(conf, run, nats_brokers, js,
                                                          monkeypatch):
    _, pids = await bury(nats_brokers, 1)

    async def refused(self, letter):
        raise OSError("no JetStream")

    monkeypatch.setattr(nats_dead.DeadStream, "publish", refused)
    code, _ = await run("dead", conf, "retry", "--all")
    assert code == 1
    assert await work_messages(js) == 0 and await dead_pids(js) == pids


async def test_poison_is_refused_on_nats(conf, capsys):
    assert await asyncio.to_thread(cli.main, ["poison", conf, "list"]) == 2
    assert "use dead" in capsys.readouterr().err


async def test_two_retries_of_the_same_dead_letter_at_once_publish_it_once(nats_server,
                                                                          nats_brokers, js):
    await bury(nats_brokers, 1)
    import nats

    clients = [await nats.connect(nats_server.url) for _ in range(2)]
    try:
        streams = [nats_dead.DeadStream(c, NAMES) for c in clients]
        [letter] = [letter async for letter in streams[0].letters()]
        outcomes = await asyncio.gather(*(s.redrive(letter) for s in streams))
    finally:
        for client in clients:
            await client.close()
    assert True in outcomes  # one published; the other found it gone or deduplicated
    assert await work_messages(js) == 1 and await dead_pids(js) == []


async def test_json_reports_name_what_redis_reports_name(conf, run, nats_brokers):
    _, pids = await bury(nats_brokers, 2)
    code, out = await run("dead", conf, "delete", pids[0], "--json")
    assert code == 0 and orjson.loads(out)["deleted"] == 1
    assert orjson.loads(out)["pids"] == pids[:1]
    code, out = await run("dead", conf, "retry", "--all", "--json")
    assert code == 0 and orjson.loads(out)["moved"] == 1 and orjson.loads(out)["missing"] == []


async def stream_pids(js, stream: str, subject: str) -> list[str]:
    """The pids of a stream's messages on ``subject``, oldest first."""
    info = await js.stream_info(stream)
    found, seq = [], info.state.first_seq
    while info.state.messages and seq <= info.state.last_seq:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except Exception:
            break
        found.append(envelope.decode(msg.data)["pid"])
        seq = msg.seq + 1
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_retry_killed_midway_loses_nothing_and_a_rerun_publishes_each_once(
        conf, run, nats_brokers, js):
    """SIGKILL while ``dead retry --all`` re-drives: every job is in work, dead or both;
    running it again empties dead and leaves each job in work once (the message ids)."""
    _, pids = await bury(nats_brokers, 400)
    env = {k: v for k, v in os.environ.items() if k != "QUEUE_BROKER_URL"}
    env["PYTHONPATH"] = str(ROOT)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "dead", conf, "retry", "--all", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await until(lambda: work_messages(js), 60, "the first re-driven message")
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
    work = await stream_pids(js, NAMES.stream, NAMES.subject)
    dead = await stream_pids(js, NAMES.dead_stream, NAMES.dead_subject)
    assert set(work) | set(dead) == set(pids)  # nothing lost
    assert len(work) == len(set(work))

    code, _ = await run("dead", conf, "retry", "--all")
    assert code == 0
    assert await stream_pids(js, NAMES.dead_stream, NAMES.dead_subject) == []
    assert sorted(await stream_pids(js, NAMES.stream, NAMES.subject)) == sorted(pids)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_redrive_whose_replies_are_lost_under_load_runs_each_job_once(
        tmp_path, conf, run, nats_brokers, nats_server, js, supervisors):
    """Issue 39.5: dead letters re-driven while a supervisor consumes the work stream, one
    publish's acknowledgement lost on the way back (the proxy drops it): that retry fails
    naming the letter and what to do, the job is in work and still dead; the rerun the
    message says to do publishes nothing twice (the message id), empties the dead stream,
    and the supervisor runs every job exactly once."""
    from support.faultproxy import FaultProxy
    from support.supervision import lines

    _, pids = await bury(nats_brokers, 200)
    workdir = tmp_path / "supervisor"
    workdir.mkdir()
    supervisors(write_config(workdir, nats_server.url, job={"prefetch": 20}))
    code, _ = await run("dead", conf, "retry", "--count", "80")  # under way meanwhile
    assert code == 0
    (tmp_path / "lossy").mkdir()
    proxy = await FaultProxy(nats_server.port).start()
    try:
        lossy = write_config(tmp_path / "lossy", proxy.url, handler="examples.noop:handle")
        proxy.drop_replies_to_prefix(NAMES.subject)  # the next re-drive's acknowledgement
        code, _ = await run("dead", str(lossy), "retry", "--all")
    finally:
        await proxy.close()
    assert code == 1 and proxy.dropped == 1
    code, out = await run("dead", conf, "retry", "--all")
    assert code == 0 and "1 of them had been published already" in out, out
    assert await dead_pids(js) == []

    async def finished() -> bool:
        info = await js.consumer_info(NAMES.stream, NAMES.consumer)
        return not (info.num_pending or info.num_ack_pending or await work_messages(js))

    await until(finished, 60, "every re-driven job to be run and acknowledged")
    assert sorted(lines(tmp_path / "handled")) == sorted(pids)  # each once (E2E_DIR)
