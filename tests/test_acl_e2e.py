"""The Redis ACL users of ``broker.redis.acl`` against a real redis-server: the job and every
operator command run end to end, each as its own user, and ``ACL LOG`` stays empty (no command
and no key was denied). The default user is switched off, so nothing can quietly run as it.

The users are created the way docs/acl.md says: ``python -m supervisor acl JOB`` piped into
``redis-cli``. A command missing from a list fails this test (its denial is logged, and the
step that needed it fails), as ``test_a_missing_command_is_denied_and_logged`` shows.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest
import redis

from broker import envelope
from broker.base import BrokerError
from broker.redis import RedisBroker, acl
from broker.redis.connection import NO_CLIENT_INFO
from broker.redis.keys import QueueKeys
from support import processes
from support.servers import redis_server_version
from support.supervision import NAMESPACE, ROOT, Supervisor, lines, wait_for, write_config

#: The users' read-only and write-only key patterns (%R~, %W~) came in Redis 7.0.
pytestmark = pytest.mark.skipif(
    redis_server_version()[0] == "redis" and redis_server_version()[1] < (7, 0),
    reason="the ACL users' %R~ and %W~ key patterns need Redis 7.0 or later")

PASSWORD = "s3cret-pw"
ADMIN = ("admin", "admin-pw")


def admin_client(port: int) -> redis.Redis:
    """An admin user of our own; the default user is switched off."""
    first = redis.Redis(port=port)
    first.execute_command("ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "+@all", "~*", "&*")
    first.close()
    admin = redis.Redis(port=port, username=ADMIN[0], password=ADMIN[1])
    admin.execute_command("ACL", "SETUSER", "default", "off")
    return admin


def environ() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("QUEUE_BROKER_URL", None)
    return env


def supervisor_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT, env=environ(),
                          capture_output=True, text=True, timeout=90)


def create_users(port: int, conf: Path, admin: tuple[str, str] | None = ADMIN) -> None:
    """``python -m supervisor acl JOB | sed s/<password>/.../ | redis-cli``, as docs/acl.md."""
    printed = supervisor_command("acl", str(conf))
    assert printed.returncode == 0, printed.stderr
    login = ["--user", admin[0], "--pass", admin[1], "--no-auth-warning"] if admin else []
    created = subprocess.run(
        ["redis-cli", "-p", str(port), *login],
        input=printed.stdout.replace(acl.PASSWORD, PASSWORD), capture_output=True, text=True,
        check=True,
    )
    assert created.stdout.split() == ["OK"] * len(printed.stdout.splitlines()), created.stdout


def job_files(directory: Path, port: int, queue: str, database: int = 0,
              **broker: object) -> dict[str, Path]:
    """One job file per user: the same job, each with its own user in the URL."""
    made = {}
    for role in acl.BY_NAME:
        (directory / role).mkdir()
        url = f"redis://{acl.user_name(queue, role)}:{PASSWORD}@127.0.0.1:{port}/{database}"
        made[role] = write_config(
            directory / role, url, broker=broker,
            job={"queue": queue, "coroutines": 2, "prefetch": 20, "max_attempts": 2,
                 "job_ttl": 3600},
            supervisor={"lease": 3, "maintenance_interval": 1, "shutdown_deadline": 10},
        )
    return made


def denied(admin: redis.Redis) -> list[dict]:
    return admin.acl_log()


def script_loads(admin: redis.Redis) -> int:
    return int(admin.info("commandstats").get("cmdstat_script|load", {}).get("calls", 0))


def kill_family(supervisor: Supervisor) -> None:
    for process in supervisor.family():
        processes.kill(process)
    supervisor.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_job_and_every_operator_command_run_as_their_acl_users(tmp_path, own_redis_server):
    port = own_redis_server.port
    admin = admin_client(port)
    queue = f"acl-{uuid.uuid4().hex[:8]}"  # drain finds supervisors by queue: ours only
    keys = QueueKeys(NAMESPACE, queue)
    conf = job_files(tmp_path, port, queue)
    create_users(port, conf["job"])
    admin.acl_log_reset()
    handled = lambda: set(lines(tmp_path / "handled"))  # noqa: E731
    started = lambda: [line.split()[0] for line in lines(tmp_path / "started")]  # noqa: E731

    def until(condition, timeout: float, what: str) -> None:
        """wait_for, failing at once (naming it) when anything was denied meanwhile."""
        def done() -> bool:
            assert denied(admin) == [], f"denied while waiting for {what}"
            return bool(condition())
        wait_for(done, timeout, what)

    running: list[Supervisor] = []

    def start() -> Supervisor:
        running.append(Supervisor(conf["job"], tmp_path, ""))  # "": the handler uses no Redis
        return running[-1]

    def publish(payloads: list[dict]) -> list[str]:
        source = tmp_path / f"publish-{secrets.token_hex(4)}.jsonl"
        source.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in payloads))
        done = supervisor_command("publish", str(conf["publish"]), str(source), "--verbose")
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()[1:]

    def operate(command: str, *args: str) -> subprocess.CompletedProcess[str]:
        return supervisor_command(command, str(conf[command]), *args)

    try:
        # 1. Published work, a failing job, malformed bytes, a keyed message and a
        #    reservation a dead consumer left expired (as producers and PHP workers leave them).
        pids = publish([{"n": n} for n in range(30)])
        [failing] = publish([{"fail": True}])
        admin.lpush(keys.ready, b"{not json")
        keyed_pid, raw = envelope.build(queue, {"keyed": True})
        admin.set(keys.pending("k1"), keyed_pid)
        admin.lpush(keys.ready, orjson.dumps({**orjson.loads(raw), "key": "k1"}))
        reserved_pid, raw = envelope.build(queue, {"reserved": True})
        reservation = keys.reservation(secrets.token_hex(16))
        admin.lpush(reservation, raw)
        admin.zadd(keys.reservations, {reservation: admin.time()[0] - 10})
        first = start()
        until(lambda: {*pids, keyed_pid, reserved_pid} <= handled(), 60, "the first batch")
        until(lambda: admin.lrange(keys.failed, 0, -1) == [failing.encode()], 30,
                 "the failing job in failed")
        assert admin.lrange(keys.poison, 0, -1) == [b"{not json"]
        until(lambda: not admin.exists(keys.pending("k1")), 10, "the marker freed")
        assert admin.zcard(keys.reservations) <= 1  # at most the idle wait's own

        # 2. The script cache is lost: the job loads its scripts again (SCRIPT LOAD).
        loads = script_loads(admin)
        admin.script_flush()
        more = publish([{"n": n} for n in range(10)])
        until(lambda: set(more) <= handled(), 30, "work after SCRIPT FLUSH")
        assert script_loads(admin) > loads

        # 3. A supervisor dies holding work; status and check see it; the next supervisor's
        #    maintenance recovers it once the claims lapse.
        slow = publish([{"n": n, "sleep": 0.3} for n in range(20)])
        until(lambda: set(slow) & set(started()), 30, "slow work started")
        kill_family(first)
        assert admin.llen(keys.processing) > 0
        shown = operate("status", "--json")
        assert shown.returncode == 0, shown.stderr
        assert orjson.loads(shown.stdout)["processing"] > 0
        assert operate("status").returncode == 0
        checked = operate("check")
        assert checked.returncode == 1 and "owner records" in checked.stdout, checked.stdout
        second = start()
        until(lambda: set(slow) <= handled(), 60, "the dead supervisor's work recovered")

        # 4. Another dies holding jobs on their last attempt: the recover command sends them
        #    to dead once their claims lapse; retry brings them and the failed job back.
        last = []
        for n in range(6):
            pid, raw = envelope.build(queue, {"n": n, "sleep": 0.5})
            admin.lpush(keys.ready, envelope.requeued(envelope.decode(raw), 1))
            last.append(pid)
        until(lambda: set(last) & set(started()), 30, "last-attempt work started")
        kill_family(second)
        held = [pid.decode() for pid in admin.lrange(keys.processing, 0, -1)]
        until(lambda: not any(admin.exists(keys.claim(pid)) for pid in held), 10,
                 "the claims to lapse")
        recovered = operate("recover")
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert admin.llen(keys.dead) > 0, recovered.stdout
        # failed, dead and poison, each as its user: read, dry runs, a delete and a retry.
        for command, *args in (("failed", "list", "--json"), ("failed", "show", failing),
                               ("dead", "list"), ("failed", "delete", "--all", "--dry-run"),
                               ("dead", "retry", "--count", "1", "--dry-run"),
                               ("dead", "retry", "--count", "1"), ("poison", "list"),
                               ("poison", "show", "0"), ("poison", "delete", "--all",
                                                         "--dry-run")):
            done = operate(command, *args)
            assert done.returncode == 0, f"{command} {args}: {done.stdout}{done.stderr}"
        gone = operate("failed", "delete", "no-such-pid")
        assert gone.returncode == 1 and "untouched" in gone.stdout, gone.stderr
        retried = operate("retry", "--from", "dead", "--reset-attempts")
        assert retried.returncode == 0 and "moved" in retried.stdout, retried.stderr
        assert admin.llen(keys.dead) == 0
        assert operate("retry").returncode == 0
        assert admin.llen(keys.failed) == 0

        # 5. The last supervisor finishes; drain stops it and checks; check agrees.
        start()
        until(lambda: set(last) <= handled(), 60, "the retried jobs")
        # A job that runs a while: the job's user writes the copy of what runs, status's
        # user reads it.
        publish([{"n": 99, "sleep": 5}])

        def shown_running() -> bool:
            # The live supervisor's copy (one killed earlier may have left one of its own
            # until its lease ends: status lists only live records).
            live = operate("status", "--json")
            assert live.returncode == 0, live.stderr
            return any(record["running"] for record in orjson.loads(live.stdout)["supervisors"])

        until(shown_running, 15, "status to show the running job")
        until(lambda: admin.lrange(keys.failed, 0, -1) == [failing.encode()], 30,
                 "the failing job in failed again")
        drained = operate("drain", "--timeout", "40")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "stopping 1 supervisors" in drained.stdout
        assert operate("check").returncode == 0
        state = orjson.loads(operate("status", "--json").stdout)
        assert (state["ready"], state["processing"], state["dead"]) == (0, 0, 0)
        assert (state["failed"], state["poison"]) == (1, 1)
    finally:
        for supervisor in running:
            supervisor.stop()
    assert denied(admin) == []
    admin.close()


def test_a_missing_command_is_denied_and_logged(tmp_path, own_redis_server):
    port = own_redis_server.port
    admin = admin_client(port)
    keys = QueueKeys(NAMESPACE, "acl-missing")
    role = acl.BY_NAME["job"]
    user = acl.user_name(keys.queue, "job")
    rules = [rule for rule in acl.rules(role, keys, PASSWORD) if rule != "+script|load"]
    admin.execute_command("ACL", "SETUSER", user, *rules)
    admin.acl_log_reset()

    async def receive() -> None:
        broker = RedisBroker(f"redis://{user}:{PASSWORD}@127.0.0.1:{port}/0", keys.queue)
        try:
            await broker.connect()
            await broker.receive(10, 0)  # a fresh server: reserve.lua must be loaded first
        finally:
            await broker.close()

    with pytest.raises(BrokerError, match="permission"):
        asyncio.run(receive())
    [entry] = denied(admin)
    assert (entry["reason"], entry["object"], entry["username"]) == ("command", "script|load",
                                                                     user)
    admin.close()


def test_a_user_reaches_no_other_queue_and_no_other_command(own_redis_server):
    port = own_redis_server.port
    admin = admin_client(port)
    keys, other = QueueKeys(NAMESPACE, "mine"), QueueKeys(NAMESPACE, "other")
    user = acl.user_name(keys.queue, "job")
    admin.execute_command("ACL", "SETUSER", user, *acl.rules(acl.BY_NAME["job"], keys, PASSWORD))
    job = redis.Redis(port=port, username=user, password=PASSWORD,
                      **NO_CLIENT_INFO)  # no CLIENT SETINFO, as ours
    job.lpush(keys.ready, b"x")  # its own queue: allowed
    read_other = job.register_script("return redis.call('LLEN', ARGV[1])")
    attempts = [
        lambda: job.llen(other.ready),
        lambda: read_other(args=[other.ready]),  # a script's keys are checked too
        lambda: job.keys("*"),
        lambda: job.eval("return 1", 0),
        lambda: job.flushall(),
        lambda: job.config_get("dir"),
    ]
    for attempt in attempts:  # NOPERM; from inside a script: "can't access ... keys"
        with pytest.raises(redis.exceptions.ResponseError, match=r"permission|can't access"):
            attempt()
    assert len(denied(admin)) == len(attempts)
    job.close()
    admin.close()


@pytest.mark.slow
def test_a_database_other_than_0_adds_select(tmp_path, own_redis_server):
    port = own_redis_server.port
    admin = admin_client(port)
    conf = job_files(tmp_path, port, "acl-db", database=3)
    create_users(port, conf["job"])
    admin.acl_log_reset()
    source = tmp_path / "one.jsonl"
    source.write_text('{"n": 1}\n')
    done = supervisor_command("publish", str(conf["publish"]), str(source))
    assert done.returncode == 0, done.stderr
    assert denied(admin) == []
    db3 = redis.Redis(port=port, db=3, username=ADMIN[0], password=ADMIN[1])
    assert db3.llen(QueueKeys(NAMESPACE, "acl-db").ready) == 1
    db3.close()
    admin.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_acl_users_on_a_redis_cluster(tmp_path, redis_cluster):
    """The same users plus the Cluster's commands, created on every node: the job, a SCRIPT
    FLUSH on every node, and the operator commands; no node logs a denial."""
    queue, namespace = f"acl-{uuid.uuid4().hex[:8]}", "{acl}"
    keys = QueueKeys(namespace, queue)
    port = redis_cluster.nodes[0].port
    conf = job_files(tmp_path, port, queue, cluster=True, namespace=namespace)
    for node in redis_cluster.nodes:  # ACL users are per node; the default user stays on here
        create_users(node.port, conf["job"], admin=None)
        node.client.acl_log_reset()
    admin = redis.RedisCluster(host="127.0.0.1", port=port)

    def logged() -> list[dict]:
        return [entry for node in redis_cluster.nodes for entry in denied(node.client)]

    def until(condition, timeout: float, what: str) -> None:
        def done() -> bool:
            assert logged() == [], f"denied while waiting for {what}"
            return bool(condition())
        wait_for(done, timeout, what)

    def operate(command: str, *args: str) -> subprocess.CompletedProcess[str]:
        done = supervisor_command(command, str(conf[command]), *args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    source = tmp_path / "jobs.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"n": n}) + b"\n" for n in range(20))
                       + b'{"fail": true}\n')
    pids = operate("publish", str(source), "--verbose").stdout.splitlines()[1:]
    supervisor = Supervisor(conf["job"], tmp_path, "", namespace=namespace)
    try:
        handled = lambda: set(lines(tmp_path / "handled"))  # noqa: E731
        until(lambda: set(pids[:-1]) <= handled(), 60, "the published work")
        until(lambda: admin.llen(keys.failed) == 1, 30, "the failing job in failed")
        redis_cluster.flush_scripts()
        more = operate("publish", str(source), "--verbose").stdout.splitlines()[1:]
        until(lambda: set(more[:-1]) <= handled(), 60, "work after SCRIPT FLUSH")
        assert orjson.loads(operate("status", "--json").stdout)["ready"] == 0
        operate("recover")
        operate("failed", "list")
        operate("failed", "retry", "--all")
        until(lambda: admin.llen(keys.failed) == 2, 30, "the retried jobs failed again")
        operate("retry")
        until(lambda: admin.llen(keys.failed) == 2, 30, "the retried job failed again")
        assert "stopping 1 supervisors" in operate("drain", "--timeout", "40").stdout
        operate("check")  # after the drain: a running supervisor's idle wait is registered
    finally:
        supervisor.stop()
    assert logged() == []
    admin.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_dashboard_reads_every_page_and_acts_as_its_acl_user(tmp_path, own_redis_server):
    """The dashboard with only its user: the sampler, every page and every action; a denial
    anywhere is in ACL LOG (and on the page as a broker error)."""
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    import html
    import re

    from broker.failure import Failure
    from support.dashboard import Dashboard

    port = own_redis_server.port
    admin = admin_client(port)
    queue = f"acl-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(NAMESPACE, queue)
    conf = job_files(tmp_path, port, queue)
    create_users(port, conf["job"])
    for n in range(3):
        admin.lpush(keys.ready, envelope.build(queue, {"n": n})[1])
    f1, f2, d1, p1 = (envelope.new_pid() for _ in range(4))  # pids a page may name
    for pid, source in ((f1, keys.failed), (f2, keys.failed), (d1, keys.dead)):
        admin.set(keys.job(pid), orjson.dumps({**orjson.loads(envelope.build(queue, {})[1]),
                                               "pid": pid}))
        admin.set(keys.error(pid), Failure("ValueError", f"boom {pid}", attempt=2).encode())
        admin.lpush(source, pid)
    admin.lpush(keys.poison, b"{not json")
    admin.lpush(keys.processing, p1)
    admin.set(keys.owner(p1), "tok")
    admin.set(keys.claim(p1), "tok", ex=60)
    # Due in an hour: one overdue would (rightly) be shown as unattended, not "ok".
    admin.zadd(keys.delayed, {b"e": int(admin.time()[0]) + 3600})
    admin.zadd(keys.reservations, {keys.reservation("r1"): 2_000_000_000})
    admin.lpush(keys.reservation("r1"), b"x")
    admin.hset(keys.supervisor_tokens, "tok", f"{int(admin.time()[0])} c1")
    admin.set(keys.supervisor("c1"), "elsewhere.example 123", ex=60)
    admin.set(keys.stat("success"), 5)
    admin.acl_log_reset()
    dashboard = Dashboard([conf["dashboard"]], tmp_path, token="t")
    try:
        def overview() -> str:
            assert denied(admin) == [], dashboard.output()
            found = re.search(r'<tr id="queue-0".*?</tr>', dashboard.client.get(
                "/live/overview")[1], re.S)
            return html.unescape(re.sub(r"<[^>]+>", " ", found.group())) if found else ""

        client = dashboard.client
        assert client.login("t") == 303  # every page needs the login
        wait_for(lambda: " 3 " in overview() and "ok" in overview(), 30, "a sample")
        for path in ("/", "/q/0", "/live/q/0", "/q/0/list/failed", "/q/0/list/dead",
                     "/q/0/list/poison", f"/q/0/list/failed?pid={f2}", f"/q/0/job?pid={f1}",
                     f"/q/0/job?pid={p1}", "/q/0/list/failed?error=Value&message=boom&payload=p",
                     "/q/0/list/poison?payload=json", "/q/0/list/dead?message=boom",
                     "/q/0/bulk/failed?action=retry&error=ValueError",
                     f"/q/0/confirm?source=failed&pid={f2}"):
            status, body = dashboard.client.get(path)
            assert status == 200 and 'class="bad"' not in body, (path, body[-3000:])
            assert denied(admin) == [], path
        for fields, said in (
                ({"action": "retry", "source": "failed", "pid": f1}, "moved from failed"),
                ({"action": "delete", "source": "failed", "pid": f2}, "deleted from failed"),
                ({"action": "retry", "source": "dead", "pid": d1}, "moved from dead"),
                ({"action": "delete", "source": "poison", "count": "1"}, "1 oldest poison"),
                ({"action": "drain", "consumer": "c1"}, "runs on another host")):
            status, body = client.act("/q/0", fields)  # a drain form of the page
            assert status == 200 and said in body, (fields, body[-2000:])
            assert denied(admin) == [], fields
        assert admin.llen(keys.failed) == admin.llen(keys.dead) == admin.llen(keys.poison) == 0
        assert admin.llen(keys.ready) == 5
        admin.script_flush()  # the user loads its scripts again (SCRIPT LOAD)
        wait_for(lambda: " 5 " in overview(), 30, "a sample after SCRIPT FLUSH")
        assert "NOPERM" not in dashboard.output() and "permission" not in dashboard.output()
    finally:
        dashboard.stop()
    assert denied(admin) == []
    admin.close()
