"""What a hostile review of issue 25 found: each test failed before its fix."""

from __future__ import annotations

import asyncio
import signal

import orjson
import pytest

from supervisor import cli
from support.envelopes import publish
from support.operator import php_failed
from support.supervision import counter, keys, wait_for, write_config

pytestmark = pytest.mark.usefixtures("no_url_override")


@pytest.mark.slow
async def test_retry_steps_over_a_pid_that_is_not_utf8(conf, run, redis_client):
    """A corrupt entry at the oldest end stopped every `retry --all` with a traceback
    (UnicodeDecodeError), so nothing behind it could ever be retried."""
    await redis_client.lpush(keys().failed, b"\xff\xfe-not-utf8")
    good = await php_failed(redis_client, "failed", {"ok": 1})
    code, out = await run("failed", conf, "retry", "--all", "--dry-run")
    assert code == 1 and "would move (dry run, nothing changed) 1 failed" in out
    assert "left 1 job records" in out and "not UTF-8" in out
    code, out = await run("failed", conf, "retry", "--all")
    assert code == 1 and "moved 1 failed jobs" in out and good in out
    assert await redis_client.lrange(keys().failed, 0, -1) == [b"\xff\xfe-not-utf8"]
    assert await redis_client.llen(keys().ready) == 1


@pytest.mark.slow
@pytest.mark.parametrize("handler", ["tests.handlers.exits:handle",
                                     "tests.handlers.exits:handle_async"])
def test_a_handler_raising_sys_exit_fails_its_job_not_the_service(tmp_path, redis_url, client,
                                                                   supervisors, handler):
    """sys.exit(3) in one job exited its handler process with 3, which the supervisor reads
    as a failed init(): it halted with exit 3 (no systemd restart) and said "failed to
    start". Now each such run fails with its class, the process is replaced, the rest run."""
    exits3, exits0, interrupted, unwound, good = publish(
        client, [{"raise": "exit3"}, {"raise": "exit0"}, {"raise": "interrupt"},
                 {"raise": "base"}, {"ok": 1}])
    config = write_config(tmp_path, redis_url, handler=handler, job={"max_attempts": 1})
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: client.llen(keys().failed) == 4 and counter(client, "success") == 1, 60,
             "four jobs to fail and one to succeed")
    assert supervisor.process.poll() is None, supervisor.output()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()
    out = supervisor.output()
    errors = {r["pid"]: r["error"] for r in map(orjson.loads, out.splitlines())
              if r.get("outcome") == "failed"}
    assert errors == {exits3: "SystemExit: 3", exits0: "SystemExit: 0",
                      interrupted: "KeyboardInterrupt",
                      unwound: "tests.handlers.exits.Abort: unwound"}
    assert "failed to start" not in out and "halting" not in out
    assert f"job {exits3}: the handler raised SystemExit: 3, which is not an Exception" in out
    assert good not in [p.decode() for p in client.lrange(keys().failed, 0, -1)]


