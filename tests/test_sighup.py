"""SIGHUP imports the handler code anew and replaces the handler processes with it (gunicorn's
HUP without preload_app), never kills anything silently."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import orjson
import psutil
import pytest

from support import processes
from support.envelopes import publish
from support.supervision import (
    ROOT,
    Supervisor,
    counter,
    lines,
    outstanding,
    wait_for,
    write_config,
)


def handled(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "handled")


def processes_of(tmp_path: Path, pids: list[str]) -> set[str]:
    """The handler processes that started these messages."""
    wanted = set(pids)
    return {line.split()[2] for line in lines(tmp_path / "started") if line.split()[0] in wanted}


@pytest.mark.slow
def test_sighup_replaces_the_handler_processes_and_loses_nothing(
    tmp_path, redis_url, client, supervisors
):
    config = write_config(tmp_path, redis_url, job={"coroutines": 2, "prefetch": 10})
    supervisor = supervisors(config, redis_url=redis_url)
    # Deliveries held in the handlers when the signal comes: they finish and are settled.
    before = publish(client, [{"n": n, "sleep": 0.3} for n in range(12)])
    wait_for(lambda: len(processes_of(tmp_path, before)) == 2, 15, "both handlers busy")
    old = processes_of(tmp_path, before)  # the two processes the signal finds
    supervisor.signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP received: reloading" in supervisor.output(), 10, "the reload line")
    after = publish(client, [{"n": n} for n in range(12, 24)])
    wait_for(lambda: len(handled(tmp_path)) == 24, 30, "every message")
    assert supervisor.process.poll() is None, supervisor.output()
    assert sorted(handled(tmp_path)) == sorted(before + after)
    new = processes_of(tmp_path, after)
    assert new and not new & old, (old, new)
    wait_for(lambda: counter(client, "success") == 24, 10, "all commits")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()
    assert outstanding(client) == 0 and counter(client, "processing") == 0
    assert "worker lost" not in supervisor.output()


def test_sighup_to_handler_processes_and_servers_kills_none(
    tmp_path, redis_url, client, supervisors
):
    # A terminal that hangs up signals every process of the foreground group: the handlers
    # and the servers leave it to the supervisor (which reloads, as above).
    config = write_config(tmp_path, redis_url, job={"coroutines": 1, "prefetch": 1})
    supervisor = supervisors(config, redis_url=redis_url)
    [first] = publish(client, [{"n": 1}])
    wait_for(lambda: handled(tmp_path) == [first], 15, "the first message")
    children = supervisor.family()[1:]
    assert len(children) == 3  # the fork server, the handler server, one handler process
    for process in children:
        processes.kill(process, signal.SIGHUP)
    [second] = publish(client, [{"n": 2}])
    wait_for(lambda: handled(tmp_path) == [first, second], 15, "a message after the hang-up")
    # The same handler process ran both: it was not killed and replaced.
    assert processes_of(tmp_path, [first]) == processes_of(tmp_path, [second])
    assert all(process.is_running() for process in children)
    assert "worker lost" not in supervisor.output()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()


# -- the handler code imported afresh (issue 38, item 5) ---------------------------------------

#: A handler module the tests edit: each run appends "<job> <VERSION> <process>" to the file
#: "versions" as it starts, then sleeps as long as the payload asks.
HANDLER_CODE = """\
import os
import time
{extra}
VERSION = {version!r}


