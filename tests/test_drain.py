"""``drain`` end to end: a real supervisor busy on a queue is found through its record in the
broker and stopped, and afterwards no reservation or owner record of the queue remains (the
rollback check). A supervisor of the same queue name on another Redis is left alone."""

from __future__ import annotations

import signal
import socket
import uuid

import orjson
import pytest
import redis

from broker import envelope
from broker.redis.keys import QueueKeys
from supervisor.ops.drain import is_supervisor_of
from support import processes
from support.operator import command
from support.supervision import NAMESPACE, Supervisor, lines, wait_for, write_config


def test_titles_of_supervisors_and_not_of_their_handlers():
    assert is_supervisor_of("queue-supervisor: jobs running [buffer 3/10, 1/2 busy]", "jobs")
    assert is_supervisor_of("queue-supervisor: jobs starting", "jobs")
    assert not is_supervisor_of("queue-supervisor: jobs handler 0 busy", "jobs")
    assert not is_supervisor_of("queue-supervisor: jobs-2 running", "jobs")
    assert not is_supervisor_of("queue-supervisor: fork server", "jobs")


@pytest.mark.slow
def test_drain_stops_the_supervisor_and_leaves_no_reservation_or_owner(
    tmp_path, redis_url, client
):
    queue = f"drain-{uuid.uuid4().hex[:8]}"  # other tests' supervisors must not match
    keys = QueueKeys(NAMESPACE, queue)
    # 0.05 s each: ~7 s of work is left when the drain starts, so it stops midway even on a
    # loaded box (at 0.01 s the last ~1.4 s could finish before the drain command was up).
    built = [envelope.build(queue, {"n": n, "sleep": 0.05}) for n in range(300)]
    client.lpush(keys.ready, *(raw for _, raw in built))
    config = write_config(tmp_path, redis_url, job={"queue": queue, "coroutines": 2,
                                                   "prefetch": 40})
    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        wait_for(lambda: list(client.scan_iter(match=keys.supervisor("") + "*")), 15,
                 "the supervisor's record")
        wait_for(lambda: len(lines(tmp_path / "handled")) >= 20, 30, "some progress")
        drained = command("drain", str(config), "--timeout", "40")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert f"stopping 1 supervisors of {queue}: pids {supervisor.pid}" in drained.stdout
        assert "ok: no reservation and no owner record" in drained.stdout
        assert supervisor.process.poll() == 0, supervisor.output()

        assert client.zcard(keys.reservations) == 0
        assert not list(client.scan_iter(match=keys.owner("") + "*"))
        assert client.llen(keys.processing) == 0
        # Every message was handled or is back in the ready list: nothing was lost.
        ready = {orjson.loads(raw)["pid"] for raw in client.lrange(keys.ready, 0, -1)}
        handled = set(lines(tmp_path / "handled"))
        assert ready | handled == {pid for pid, _ in built}
        assert ready and handled  # it really stopped midway

        checked = command("check", str(config))
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        supervisor.stop()


@pytest.mark.slow
def test_check_and_drain_fail_while_an_idle_supervisor_runs(tmp_path, redis_url, client):
    """Issue 39.2 as found: an idle supervisor on the queue (nothing reserved, owned or
    delayed) made ``check`` say "ok". Now it fails naming host and pid, passes at once
    after a graceful stop, and fails for a supervisor killed with SIGKILL until its lease
    lapsed; ``drain`` waits for that and then reports success."""
    queue = f"idle-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(NAMESPACE, queue)
    # A lease of 15 s, not 3: after the SIGKILL the record must outlive the start of the
    # next command on a loaded machine (CI saw a 3 s lease lapse first).
    config = write_config(tmp_path, redis_url, job={"queue": queue},
                          supervisor={"lease": 15})
    here = socket.gethostname()
    for stop in ("SIGTERM", "SIGKILL"):
        supervisor = Supervisor(config, tmp_path, redis_url)
        try:
            wait_for(lambda: client.exists(keys.supervisor_tokens)
                     and list(client.scan_iter(match=keys.supervisor("") + "*")), 15,
                     "the supervisor's record")
            checked = command("check", str(config))
            assert checked.returncode == 1, checked.stdout + checked.stderr
            assert f"host {here} pid {supervisor.pid} (" in checked.stdout
            assert "  supervisors   1" in command("status", str(config)).stdout
            if stop == "SIGTERM":
                supervisor.signal(signal.SIGTERM)
                assert supervisor.wait(30) == 0, supervisor.output()
                checked = command("check", str(config))  # at once: nothing waits a lease
                assert checked.returncode == 0, checked.stdout + checked.stderr
                continue
            for process in supervisor.family():
                process.kill()
            supervisor.wait(10)
            checked = command("check", str(config))  # its record lives until its lease
            assert checked.returncode == 1 and f"pid {supervisor.pid} (" in checked.stdout
            drained = command("drain", str(config), "--timeout", "40")
            assert drained.returncode == 0, drained.stdout + drained.stderr
            assert "ok: no reservation and no owner record" in drained.stdout
        finally:
            supervisor.stop()


