"""Broker credentials end to end: never shown, and a refusal stops the job for good.

Real ``python -m supervisor`` processes against a private password-protected redis-server
(and token / user-password nats-servers): whatever they print, serve or put in a process
title must not contain the secret, in any of the forms a URL can carry it; a server that
refuses the credentials (or the database number) ends the job with exit code 5, which the
systemd unit does not restart.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import orjson
import pytest

from supervisor import exits
from support import processes
from support.servers import NatsServer, RedisServer, environ_without_broker, free_port
from support.supervision import ROOT, Supervisor, wait_for, write_config

#: With an ``@`` in it: written unencoded, a naive redaction shows the part after it.
PASSWORD = "Zx9-s3cret@Hq7-pw"
#: Either half gives most of it away; the percent-encoded form contains both.
FRAGMENTS = ("Zx9-s3cret", "Hq7-pw")
HANDLER = "examples.noop:handle"

#: Every way a Redis URL can carry the password, by name: port -> URL.
REDIS_FORMS: dict[str, Callable[[int], str]] = {
    "user-and-password": lambda port: (
        f"redis://default:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"),
    "password-only-unencoded-at": lambda port: f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
    "query-parameter": lambda port: (
        f"redis://127.0.0.1:{port}/0?password={quote(PASSWORD, safe='')}"),
}


@pytest.fixture
def protected_redis():
    server = RedisServer(extra=["--requirepass", PASSWORD]).start()
    yield server
    server.close()


def run_command(*args: str, url_override: str | None = None) -> subprocess.CompletedProcess:
    """``python -m supervisor ARGS`` as an operator runs it (QUEUE_BROKER_URL optional)."""
    environ = dict(environ_without_broker(), PYTHONPATH=str(ROOT))
    if url_override is not None:
        environ["QUEUE_BROKER_URL"] = url_override
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60)


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def assert_hidden(texts: list[str], fragments: tuple[str, ...] = FRAGMENTS) -> None:
    for text in texts:
        for fragment in fragments:
            assert fragment not in text, f"{fragment!r} shown in: {text[:2000]}"


def json_records(output: str) -> list[dict]:
    """Every line the supervisor wrote (a traceback would not parse)."""
    return [orjson.loads(line) for line in output.splitlines()]


# -- never shown -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("form", list(REDIS_FORMS))
def test_the_password_is_shown_nowhere_in_any_form(tmp_path: Path, protected_redis, form):
    port = protected_redis.port
    url = REDIS_FORMS[form](port)

    # A broker that cannot be reached: the errors name the URL.
    unreachable = url.replace(f":{port}/", f":{free_port()}/")
    config = write_config(tmp_path, unreachable, handler=HANDLER)
    failed = Supervisor(config, tmp_path, "")
    assert failed.wait(30) == exits.BROKER
    assert "cannot reach Redis at redis://" in failed.output()
    status = run_command("status", str(config))
    assert status.returncode == 1 and "cannot reach Redis at redis://" in status.stderr
    assert_hidden([failed.output(), status.stdout, status.stderr])

    # A configuration error that quotes the URL (a database that is not a number).
    bad = run_command("status", str(config), url_override=url.replace(f"{port}/0", f"{port}/x"))
    assert bad.returncode == 2 and "QUEUE_BROKER_URL = " in bad.stderr
    assert_hidden([bad.stdout, bad.stderr])

    # A working run: its log, status (text and JSON), the metrics and the process titles.
    metrics_port = free_port()
    config = write_config(tmp_path, url, handler=HANDLER,
                          supervisor={"metrics_port": metrics_port})
    running = Supervisor(config, tmp_path, "")
    try:
        wait_for(lambda: "consuming e2e on redis://" in running.output(), 30, "the start")
        metrics = wait_for(lambda: scrape(metrics_port), 15, "the metrics endpoint")
        titles = [processes.title(process) for process in running.family()]
        text = run_command("status", str(config))
        as_json = run_command("status", str(config), "--json")
        running.signal(signal.SIGTERM)
        assert running.wait(30) == 0
    finally:
        running.stop()
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    assert f"127.0.0.1:{port}/0" in text.stdout  # the broker is named, without the secret
    assert orjson.loads(as_json.stdout)["url"].startswith("redis://")
    assert any(title.startswith("queue-supervisor: e2e") for title in titles), titles
    assert_hidden([running.output(), metrics, *titles, text.stdout, text.stderr,
                   as_json.stdout, as_json.stderr])


# -- a refusal stops the job for good -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong-password", "refused the URL's user name or password"),
        ("no-password", "requires a password, and the URL gives none"),
        ("unknown-database", "has no database 99"),
    ],
)
def test_a_refused_connection_exits_5_with_one_error_line(
    tmp_path: Path, protected_redis, case, expected
):
    port = protected_redis.port
    url = {
        "wrong-password": f"redis://:Wr0ng-guess@127.0.0.1:{port}/0",
        "no-password": f"redis://127.0.0.1:{port}/0",
        "unknown-database": f"redis://:{PASSWORD}@127.0.0.1:{port}/99",
    }[case]
    config = write_config(tmp_path, url, handler=HANDLER)
    supervisor = Supervisor(config, tmp_path, "")
    assert supervisor.wait(30) == 5  # not 1, which systemd restarts every RestartSec
    errors = [r for r in json_records(supervisor.output()) if r["level"] in ("error", "critical")]
    assert len(errors) == 1, supervisor.output()
    assert expected in errors[0]["message"] and f"127.0.0.1:{port}/" in errors[0]["message"]

    status = run_command("status", str(config))  # the operator commands say the same
    assert status.returncode == 5 and len(status.stderr.splitlines()) == 1
    assert expected in status.stderr
    assert_hidden([supervisor.output(), status.stderr], (*FRAGMENTS, "Wr0ng-guess"))


@pytest.mark.slow
@pytest.mark.parametrize("auth", ["user-and-password", "token"])
def test_a_nats_server_refusing_the_credentials_exits_5(tmp_path: Path, auth):
    secret = "Nq4-t0ken-s3cret"
    if auth == "token":
        server = NatsServer(extra=["--auth", secret]).start()
        wrong, right = "nats://Wr0ng-guess@127.0.0.1:{}", f"nats://{secret}@127.0.0.1:{{}}"
    else:
        server = NatsServer(extra=["--user", "alice", "--pass", secret]).start()
        wrong = "nats://alice:Wr0ng-guess@127.0.0.1:{}"
        right = f"nats://alice:{secret}@127.0.0.1:{{}}"
    try:
        config = write_config(tmp_path, wrong.format(server.port), handler=HANDLER,
                              nats={"ack_wait": 30})
        supervisor = Supervisor(config, tmp_path, "")
        assert supervisor.wait(30) == 5
        errors = [r for r in json_records(supervisor.output()) if r["level"] == "error"]
        assert len(errors) == 1 and "refused the connection" in errors[0]["message"]

        config = write_config(tmp_path, right.format(server.port), handler=HANDLER,
                              nats={"ack_wait": 30})
        status = run_command("status", str(config))
        assert status.returncode == 0, status.stderr
        assert f"@127.0.0.1:{server.port}" in status.stdout  # named, without the secret
        assert_hidden([supervisor.output(), status.stdout, status.stderr],
                      (secret, "Wr0ng-guess"))
    finally:
        server.close()


def test_the_unit_restarts_no_exit_that_would_only_repeat():
    unit = (ROOT / "conf" / "queue-supervisor@.service").read_text()
    [line] = [line for line in unit.splitlines() if line.startswith("RestartPreventExitStatus=")]
    prevented = {int(code) for code in line.partition("=")[2].split()}
    assert prevented == {exits.CONFIG, exits.HANDLER_INIT, exits.REFUSED}
    assert exits.REFUSED == 5  # the code the tests above expect