def handle(message):
    line = f"{{message.pid}} {{VERSION}} {{os.getpid()}}\\n"
    fd = os.open(os.path.join(os.environ["E2E_DIR"], "versions"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, line.encode())
    os.close(fd)
    time.sleep(message.payload.get("sleep", 0))
"""

#: What a failed reload writes instead, and what its error line says.
BROKEN_CODE = {
    "syntax error": ("def handle(message:\n", "SyntaxError"),
    "raises at import": ("raise RuntimeError('no settings file')\n",
                         "RuntimeError: no settings file"),
    "missing function": ("def handler(message):\n    pass\n", "has no attribute handle"),
    "now async def": ("async def handle(message):\n    pass\n",
                      "is now an async def (it was a plain def)"),
}


def write_handler(tmp_path: Path, version: str, extra: str = "") -> Path:
    """The module ``reloadable`` in tmp_path/code (each version a different size: Python's
    cached bytecode is stale only if size and modification second both match)."""
    path = tmp_path / "code" / "reloadable.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(HANDLER_CODE.format(version=version, extra=extra))
    return path


def versions(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Job -> (the handler code's VERSION, the process) of every job started."""
    return {job: (version, process)
            for job, version, process in (line.split() for line in lines(tmp_path / "versions"))}


def start_reloadable(tmp_path: Path, redis_url: str, supervisors, **job: object) -> Supervisor:
    write_handler(tmp_path, "one")
    config = write_config(tmp_path, redis_url, handler="reloadable:handle",
                          job={"coroutines": 2, "prefetch": 4, **job})
    supervisor = supervisors(config, redis_url, PYTHONPATH=f"{ROOT}:{tmp_path / 'code'}")
    # The start's line, then the one that follows the signal handlers' installation.
    wait_for(lambda: messages(supervisor, "handler reloadable:handle loaded from"), 20,
             "the start")
    wait_for(lambda: messages(supervisor, "consuming e2e on"), 20, "the connection")
    return supervisor


def messages(supervisor: Supervisor, containing: str, level: str = "") -> list[str]:
    """The log lines (their message) that contain ``containing``, of ``level`` if given."""
    entries = [orjson.loads(line) for line in supervisor.output().splitlines()
               if line.startswith("{")]
    return [entry["message"] for entry in entries
            if containing in entry["message"] and level in ("", entry["level"])]


def handler_servers(supervisor: Supervisor) -> list[str]:
    """The titles of the supervisor's handler servers."""
    return sorted(map(title_of, handler_server_processes(supervisor)))


def handler_server(supervisor: Supervisor, title: str) -> psutil.Process:
    [server] = [p for p in handler_server_processes(supervisor) if title_of(p) == title]
    return server


def handler_server_processes(supervisor: Supervisor) -> list[psutil.Process]:
    """The fork server's children (a handler process has its server's title until it sets
    its own: the title alone does not tell them)."""
    servers = []
    for process in supervisor.family():
        if title_of(process) == "queue-supervisor: fork server":
            with contextlib.suppress(psutil.NoSuchProcess):
                servers += process.children()
    return servers


def handler_processes(supervisor: Supervisor, count: int) -> set[str]:
    """The pids of the supervisor's handler processes, once there are ``count``."""
    pids = {str(process.pid) for process in supervisor.family()
            if title_of(process).startswith("queue-supervisor: e2e handler ")}
    return pids if len(pids) == count else set()


def title_of(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.NoSuchProcess):
        return " ".join(process.cmdline()).strip()
    return ""


def modified(path: Path) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(path.stat().st_mtime))


@pytest.mark.slow
def test_sighup_imports_the_edited_handler_and_replaces_processes_after_their_work(
    tmp_path, redis_url, client, supervisors
):
    supervisor = start_reloadable(tmp_path, redis_url, supervisors)
    [slow] = publish(client, [{"sleep": 3}])
    wait_for(lambda: slow in versions(tmp_path), 15, "the slow job to start")
    code = write_handler(tmp_path, "two-two")
    supervisor.signal(signal.SIGHUP)
    [reloaded] = wait_for(lambda: messages(supervisor, "handler reloaded:", "info"), 20,
                          "the reload")
    # What is now loaded: the module's file and its modification time.
    assert f"reloadable:handle from {code} (modified {modified(code)})" in reloaded, reloaded
    assert "replacing 2 handler processes, each after its current work" in reloaded
    after = publish(client, [{"n": n} for n in range(6)])
    wait_for(lambda: set(after) <= set(versions(tmp_path)), 30, "the jobs after the reload")
    assert {versions(tmp_path)[job][0] for job in after} == {"two-two"}
    # The slow job ran to its end with the code it started with: nothing killed or requeued.
    assert versions(tmp_path)[slow][0] == "one"
    wait_for(lambda: counter(client, "success") == 7, 20, "every job committed")
    # The old handler server exited once its processes were gone; the new one stays.
    wait_for(lambda: handler_servers(supervisor) == ["queue-supervisor: handler server 2"],
             15, "the old handler server to exit")
    wait_for(lambda: messages(supervisor, "(code generation 1) exited: its processes were all "
                                          "replaced", "info"), 10, "the line that says so")
    # Reaped: the fork server, the new handler server and its two processes, no zombie.
    assert [alive(process) for process in supervisor.family()[1:]] == [True] * 4
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()
    assert "worker lost" not in supervisor.output()
    assert outstanding(client) == 0