@pytest.mark.slow
def test_rollback_to_php_workers_as_the_readme_says(tmp_path, redis_url, client):
    """docs/php-queue5.md "Rolling back to PHP workers": PHP queue-5 workers (the model, with queue
    5's default reapAfter of 25 h, so it recovers nothing of ours by itself) consume beside a
    supervisor; `drain` stops the supervisor and hands its work over; the PHP worker then finishes
    the queue. Every message runs, nothing is stranded, the counters agree."""
    from tests.queue5 import Queue5Consumer

    queue = f"rollback-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(NAMESPACE, queue)
    # 0.05 s each: ~7 s of work is left when the drain starts, so it stops midway even on a
    # loaded box (at 0.01 s the last ~1.4 s could finish before the drain command was up).
    built = [envelope.build(queue, {"n": n, "sleep": 0.05}) for n in range(300)]
    client.lpush(keys.ready, *(raw for _, raw in built))
    config = write_config(tmp_path, redis_url, job={"queue": queue, "coroutines": 2,
                                                   "prefetch": 40})
    php = Queue5Consumer(client, queue, namespace=NAMESPACE)  # reap_after 90,000 s
    php_ran: list[str] = []

    def php_batch(n: int) -> int:
        messages = php.receive(n, 0)
        for message in messages:
            php.commit(message)
            php_ran.append(message.pid)
        return len(messages)

    supervisor = Supervisor(config, tmp_path, redis_url)
    try:
        wait_for(lambda: list(client.scan_iter(match=keys.supervisor("") + "*")), 15,
                 "the supervisor's record")
        wait_for(lambda: len(lines(tmp_path / "handled")) >= 20, 30, "some progress")
        php_batch(10)  # a mixed fleet for a moment
        drained = command("drain", str(config), "--timeout", "40")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "ok: no reservation and no owner record" in drained.stdout
    finally:
        supervisor.stop()
    while php_batch(50):
        pass
    php.maintain()
    handled = set(lines(tmp_path / "handled"))
    assert handled | set(php_ran) == {pid for pid, _ in built}
    assert handled and len(php_ran) > 10  # both sides ran some
    assert client.llen(keys.ready) == client.llen(keys.processing) == 0
    assert client.zcard(keys.reservations) == 0
    for kind in ("reservations", "owners", "claims", "jobs"):
        assert not list(client.scan_iter(match=f"{NAMESPACE}.{kind}.{queue}.*")), kind
    total, success, processing = (int(client.get(keys.stat(name)) or 0)
                                  for name in ("total", "success", "processing"))
    assert processing == 0 and success == 300 + len(handled & set(php_ran))
    assert total >= success  # a delivery released at the stop is claimed again: counted twice


@pytest.mark.slow
def test_drain_stops_only_the_supervisors_of_the_redis_given(tmp_path, redis_url, client):
    """Two supervisors of one queue name on two Redis servers: draining one leaves the
    other running (a title search would find both)."""
    from support.servers import RedisServer

    other_server = RedisServer().start()
    try:
        queue = f"drain-{uuid.uuid4().hex[:8]}"
        mine_dir, other_dir = tmp_path / "mine", tmp_path / "other"
        mine_dir.mkdir()
        other_dir.mkdir()
        mine = Supervisor(write_config(mine_dir, redis_url, job={"queue": queue}),
                          mine_dir, redis_url)
        other = Supervisor(write_config(other_dir, other_server.url, job={"queue": queue}),
                           other_dir, other_server.url)
        keys = QueueKeys(NAMESPACE, queue)
        for url in (redis_url, other_server.url):
            connection = redis.Redis.from_url(url)
            wait_for(lambda c=connection: list(c.scan_iter(match=keys.supervisor("") + "*")),
                     15, "a record")
            connection.close()
        drained = command("drain", str(mine_dir / "job.toml"), "--timeout", "30")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert f"stopping 1 supervisors of {queue}: pids {mine.pid}" in drained.stdout
        assert mine.process.poll() == 0
        assert other.process.poll() is None  # another Redis: not ours to stop
    finally:
        for supervisor in (locals().get("mine"), locals().get("other")):
            if supervisor is not None:
                supervisor.stop()
        other_server.close()


