"""docs/php-queue5.md "Rolling back to PHP workers", run word for word (issue 39): the commands of
its shell block, as an operator types them in the folder of ``job.toml``, against the queue-5 PHP
model at queue 5's default ``reapAfter`` and at a short one, with delayed retries waiting and
failure records kept beside failed jobs, and a second supervisor killed with SIGKILL just before.
Afterwards the PHP worker finishes the queue and nothing of this project is left but the failure
records beside the jobs they describe."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest
import redis

from broker import envelope
from broker.redis.keys import QueueKeys
from support.docs import block_after, commands
from support.supervision import NAMESPACE, ROOT, Supervisor, lines, wait_for, write_config
from tests.queue5 import REAP_AFTER, Queue5Consumer

HANDLER = "tests.handlers.fails_until:handle"
#: The kinds of key a finished queue-5 queue keeps (PHP's own leftovers included).
FINISHED_KINDS = {"queue", "processing", "failed", "dead", "poison", "jobs", "stats",
                  "reap-lock", "reap-cursor", "pending"}


def test_the_procedure_is_a_drain_then_a_check():
    assert procedure() == ["python -m supervisor drain job.toml",
                           "python -m supervisor check job.toml"]


@pytest.mark.slow
@pytest.mark.parametrize("reap_after", [REAP_AFTER, 5], ids=["default-reapAfter",
                                                            "short-reapAfter"])
def test_the_readme_rollback_word_for_word(tmp_path, redis_url, client, reap_after):
    queue = f"rollback-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(NAMESPACE, queue)
    log = tmp_path / "handled"

    def build(count: int, succeed_at: int, attempts: int = 0) -> list[tuple[str, bytes]]:
        built = [envelope.build(queue, {"n": n, "succeed_at": succeed_at, "log": str(log)})
                 for n in range(count)]
        return [(pid, envelope.encode({**orjson.loads(raw), "attempts": attempts}))
                for pid, raw in built]

    # Each fails once and waits 30 to 60 min for its retry; these fail on their last
    # attempt and go to failed with a failure record.
    delayed, failing = build(6, succeed_at=1), build(3, succeed_at=99, attempts=1)
    client.lpush(keys.ready, *(raw for _, raw in delayed + failing))
    config = write_config(tmp_path, redis_url, handler=HANDLER,
                          job={"queue": queue, "max_attempts": 2, "retry_backoff": 3600})
    assert config == tmp_path / "job.toml"
    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()
    killed = Supervisor(write_config(killed_dir, redis_url, handler=HANDLER,
                                     job={"queue": queue, "max_attempts": 2,
                                          "retry_backoff": 3600}), killed_dir, redis_url)
    running = Supervisor(config, tmp_path, redis_url)
    php = Queue5Consumer(client, queue, namespace=NAMESPACE, reap_after=reap_after)
    php_ran: dict[str, int] = {}

    def php_batch(n: int) -> int:
        taken = php.receive(n, 0)
        for message in taken:
            php.commit(message)  # the PHP handler succeeds
            php_ran[message.pid] = message.attempts
        return len(taken)

    try:
        wait_for(lambda: client.zcard(keys.delayed) == 6 and client.llen(keys.failed) == 3, 60,
                 "6 delayed retries and 3 failed jobs")
        assert all(client.exists(keys.error(pid)) for pid, _ in failing)  # failure records
        for process in killed.family():
            process.kill()  # a supervisor lost with its host: its record lasts a lease
        killed.wait(10)
        # 1. Start the PHP workers: they share the ready list with the running supervisor.
        fresh = build(20, succeed_at=0)
        client.lpush(keys.ready, *(raw for _, raw in fresh))
        php_batch(5)
        php.maintain()
        # 2. The page's commands, as written.
        for line in procedure():
            done = run_as_typed(line, tmp_path)
            assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
            assert "ok: no reservation and no owner record" in done.stdout, done.stdout
        assert running.process.poll() == 0, running.output()
    finally:
        running.stop()
        killed.stop()
    # 3. The PHP worker finishes the queue, the delayed retries with it (attempt 1).
    while php_batch(50):
        pass
    wait_for(lambda: not client.exists(keys.reap_lock), 60, "the last sweep's lock to lapse")
    assert php.maintain() == 0  # nothing stranded for queue 5's sweep either
    handled = {line.split()[0] for line in lines(log)}
    assert handled | set(php_ran) >= {pid for pid, _ in delayed + fresh}
    assert {php_ran[pid] for pid, _ in delayed} == {1}  # handed over, run by PHP, once
    assert client.llen(keys.ready) == client.llen(keys.processing) == 0
    assert sorted(pid.decode() for pid in client.lrange(keys.failed, 0, -1)) == \
        sorted(pid for pid, _ in failing)
    assert left_behind(client, keys) == [], (
        client.zrange(keys.reservations, 0, -1, withscores=True), client.time())


def procedure() -> list[str]:
    return commands(block_after("php-queue5.md", "## Rolling back to PHP workers"))


def run_as_typed(line: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``line`` in bash, in ``folder``, where ``python`` is this interpreter (as after
    ``. .venv/bin/activate``) and the job file's own URL is used."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "QUEUE_BROKER_URL")}
    env.update(PYTHONPATH=str(ROOT),
               PATH=os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", ""))))
    return subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=120)


def left_behind(client: redis.Redis, keys: QueueKeys) -> list[str]:
    """Keys of the queue beyond a finished queue-5 queue's: this project's (records, the
    token registry, the delayed set) or a delivery still in flight (reservations, owners,
    claims). Failure records beside the job records they describe are allowed: they expire
    with them; so are failure histories, which expire by themselves (a job retried by us
    and then committed by a PHP worker leaves its history until then)."""
    left = []
    prefix = f"{keys.namespace}."
    for raw in client.scan_iter(match=f"{prefix}*", count=1000):
        name = raw.decode()
        kind, _, rest = name[len(prefix):].partition(".")
        if not (rest == keys.queue or rest.startswith(keys.queue + ".")):
            continue  # another test's queue
        if kind in FINISHED_KINDS:
            continue
        if kind == "supervisor-errors" and client.exists(keys.job(rest[len(keys.queue) + 1:])):
            continue
        if kind == "supervisor-failures" and client.ttl(name) > 0:
            continue
        left.append(name)
    return sorted(left)