@pytest.mark.parametrize("broken", list(BROKEN_CODE))
def test_a_reload_whose_import_fails_keeps_the_old_processes_consuming(
    tmp_path, redis_url, client, supervisors, broken
):
    supervisor = start_reloadable(tmp_path, redis_url, supervisors)
    before = publish(client, [{"n": n} for n in range(4)])
    wait_for(lambda: set(before) <= set(versions(tmp_path)), 15, "the first jobs")
    processes = wait_for(lambda: handler_processes(supervisor, 2), 15, "both processes")
    code, reason = BROKEN_CODE[broken]
    path = tmp_path / "code" / "reloadable.py"
    path.write_text(code)
    supervisor.signal(signal.SIGHUP)
    [error] = wait_for(lambda: messages(supervisor, "handler reload", "error"), 20,
                       "the reload's error line")
    assert reason in error, error
    assert ("the handler processes keep running the code loaded before: reloadable:handle "
            f"from {path} (modified ") in error, error
    # The same processes go on consuming, with the code they had.
    after = publish(client, [{"n": n} for n in range(4, 10)])
    wait_for(lambda: set(after) <= set(versions(tmp_path)), 15, "the jobs after the reload")
    assert {versions(tmp_path)[job] for job in after} <= {("one", p) for p in processes}
    wait_for(lambda: handler_servers(supervisor) == ["queue-supervisor: handler server 1"],
             15, "the failed handler server to exit")
    # Fixed, the next SIGHUP loads it.
    write_handler(tmp_path, "three-three")
    supervisor.signal(signal.SIGHUP)
    wait_for(lambda: messages(supervisor, "handler reloaded:", "info"), 20, "the reload")
    last = publish(client, [{"n": 10}])
    wait_for(lambda: set(last) <= set(versions(tmp_path)), 15, "the job after the fix")
    assert versions(tmp_path)[last[0]][0] == "three-three"
    assert supervisor.process.poll() is None, supervisor.output()
    wait_for(lambda: counter(client, "success") == 11, 20, "every job committed")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()


#: Module code that makes the import take 3 s, after writing the file "importing".
SLOW_IMPORT = """
with open(os.path.join(os.environ["E2E_DIR"], "importing"), "a") as marker:
    marker.write("importing\\n")
time.sleep(3)
"""