@pytest.mark.slow
def test_rollback_leaves_nothing_owned_by_a_retired_supervisor(tmp_path, redis_url, client):
    """docs/php-queue5.md "Rolling back to PHP workers" with the faults that stranded work for a
    day: PHP queue-5 workers at queue 5's default ``reapAfter`` (25 h: they recover nothing of ours
    by themselves) run throughout, one of them a Workerman worker that never renews and holds a
    delivery past its claim; one supervisor is SIGKILLed holding deliveries (a handler hangs, the
    rest wait in its buffer); another is drained while its handler hangs past the shutdown deadline.
    ``drain`` stops the second (which requeues what its killed handler held), recovers the dead
    one's deliveries once its lease ran out (the registry names them ours, its record is gone), and
    never touches the Workerman worker's; ``check`` exits 0 with the PHP worker's delivery still in
    flight; the PHP workers finish the queue without waiting out any reapAfter."""
    from tests.queue5 import Queue5Consumer

    queue = f"rollback-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(NAMESPACE, queue)
    built = [envelope.build(queue, {"n": n}) for n in range(30)]
    client.lpush(keys.ready, *(raw for _, raw in built))
    supervisors = []
    for name, deadline in (("killed", 10), ("hung", 3)):
        workdir = tmp_path / name
        workdir.mkdir()
        config = write_config(workdir, redis_url, job={"queue": queue, "prefetch": 5},
                              supervisor={"shutdown_deadline": deadline})
        supervisors.append(Supervisor(config, workdir, redis_url, E2E_HANG_ALWAYS="1"))
    killed, hung = supervisors
    workerman = Queue5Consumer(client, queue, namespace=NAMESPACE, claim_ttl=1,
                               adapter="workerman")  # reapAfter 90,000 s, never renews
    try:
        for name in ("killed", "hung"):
            wait_for(lambda n=name: lines(tmp_path / n / "started"), 20, f"{name}'s handler")
        [long_running] = workerman.receive(1)
        wait_for(lambda: not client.exists(keys.claim(long_running.pid)), 10,
                 "the Workerman worker's claim to lapse (its handler still runs)")
        for process in killed.family():
            processes.kill(process)
        killed.process.wait(10)
        dead_held = [pid.decode() for pid in client.lrange(keys.processing, 0, -1)
                     if client.get(keys.owner(pid.decode())) != long_running.receipt.encode()]
        assert dead_held, "the supervisors hold nothing"

        drained = command("drain", str(tmp_path / "hung" / "job.toml"), "--timeout", "40")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert f"stopping 1 supervisors of {queue}: pids {hung.pid}" in drained.stdout
        assert "ok: no reservation and no owner record" in drained.stdout
        assert hung.process.poll() == 0, hung.output()
        checked = command("check", str(tmp_path / "hung" / "job.toml"))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "hold 1 reservations and owner records" in checked.stdout  # the PHP worker's

        # Nothing of the supervisors is left owned: the PHP worker's delivery is still its.
        assert client.lrange(keys.processing, 0, -1) == [long_running.pid.encode()]
        workerman.commit(long_running)
    finally:
        for supervisor in supervisors:
            supervisor.stop()
    php = Queue5Consumer(client, queue, namespace=NAMESPACE)  # Swoole, reapAfter 90,000 s
    ran = [long_running.pid]
    attempts = {}
    while messages := php.receive(10, 0):
        for message in messages:
            ran.append(message.pid)
            attempts[message.pid] = message.attempts
            php.commit(message)
    # The last sweep of ours (drain's, or a supervisor's) may still hold queue 5's reap lock,
    # and PHP then skips its sweep (maintain() answers None): let it lapse first.
    wait_for(lambda: not client.exists(keys.reap_lock), 60, "the last sweep's reap lock to lapse")
    assert php.maintain() == 0  # nothing stranded for queue 5's sweep to find
    assert sorted(ran) == sorted(pid for pid, _ in built)  # each once, by PHP
    killed_runs = {line.split()[0] for line in lines(tmp_path / "killed" / "started")}
    hung_runs = {line.split()[0] for line in lines(tmp_path / "hung" / "started")}
    assert {attempts[pid] for pid in killed_runs | hung_runs} == {1}  # the hung runs counted
    assert client.llen(keys.processing) == client.llen(keys.ready) == 0
    assert client.zcard(keys.reservations) == 0
    for kind in ("reservations", "owners", "claims", "jobs"):
        assert not list(client.scan_iter(match=f"{NAMESPACE}.{kind}.{queue}.*")), kind
    assert int(client.get(keys.stat("processing"))) == 0
    assert int(client.get(keys.stat("success"))) == 30
