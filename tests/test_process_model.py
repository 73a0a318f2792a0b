"""The process model under faults: a loop that raises, a handler killed before it was ready,
the fork server killed, signals sent to the whole process group, titles, the environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import orjson
import psutil
import pytest

from support import processes
from support.envelopes import publish
from support.supervision import ROOT, lines, wait_for, write_config

pytestmark = pytest.mark.slow  # every test here takes a second or more


def handled(tmp_path) -> list[str]:
    return lines(tmp_path / "handled")


def json_lines(output: str) -> list[dict]:
    return [orjson.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.timeout(180)  # measured 25-45 s on a loaded 2-core machine
@pytest.mark.parametrize("target", [
    "receive", "settle", "renew", "maintain", "watch", "keepalive", "outcomes", "forkserver",
])
def test_a_loop_that_raises_stops_the_supervisor_with_a_traceback_and_loses_nothing(
    tmp_path, redis_url, client, supervisors, target
):
    pids = publish(client, [{"n": n, "sleep": 0.1} for n in range(20)])
    config = write_config(tmp_path, redis_url, supervisor={"lease": 3, "shutdown_deadline": 10,
                                                           "maintenance_interval": 0.2})
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    faulty = supervisors(config, redis_url, module=f"tests.faults {target}",
                         NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="1000000")
    began = time.monotonic()
    assert faulty.wait(30) == 4  # restarted by systemd (not in RestartPreventExitStatus)
    assert time.monotonic() - began < 25  # a bounded stop, not a hang
    errors = [e for e in json_lines(faulty.output()) if e["level"] == "error"]
    [failure] = [e for e in errors if "stopping (exit 4)" in e["message"]]
    assert "injected failure" in failure["exc"] and "Traceback" in failure["exc"]
    notify.close()
    # Nothing is lost: a healthy supervisor finishes the queue (what the faulty one held is
    # released at its stop or recovered after its lease).
    healthy = supervisors(config, redis_url)
    wait_for(lambda: set(handled(tmp_path)) >= set(pids), 40, "every message")
    wait_for(lambda: "consuming" in healthy.output(), 15, "the healthy one to be up")
    healthy.signal(signal.SIGTERM)
    assert healthy.wait(15) == 0


def test_a_handler_killed_before_it_was_ready_is_replaced(
    tmp_path, redis_url, client, supervisors
):
    pids = publish(client, [{"n": n} for n in range(5)])
    supervisor = supervisors(write_config(tmp_path, redis_url), redis_url,
                             E2E_INIT_SLEEP="1.0")
    [first] = wait_for(lambda: lines(tmp_path / "init"), 15, "the first init()")
    os.kill(int(first), signal.SIGKILL)  # the OOM killer, or a stray kill -9
    wait_for(lambda: set(handled(tmp_path)) == set(pids), 30, "every message")
    assert len(lines(tmp_path / "init")) == 2
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
    assert "died before it was ready" in supervisor.output()


def test_a_handler_that_always_dies_before_ready_stops_with_a_restartable_code(
    tmp_path, redis_url, supervisors
):
    supervisor = supervisors(write_config(tmp_path, redis_url), redis_url,
                             E2E_INIT_SLEEP="30")
    killed: set[str] = set()
    deadline = time.monotonic() + 40
    while supervisor.process.poll() is None and time.monotonic() < deadline:
        for pid in set(lines(tmp_path / "init")) - killed:
            killed.add(pid)
            os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)
    assert supervisor.wait(5) == 4  # not 3: systemd restarts it
    assert len(killed) == 5
    assert "died before it was ready, 5 times in a row" in supervisor.output()


def test_the_fork_server_killed_is_noticed_at_once_and_nothing_is_blamed(
    tmp_path, redis_url, client, supervisors
):
    [hung, *rest] = publish(client, [{"hang": True}] + [{"n": n} for n in range(5)])
    config = write_config(tmp_path, redis_url, job={"prefetch": 6},
                          supervisor={"shutdown_deadline": 20})
    supervisor = supervisors(config, redis_url)
    wait_for(lambda: lines(tmp_path / "started") and lines(tmp_path / "started")[-1]
             .startswith(hung), 15, "the hanging message to start")
    [server] = [p for p in supervisor.family()
                if processes.title(p).startswith("queue-supervisor: fork server")]
    began = time.monotonic()
    server.kill()
    assert supervisor.wait(10) == 4
    assert time.monotonic() - began < 5  # not the 20 s shutdown deadline
    assert "fork server" in supervisor.output()
    # The hung delivery was released, not failed: it comes back with attempts 0.
    # (Two handlers: the hanging message takes one of them again.)
    again = supervisors(write_config(tmp_path, redis_url, job={"prefetch": 2, "coroutines": 2}),
                        redis_url)
    wait_for(lambda: set(handled(tmp_path)) >= set(rest), 20, "the rest")
    wait_for(lambda: len(lines(tmp_path / "started")) >= 2 + len(rest), 20, "hung again")
    restarts = [line.split() for line in lines(tmp_path / "started") if line.startswith(hung)]
    assert [attempts for _, attempts, _ in restarts] == ["0", "0"]
    again.stop()


def test_a_signal_to_the_process_group_reaches_only_the_supervisor(tmp_path, redis_url):
    """`timeout`, shells and some container runtimes signal the whole group: the fork
    server and the handlers must not die of it; the supervisor stops them itself."""
    # Long blocking timeout and deadline: a stop that waited for either would take 30 s.
    config = write_config(tmp_path, redis_url, broker={"block_timeout": 30.0},
                          supervisor={"shutdown_deadline": 30})
    env = dict(os.environ, E2E_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-m", "supervisor", str(config)], cwd=ROOT,
                               env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(psutil.Process(process.pid).children(recursive=True)) == 3, 15,
                 "fork server, handler server and handler")
        time.sleep(0.5)  # idle, blocked in a receive
        began = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(20) == 0
        assert time.monotonic() - began < 10  # an idle job stops at once, not after 30 s
        output = process.stderr.read().decode()
        assert '"level":"error"' not in output and "fork server" not in output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_title_is_set_when_notify_socket_is_the_first_variable(tmp_path, redis_url):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"),
           **{k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"},
           "E2E_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    config = write_config(tmp_path, redis_url)
    process = subprocess.Popen([sys.executable, "-m", "supervisor", str(config)], cwd=ROOT,
                               env=env, stderr=subprocess.DEVNULL)
    try:
        notify.settimeout(15)
        while b"READY=1" not in notify.recv(4096):
            pass
        title = " ".join(psutil.Process(process.pid).cmdline())
        assert title.startswith("queue-supervisor: e2e running"), title
    finally:
        process.terminate()
        process.wait(15)
        notify.close()


def test_handlers_inherit_neither_the_broker_url_nor_the_notify_socket(
    tmp_path, redis_url, client, supervisors
):
    publish(client, [{"env": True}])
    config = write_config(tmp_path, redis_url)
    supervisor = supervisors(config, redis_url, QUEUE_BROKER_URL=redis_url,
                             NOTIFY_SOCKET=str(tmp_path / "nobody"))
    wait_for(lambda: lines(tmp_path / "environ"), 15, "the handler's environment")
    names = set(lines(tmp_path / "environ"))
    assert "E2E_DIR" in names  # the rest is inherited
    assert not names & {"QUEUE_BROKER_URL", "NOTIFY_SOCKET", "WATCHDOG_USEC"}
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0
