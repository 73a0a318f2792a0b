"""systemd notifications, received on a fake notification socket (a bound datagram socket)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from supervisor import systemd


@pytest.fixture
def fake_systemd(tmp_path: Path):
    """A datagram socket where systemd's would be; yields (socket, its address)."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, str(path)
    sock.close()


def received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_each_call_sends_its_message(fake_systemd):
    sock, address = fake_systemd
    notifier = systemd.Notifier(address)
    assert notifier.ready()
    assert received(sock) == "READY=1"
    assert notifier.status("buffer 3/100,\n 250 jobs/s")
    assert received(sock) == "STATUS=buffer 3/100, 250 jobs/s"  # one line
    assert notifier.watchdog()
    assert received(sock) == "WATCHDOG=1"
    assert notifier.stopping()
    assert received(sock) == "STOPPING=1"
    notifier.close()


def test_abstract_socket_address():
    name = f"qs-test-{os.getpid()}-{os.urandom(4).hex()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        notifier = systemd.Notifier("@" + name)
        assert notifier.ready()
        assert received(sock) == "READY=1"
    finally:
        sock.close()


def test_without_notify_socket_nothing_is_sent():
    environ: dict[str, str] = {}
    notifier = systemd.Notifier.from_environ(environ)
    assert not notifier.enabled
    assert not notifier.ready() and not notifier.watchdog() and not notifier.stopping()
    assert notifier.watchdog_interval is None


def test_from_environ_reads_and_unsets_the_variables(fake_systemd):
    _, address = fake_systemd
    environ = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "30000000", "OTHER": "x"}
    notifier = systemd.Notifier.from_environ(environ)
    assert notifier.address == address
    assert notifier.watchdog_interval == 15.0
    assert environ == {"OTHER": "x"}  # handler processes forked later do not inherit them


def test_watchdog_interval_is_half_of_watchdog_usec():
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert systemd.watchdog_interval({}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert systemd.watchdog_interval(mine) == 1.0
    other = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert systemd.watchdog_interval(other) is None


def test_a_missing_socket_is_reported_once_and_never_raises(tmp_path, caplog):
    notifier = systemd.Notifier(str(tmp_path / "absent"))
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert len([r for r in caplog.records if "systemd notification" in r.message]) == 1


async def test_keepalive_sends_status_and_watchdog_from_the_loop(fake_systemd):
    sock, address = fake_systemd
    sock.setblocking(False)
    notifier = systemd.Notifier(address, watchdog_usec=20_000)  # a ping every 10 ms
    task = asyncio.create_task(
        systemd.keepalive(notifier, lambda: systemd.status_text(3, 100, 249.6))
    )
    messages: list[str] = []
    loop = asyncio.get_running_loop()
    while messages.count("WATCHDOG=1") < 2:
        messages.append((await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)).decode())
    task.cancel()
    assert messages[:2] == ["STATUS=buffer 3/100, 250 jobs/s", "WATCHDOG=1"]
