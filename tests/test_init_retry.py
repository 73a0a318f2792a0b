"""A handler whose init() fails on the network (a database not up yet at boot) is retried
with backoff in its process, visibly; any other init() failure still halts with exit 3."""

from __future__ import annotations

import errno
import signal

import pytest

from support.envelopes import publish
from support.supervision import counter, keys, lines, outstanding, wait_for, write_config
from worker.base import heals

HANDLER = "tests.handlers.init_flaky:handle"


class DriverError(Exception):
    """A database driver's own error, raised from the socket's."""


def raised_from(cause: BaseException) -> DriverError:
    try:
        raise DriverError("could not connect") from cause
    except DriverError as error:
        return error


def raised_while_handling(context: BaseException) -> DriverError:
    try:
        try:
            raise context
        except OSError:
            raise DriverError("the helper exited with code 1")  # noqa: B904 - the case
    except DriverError as error:
        return error


@pytest.mark.parametrize(("error", "expected"), [
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
    (TimeoutError(), True),
    (OSError(errno.ENETUNREACH, "unreachable"), True),
    (raised_from(ConnectionResetError()), True),
    (FileNotFoundError(errno.ENOENT, "no such file"), False),
    (PermissionError(errno.EACCES, "denied"), False),
    (ValueError("bad setting"), False),
    (raised_from(KeyError("x")), False),
    # Raised while handling a refused connection, not from it: the stats-usage writer that
    # exited with an error (tests/test_usage_clickhouse.py, exit 3).
    (raised_while_handling(ConnectionRefusedError()), False),
])
def test_only_network_failures_heal(error, expected):
    assert heals(error) is expected


@pytest.mark.slow
@pytest.mark.parametrize("handler", [HANDLER, "tests.handlers.init_flaky_aio:handle"])
def test_init_failing_on_the_network_is_retried_with_backoff_and_reserves_nothing(
    tmp_path, redis_url, client, supervisors, handler
):
    pids = publish(client, [{"n": n} for n in range(3)])
    config = write_config(tmp_path, redis_url, handler=handler, job={"coroutines": 1})
    supervisor = supervisors(config, redis_url)
    for delay in (1, 2):
        wait_for(lambda delay=delay: f"retrying in {delay} s" in supervisor.output(), 20,
                 f"the retry after {delay} s")
        # Not ready yet: nothing is taken from the queue for it.
        assert outstanding(client) == 0 and client.llen(keys().ready) == 3
    wait_for(lambda: sorted(lines(tmp_path / "handled")) == sorted(pids), 30, "every message")
    assert len(lines(tmp_path / "init-attempts")) == 3
    assert len(set(lines(tmp_path / "init-attempts"))) == 1  # in the same process
    output = supervisor.output()
    assert "ConnectionError: database not up yet (attempt 1)" in output
    assert supervisor.process.poll() is None, output
    wait_for(lambda: counter(client, "success") == 3, 10, "all commits")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()


@pytest.mark.slow
def test_a_stop_while_init_is_retried_ends_at_once(tmp_path, redis_url, client, supervisors):
    config = write_config(tmp_path, redis_url, handler=HANDLER,
                          supervisor={"shutdown_deadline": 30})
    supervisor = supervisors(config, redis_url, INIT_FAILURES="1000")
    wait_for(lambda: "retrying in 2 s" in supervisor.output(), 20, "a second retry")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()  # not after the 30 s deadline


@pytest.mark.slow
def test_init_failing_otherwise_still_halts_with_exit_3(tmp_path, redis_url, client, supervisors):
    publish(client, [{"n": 1}])
    config = write_config(tmp_path, redis_url, handler=HANDLER)
    supervisor = supervisors(config, redis_url, INIT_ERROR="ValueError")
    assert supervisor.wait(30) == 3, supervisor.output()
    output = supervisor.output()
    assert "ValueError: database not up yet (attempt 1)" in output
    assert "retrying" not in output
    assert len(lines(tmp_path / "init-attempts")) == 1
    assert client.llen(keys().ready) == 1 and outstanding(client) == 0


@pytest.mark.slow
def test_a_reload_while_init_is_retried_replaces_the_process_quietly(
    tmp_path, redis_url, client, supervisors
):
    [pid] = publish(client, [{"n": 1}])
    config = write_config(tmp_path, redis_url, handler=HANDLER, job={"coroutines": 1})
    supervisor = supervisors(config, redis_url, INIT_FAILURES="3")
    wait_for(lambda: "retrying in 2 s" in supervisor.output(), 20, "a second retry")
    supervisor.signal(signal.SIGHUP)
    wait_for(lambda: lines(tmp_path / "handled") == [pid], 30, "the message")
    assert len(set(lines(tmp_path / "init-attempts"))) == 2  # replaced once, at the reload
    assert "died before it was ready" not in supervisor.output()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(15) == 0, supervisor.output()
