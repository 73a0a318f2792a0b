"""SIGHUP reloads the handler processes (gunicorn's meaning), never kills anything silently."""

from __future__ import annotations

import signal
from pathlib import Path

from support.envelopes import publish
from support.supervision import counter, lines, outstanding, wait_for, write_config


def handled(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "handled")


def processes_of(tmp_path: Path, pids: list[str]) -> set[str]:
    """The handler processes that started these messages."""
    wanted = set(pids)
    return {line.split()[2] for line in lines(tmp_path / "started") if line.split()[0] in wanted}


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
        process.send_signal(signal.SIGHUP)
    [second] = publish(client, [{"n": 2}])
    wait_for(lambda: handled(tmp_path) == [first, second], 15, "a message after the hang-up")
    # The same handler process ran both: it was not killed and replaced.
    assert processes_of(tmp_path, [first]) == processes_of(tmp_path, [second])
    assert all(process.is_running() for process in children)
    assert "worker lost" not in supervisor.output()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()
