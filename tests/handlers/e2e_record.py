"""A handler for end-to-end tests: records what happens to each message in files.

Environment: E2E_DIR (where the files go), E2E_REDIS (URL, for the on_success check),
E2E_NAMESPACE, E2E_CLUSTER (set: E2E_REDIS is a Redis Cluster node), E2E_HANG_ALWAYS
(hang on every message, for the bounded-stop test), E2E_INIT_SLEEP (seconds init() takes,
after writing "<pid>" to the file "init").
Payload flags: {"sleep": seconds}, {"fail": true}, {"crash": true} (SIGKILL the process),
{"hang": true}, {"grow": MiB}, {"env": true} (the environment's names to the file "environ").
"""

from __future__ import annotations

import os
import signal
import time

DIR = os.environ.get("E2E_DIR", ".")
_kept: list[bytearray] = []


def _append(name: str, line: str) -> None:
    # One write() per line on an O_APPEND file: concurrent handler processes never interleave.
    fd = os.open(os.path.join(DIR, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def init() -> None:
    if os.environ.get("E2E_INIT_SLEEP"):
        _append("init", str(os.getpid()))
        time.sleep(float(os.environ["E2E_INIT_SLEEP"]))


def handle(message) -> None:
    payload = message.payload
    _append("started", f"{message.pid} {message.attempts} {os.getpid()}")
    if os.environ.get("E2E_HANG_ALWAYS") or payload.get("hang"):
        while True:
            time.sleep(3600)
    if payload.get("env"):
        for name in sorted(os.environ):
            _append("environ", name)
    if payload.get("crash"):
        os.kill(os.getpid(), signal.SIGKILL)
    if payload.get("grow"):  # keep this many MiB alive in the process (recycling by RSS)
        _kept.append(bytearray(payload["grow"] * 2**20))
    if payload.get("sleep"):
        time.sleep(payload["sleep"])
    if payload.get("fail"):
        raise RuntimeError(f"asked to fail ({message.pid})")
    _append("handled", message.pid)


def on_success(message) -> None:
    """Checks in Redis that the commit really happened before this hook ran."""
    url = os.environ.get("E2E_REDIS")
    state = "unchecked"
    if url:
        import redis

        cluster = bool(os.environ.get("E2E_CLUSTER"))
        client = (redis.RedisCluster if cluster else redis.Redis).from_url(url)
        ns = os.environ.get("E2E_NAMESPACE", "utopia-queue")
        key = f"{ns}.owners.{message.queue}.{message.pid}"
        state = "early" if client.exists(key) else "confirmed"
        client.close()
    _append("succeeded", f"{message.pid} {state}")
