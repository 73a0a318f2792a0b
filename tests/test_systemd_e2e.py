"""The supervisor's systemd notifications, end to end, under a fake NOTIFY_SOCKET."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from support.envelopes import publish
from support.supervision import Supervisor, wait_for, write_config

pytestmark = pytest.mark.slow  # every test here takes a second or more


@pytest.fixture
def notify_socket(tmp_path: Path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    yield path, sock
    sock.close()


def received(sock: socket.socket, into: list[str]) -> list[str]:
    while True:
        try:
            into.append(sock.recv(4096).decode())
        except BlockingIOError:
            return into


def test_ready_status_watchdog_then_stopping_in_order(tmp_path, redis_url, notify_socket):
    import redis

    path, sock = notify_socket
    client = redis.Redis.from_url(redis_url)
    publish(client, [{"n": n} for n in range(20)])
    config = write_config(tmp_path, redis_url, job={"coroutines": 2, "prefetch": 4})
    supervisor = Supervisor(config, tmp_path, redis_url, NOTIFY_SOCKET=str(path),
                            WATCHDOG_USEC="400000", WATCHDOG_PID="")
    try:
        messages: list[str] = []
        wait_for(lambda: any("WATCHDOG=1" in m for m in received(sock, messages)), 20,
                 "a watchdog ping")
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(20) == 0
        received(sock, messages)
    finally:
        supervisor.stop()
        client.close()
    kinds = [m.split("=")[0] for m in messages]
    assert kinds.count("READY") == 1
    assert kinds.index("READY") < kinds.index("STATUS") < kinds.index("STOPPING")
    assert kinds[-1] == "STOPPING" or kinds.index("STOPPING") > kinds.index("WATCHDOG")
    status = next(m for m in messages if m.startswith("STATUS="))
    assert "buffer" in status and "jobs/s" in status