@pytest.mark.slow
async def test_a_lost_publish_reply_mid_retry_names_the_letter_and_what_to_do(
        tmp_path, nats_server, nats_brokers, js, capsys, monkeypatch):
    """`dead retry --all` whose publish reply was lost (the message did reach the work
    stream) printed only "dead failed: nats: timeout": not which dead letter, not what had
    moved before it, not that it may now be in both streams and how to finish."""
    import nats.errors

    from broker.nats import admin as nats_dead
    from support.nats_dead_letters import NAMES, bury, dead_pids, work_messages

    job = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle"))
    _, pids = await bury(nats_brokers, 2)
    original = nats_dead.DeadStream.publish

    async def reply_lost(self, letter):
        ack = await original(self, letter)  # the server stored it ...
        if letter.job.pid == pids[1]:
            raise nats.errors.TimeoutError  # ... and its acknowledgement never came back
        return ack

    monkeypatch.setattr(nats_dead.DeadStream, "publish", reply_lost)
    code = await asyncio.to_thread(cli.main, ["dead", job, "retry", "--all"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"re-driving dead letter {pids[1]} (seq 2) failed" in err
    assert f"1 moved before it: {pids[0]}" in err
    assert NAMES.dead_stream in err and "within 120 s" in err
    assert await work_messages(js) == 2 and await dead_pids(js) == [pids[1]]  # in both

    monkeypatch.setattr(nats_dead.DeadStream, "publish", original)
    assert await asyncio.to_thread(cli.main, ["dead", job, "retry", "--all"]) == 0
    assert await work_messages(js) == 2 and await dead_pids(js) == []


async def test_a_mistyped_key_under_the_gauges_is_not_blamed_on_the_acl(
        redis_brokers, redis_client, caplog, monkeypatch):
    """A string where the failed list should be was logged as "an ACL user from before
    this version: run `acl` again": an operator would rerun acl and change nothing."""
    import logging

    from broker.redis import gauges as redis_gauges

    monkeypatch.setattr(redis_gauges, "_refused", set())
    broker = await redis_brokers("gauges")
    await redis_client.set(broker.keys.failed, "not a list")
    with caplog.at_level(logging.WARNING, logger="broker.redis.gauges"):
        sample = await redis_gauges.sample(broker)
    assert sample.failed is None and sample.ready == 0
    [line] = [r.getMessage() for r in caplog.records if "failed left out" in r.getMessage()]
    assert "WRONGTYPE" in line and "holds another type" in line and "acl" not in line


@pytest.mark.slow
def test_an_on_error_whose_exception_cannot_be_printed_keeps_the_process(
        tmp_path, redis_url, client, supervisors):
    """on_error() raising an exception whose str() raises killed the handler process (the
    log line of the hook's failure raised), once per failed job; one whose message is 10 MB
    wrote a 10 MB log line."""
    publish(client, [{"hook": "unprintable"}, {"hook": "huge"}])
    config = write_config(tmp_path, redis_url, handler="tests.handlers.hooks_hostile:handle",
                          job={"max_attempts": 1})
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: client.llen(keys().failed) == 2, 60, "both jobs to fail")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0, supervisor.output()
    out = supervisor.output()
    assert "worker lost" not in out and "exited with code" not in out, out[-3000:]
    hooks = [line for line in out.splitlines() if "on_error() failed" in line]
    assert len(hooks) == 2 and all(len(line) < 10_000 for line in hooks), out[-3000:]
    assert any("Unprintable: <str() raised RuntimeError>" in line for line in hooks)


@pytest.mark.slow
async def test_a_dead_letter_with_a_non_ascii_digit_header_does_not_break_dead_commands(
        tmp_path, nats_server, nats_brokers, js, capsys):
    """``Queue-Attempts: ²`` passed str.isdigit() and then failed int(): every `dead list`,
    `show` and `retry` of the stream ended in a ValueError traceback until it was purged;
    so did a ``seq:²`` selector."""
    from broker import envelope
    from support.nats_dead_letters import NAMES, dead_pids

    job = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle"))
    await nats_brokers("e2e")  # the streams
    pid, raw = envelope.build("e2e", {"a": 1})
    await js.publish(NAMES.dead_subject, raw, headers={"Queue-Attempts": "\u00b2"})

    async def dead(*args: str) -> tuple[int, str]:
        code = await asyncio.to_thread(cli.main, ["dead", job, *args])
        return code, capsys.readouterr().out

    code, out = await dead("list")
    assert code == 0 and pid in out
    assert (await dead("show", pid))[0] == 0
    assert (await dead("show", "seq:\u00b2"))[0] == 1  # no such letter, said plainly
    code, out = await dead("retry", "--all")
    assert code == 0 and pid in out and await dead_pids(js) == []


async def test_a_registry_entry_with_non_ascii_digits_does_not_stop_maintenance(
        redis_brokers, redis_client):
    """An entry "² <consumer>" in the supervisors' registry made forget_gone() raise
    ValueError, which stops the supervisor (its maintenance loop died) at every start."""
    from broker.redis import recovery

    broker = await redis_brokers("e2e")
    await redis_client.hset(broker.keys.supervisor_tokens, "t1", "\u00b2\u00b2 someone")
    assert await recovery.forget_gone(broker.client, broker.keys, recovery_age=1) == 0
    assert recovery._registered_consumer("\u00b2 someone".encode()) is None


def test_a_scrape_flood_renders_once_per_second_and_is_paced(monkeypatch):
    """Every scrape rendered every series in the supervisor's process, as fast as clients
    asked: six clients in a loop cut its throughput to a sixth (5,000 jobs: 9.5 s, not
    1.5 s). Now one kind of request is rendered once per METRICS_CACHE and answers are
    ANSWER_GAP apart."""
    import time
    import urllib.request

    from supervisor import metrics, metrics_http
    from support.servers import free_port

    monkeypatch.setattr(metrics_http, "METRICS_CACHE", 3600.0)  # read when the endpoint starts
    served = metrics.start("q", free_port())
    renders = []

    class Counting:
        def collect(self):
            renders.append(1)
            return iter(())

    served.registry.register(Counting())
    try:
        began = time.monotonic()
        for _ in range(20):
            url = f"http://127.0.0.1:{served.port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as answer:
                assert b"queue_supervisor_deliveries_received_total" in answer.read()
        took = time.monotonic() - began
        other = urllib.request.Request(f"http://127.0.0.1:{served.port}/metrics", headers={
            "Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(other, timeout=10) as answer:  # another kind: rendered
            assert answer.read().endswith(b"# EOF\n")
    finally:
        served.close()
    assert len(renders) == 2
    assert took >= 19 * metrics_http.ANSWER_GAP  # load only makes it longer


@pytest.mark.slow
async def test_a_mistyped_failed_or_dead_key_is_named_in_the_error(conf, redis_client,
                                                                   capsys):
    """`failed list` over a string at the failed key said only "WRONGTYPE Operation against
    a key holding the wrong kind of value": not which key, nor what to do."""
    await redis_client.set(keys().failed, "x")
    await redis_client.hset(keys().dead, "a", "b")
    for source, action, kind in (("failed", "list", "string"), ("failed", "show", "string"),
                                 ("dead", "list", "hash")):
        args = [source, conf, action] + (["some-pid"] if action == "show" else [])
        assert await asyncio.to_thread(cli.main, args) == 1
        err = capsys.readouterr().err
        key = keys().failed if source == "failed" else keys().dead
        assert f"{key} holds a {kind}, not a list of pids" in err, err
        assert "redis-cli" in err