@pytest.mark.slow
def test_a_sighup_during_an_import_asks_for_another_after_it_without_descriptor_leaks(
    tmp_path, redis_url, client, supervisors
):
    supervisor = start_reloadable(tmp_path, redis_url, supervisors)
    [first] = publish(client, [{"n": 0}])
    wait_for(lambda: first in versions(tmp_path), 15, "the first job")
    server = handler_server(supervisor, "queue-supervisor: handler server 1")
    descriptors = {"server": server.num_fds(),
                   "process": psutil.Process(int(versions(tmp_path)[first][1])).num_fds()}
    write_handler(tmp_path, "two-two", extra=SLOW_IMPORT)
    supervisor.signal(signal.SIGHUP)
    wait_for(lambda: lines(tmp_path / "importing"), 15, "the slow import to begin")
    write_handler(tmp_path, "three-three-three")
    supervisor.signal(signal.SIGHUP)
    wait_for(lambda: messages(supervisor, "SIGHUP received: a reload is under way; another "
                                          "follows it", "info"), 10, "the second SIGHUP")
    wait_for(lambda: len(messages(supervisor, "handler reloaded:", "info")) == 2, 20,
             "both reloads")
    assert messages(supervisor, "reloading again (a SIGHUP came during the last import): "
                                "importing reloadable:handle anew", "info")
    after = publish(client, [{"n": n} for n in range(1, 7)])
    wait_for(lambda: set(after) <= set(versions(tmp_path)), 15, "the jobs after the reloads")
    assert {versions(tmp_path)[job][0] for job in after} == {"three-three-three"}
    wait_for(lambda: handler_servers(supervisor) == ["queue-supervisor: handler server 3"],
             15, "the old handler servers to exit")
    # A handler server and a handler process of the third code hold what the first held.
    server = handler_server(supervisor, "queue-supervisor: handler server 3")
    process = psutil.Process(int(versions(tmp_path)[after[-1]][1]))
    assert {"server": server.num_fds(), "process": process.num_fds()} == descriptors
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()
    assert "worker lost" not in supervisor.output()


@pytest.mark.slow
def test_a_stop_during_a_reloads_import_is_not_held_up_by_it(
    tmp_path, redis_url, client, supervisors
):
    supervisor = start_reloadable(tmp_path, redis_url, supervisors)
    write_handler(tmp_path, "two-two", extra=SLOW_IMPORT)
    supervisor.signal(signal.SIGHUP)
    wait_for(lambda: lines(tmp_path / "importing"), 15, "the slow import to begin")
    family = supervisor.family()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()
    assert not messages(supervisor, "", "error")
    wait_for(lambda: not any(alive(process) for process in family), 10, "every process gone")


def test_no_process_outlives_a_killed_supervisor_after_a_reload(
    tmp_path, redis_url, client, supervisors
):
    supervisor = start_reloadable(tmp_path, redis_url, supervisors)
    [busy] = publish(client, [{"sleep": 60}])
    wait_for(lambda: busy in versions(tmp_path), 15, "the long job to start")
    write_handler(tmp_path, "two-two")
    supervisor.signal(signal.SIGHUP)
    # The first handler server waits for its busy process; the second serves the other place.
    wait_for(lambda: len(handler_servers(supervisor)) == 2 and len(supervisor.family()) == 6,
             20, "two handler servers, each with a process")
    family = supervisor.family()
    supervisor.process.kill()
    assert supervisor.wait(10) == -signal.SIGKILL
    wait_for(lambda: not any(alive(process) for process in family), 10,
             "every process to die with the supervisor")


@pytest.mark.parametrize("which", ["current", "draining"])
def test_a_killed_handler_server_stops_the_supervisor_with_a_restartable_code(
    tmp_path, redis_url, client, supervisors, which
):
    supervisor = start_reloadable(tmp_path, redis_url, supervisors)
    if which == "draining":
        [busy] = publish(client, [{"sleep": 60}])
        wait_for(lambda: busy in versions(tmp_path), 15, "the long job to start")
        write_handler(tmp_path, "two-two")
        supervisor.signal(signal.SIGHUP)
        wait_for(lambda: handler_servers(supervisor) == [
            "queue-supervisor: handler server 1 (replaced)",
            "queue-supervisor: handler server 2"], 20, "two handler servers")
    title = f"queue-supervisor: handler server 1{' (replaced)' if which == 'draining' else ''}"
    server = handler_server(supervisor, title)
    began = time.monotonic()
    server.kill()
    assert supervisor.wait(20) == 4, supervisor.output()
    assert time.monotonic() - began < 10  # noticed at once, not at the shutdown deadline
    assert messages(supervisor, f"handler server {server.pid} (code generation 1) exited "
                                "(killed by SIGKILL): stopping", "error")


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
