"""Delayed retries on Redis end to end (issue 25.1): a supervisor killed with -9 while
retries wait loses none of them (another supervisor promotes and runs them), and the
rollback to PHP workers (``drain``) leaves nothing in the delayed set, which ``check``
reports while anything is there and ``status`` counts."""

from __future__ import annotations

import re
import uuid

import pytest

from broker import envelope
from broker.redis.keys import QueueKeys
from support import processes
from support.dashboard import Dashboard
from support.operator import command
from support.supervision import NAMESPACE, Supervisor, lines, wait_for, write_config

pytestmark = pytest.mark.slow  # every test here takes a second or more

HANDLER = "tests.handlers.fails_until:handle"


def _setup(tmp_path, redis_url, client, *, count: int, succeed_at: int, backoff: float):
    queue = f"backoff-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(NAMESPACE, queue)
    log = tmp_path / "handled"
    built = [envelope.build(queue, {"n": n, "succeed_at": succeed_at, "log": str(log)})
             for n in range(count)]
    client.lpush(keys.ready, *(raw for _, raw in built))
    config = write_config(tmp_path, redis_url, handler=HANDLER,
                          job={"queue": queue, "max_attempts": 3, "retry_backoff": backoff})
    return keys, log, {pid for pid, _ in built}, config


def test_kill_9_with_delayed_retries_loses_none(tmp_path, redis_url, client):
    keys, log, pids, config = _setup(tmp_path, redis_url, client, count=20, succeed_at=1,
                                     backoff=600)
    first = Supervisor(config, tmp_path, redis_url)
    try:
        # Every first run failed: all 20 wait for their backoff (300 to 600 s).
        wait_for(lambda: client.zcard(keys.delayed) == 20, 30, "20 delayed retries")
        for process in reversed(first.family()):
            processes.kill(process)
        first.wait(10)
    finally:
        first.stop()
    assert client.zcard(keys.delayed) == 20 and lines(log) == []
    # Their backoff passes while no supervisor runs (scores rewritten: no test waits).
    due = int(client.time()[0]) - 120
    client.zadd(keys.delayed, dict.fromkeys(client.zrange(keys.delayed, 0, -1), due))
    # Issue 39.3: nothing promotes them now, and queue 5's counters do not count them;
    # what an operator reads from the broker says so (the gauge: tests/test_queue_gauges.py).
    status = command("status", str(config))
    assert re.search(r"  delayed       20 retries waiting for their backoff \(the first was due "
                     r"at \d\d:\d\d:\d\d UTC, 1\d\ds ago: only a running supervisor moves "
                     r"them", status.stdout), status.stdout
    checked = command("check", str(config))
    assert checked.returncode == 1 and "the oldest overdue by 1" in checked.stdout
    dashboard = Dashboard([config], tmp_path)
    try:
        # Overdue beside the killed one's record first, then (its lease out) none alive.
        wait_for(lambda: "20 delayed retries wait, the oldest due 1" in dashboard.client.get(
            "/live/overview")[1], 60, "the dashboard to name the unattended retries")
        wait_for(lambda: "and no supervisor is alive to move them" in dashboard.client.get(
            "/live/overview")[1], 30, "the dashboard to say that no supervisor is alive")
    finally:
        dashboard.stop()
    second = Supervisor(config, tmp_path, redis_url)
    try:
        wait_for(lambda: len(lines(log)) >= 20, 60, "the retries run by the second supervisor")
        assert {line.split()[0] for line in lines(log)} == pids
        assert {line.split()[1] for line in lines(log)} == {"1"}  # each ran once more, once
        assert client.zcard(keys.delayed) == 0 and client.llen(keys.failed) == 0
    finally:
        second.stop()


def test_drain_moves_delayed_retries_back_and_check_tells_while_they_wait(
    tmp_path, redis_url, client
):
    keys, _log, pids, config = _setup(tmp_path, redis_url, client, count=5, succeed_at=1,
                                     backoff=3600)
    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        wait_for(lambda: client.zcard(keys.delayed) == 5, 30, "5 delayed retries")
        status = command("status", str(config))
        assert status.returncode == 0, status.stderr
        assert "  delayed       5 retries waiting for their backoff (next due " in status.stdout
        checked = command("check", str(config))
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert "  5 delayed retries (waiting for their backoff" in checked.stdout
        drained = command("drain", str(config), "--timeout", "40")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "moved 5 delayed retries to the ready list" in drained.stdout
        assert "ok: no reservation and no owner record" in drained.stdout
    finally:
        supervisor.stop()
    assert not client.exists(keys.delayed)
    ready = [envelope.decode(raw) for raw in client.lrange(keys.ready, 0, -1)]
    assert {item["pid"] for item in ready} == pids  # a PHP worker now sees every one
    assert {item["attempts"] for item in ready} == {1}
    assert command("check", str(config)).returncode == 0
    # A PHP queue-5 worker finishes them: nothing was left where only a supervisor looks.
    from tests.queue5 import Queue5Consumer

    php = Queue5Consumer(client, keys.queue, namespace=NAMESPACE)
    taken = php.receive(10, 0)
    assert {message.pid for message in taken} == pids
    for message in taken:
        php.commit(message)
    assert client.llen(keys.ready) == client.llen(keys.processing) == 0
