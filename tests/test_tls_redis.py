"""Redis over TLS: a TLS-only redis-server (``--port 0 --tls-port``) and a TLS Redis Cluster,
with a CA and certificates made by ``openssl`` for this module.

Shows: the broker's whole cycle (publish, receive, commit) over rediss:// with the job's
CA, on one server and on a cluster; the hostname check on by default (a certificate for
another name is refused, with the reason) and turned off only by the key; mutual TLS
working with the client certificate and failing with a hint without it; and a real
``python -m supervisor`` run plus every operator command over mutual TLS.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import orjson
import pytest

from broker.base import Action, BrokerError, Settlement
from broker.redis import RedisBroker
from broker.tls import TlsSettings
from supervisor import cli
from support.supervision import NAMESPACE, Supervisor, lines, wait_for, write_config
from tests.tls import (
    TlsCluster,
    TlsRedisServer,
    run,
    status,
    trusting,
    with_client_cert,
)

QUEUE = "tls"


pytestmark = pytest.mark.usefixtures("no_url_override")


@pytest.fixture
def server(certs):
    """TLS only, no client certificate required."""
    started = TlsRedisServer(certs).start()
    yield started
    started.close()


@pytest.fixture
def mutual_server(certs):
    """TLS only, a client certificate signed by the CA required (mutual TLS)."""
    started = TlsRedisServer(certs, client_certs="yes").start()
    yield started
    started.close()


async def round_trip(url: str, tls: TlsSettings, **options) -> None:
    """Publish, receive and commit three messages; the queue is empty afterwards."""
    broker = RedisBroker(url, QUEUE, tls=tls, lease=5, **options)
    await broker.connect()
    try:
        pids = await broker.publish_many(QUEUE, [{"n": n} for n in range(3)])
        received = await broker.receive(10, 1.0)
        assert sorted(d.pid for d in received.deliveries) == sorted(pids)
        results = await broker.settle([Settlement(Action.COMMIT, d)
                                       for d in received.deliveries])
        assert all(result.ok for result in results)
        assert await broker.client.llen(broker.keys.ready) == 0
        assert await broker.client.llen(broker.keys.processing) == 0
        assert int(await broker.client.get(broker.keys.stat("success"))) == 3
    finally:
        await broker.close()


async def connect_error(url: str, tls: TlsSettings) -> str:
    broker = RedisBroker(url, QUEUE, tls=tls)
    try:
        with pytest.raises(BrokerError) as caught:
            await broker.connect()
    finally:
        await broker.close()
    return str(caught.value)


async def test_a_job_cycle_over_tls_with_the_jobs_ca(server, certs):
    await round_trip(server.url, trusting(certs))


async def test_the_server_certificate_is_verified_against_the_trusted_cas(server):
    # Without tls_ca only the system's CAs are trusted: the test CA is not one of them.
    message = await connect_error(server.url, TlsSettings())
    assert "certificate verify failed" in message


async def test_a_certificate_for_another_name_is_refused_by_default(certs):
    other = TlsRedisServer(certs, pair=certs.wrong_name).start()
    try:
        message = await connect_error(other.url, trusting(certs))
        assert "certificate verify failed: IP address mismatch" in message
        assert f"cannot reach Redis at {other.url}" in message
        # Only the (unsafe) key turns the check off; the CA check still applies.
        await round_trip(other.url, trusting(certs, verify_hostname=False))
        message = await connect_error(other.url, TlsSettings(verify_hostname=False))
        assert "certificate verify failed" in message
    finally:
        other.close()


async def test_mutual_tls_works_with_the_client_certificate(mutual_server, certs):
    await round_trip(mutual_server.url, with_client_cert(certs))


async def test_mutual_tls_without_a_client_certificate_fails_with_a_hint(mutual_server, certs):
    message = await connect_error(mutual_server.url, trusting(certs))
    assert f"cannot reach Redis at {mutual_server.url}" in message
    assert "if it requires client certificates (mutual TLS), set [broker] tls_cert" in message


@pytest.mark.slow
async def test_a_cluster_over_tls(certs):
    cluster = await asyncio.to_thread(lambda: TlsCluster(certs).start())
    try:
        # The nodes the cluster announces are verified too: their certificate names
        # 127.0.0.1, and the hostname check stays on.
        await round_trip(cluster.url, trusting(certs), cluster=True, namespace="{tls}")
    finally:
        await asyncio.to_thread(cluster.close)


# -- a real supervisor and the operator commands, over mutual TLS ------------------------------


@pytest.mark.slow
def test_supervisor_and_operator_commands_over_mutual_tls(tmp_path, mutual_server, certs):
    queue = f"tls-{uuid.uuid4().hex[:8]}"  # drain stops supervisors by queue name
    # Relative paths: from the job file's folder, wherever the commands run.
    relative = {name: os.path.relpath(path, tmp_path) for name, path in (
        ("tls_ca", certs.ca.cert), ("tls_cert", certs.client.cert),
        ("tls_key", certs.client.key))}
    config = write_config(tmp_path, mutual_server.url, broker=relative,
                          job={"queue": queue, "max_attempts": 1})
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(f'{{"n": {n}}}\n' for n in range(20)) + '{"fail": true}\n')

    code, out = run("publish", str(config), str(jobs), "--verbose")
    assert code == 0 and f"published 21 messages to {queue}" in out
    pids = out.split("\n")[1:-1]
    assert status(config)["ready"] == 21

    supervisor = Supervisor(config, tmp_path, "")  # no E2E_REDIS: the handler stays off Redis
    try:
        wait_for(lambda: sorted(lines(tmp_path / "handled")) == sorted(pids[:20]), 60,
                 f"every good message to be handled\n{supervisor.output()}")
        wait_for(lambda: status(config)["failed"] == 1, 30, "the failing message in failed")
        wait_for(lambda: status(config)["stats"]["success"] == 20, 10, "20 commits")
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(20) == 0, supervisor.output()
    finally:
        supervisor.stop()
    assert "cannot connect" not in supervisor.output()
    state = status(config)
    assert (state["ready"], state["processing"], state["failed"]) == (0, 0, 1)

    code, out = run("retry", str(config))
    assert code == 0 and f"moved 1 failed jobs of {queue}" in out
    assert status(config)["ready"] == 1
    code, out = run("recover", str(config))
    assert code == 0 and "recovered 0 deliveries" in out
    code, out = run("check", str(config))
    assert code == 0 and f"ok: no reservation and no owner record of {queue}" in out
    code, out = run("drain", str(config), "--timeout", "10")
    assert code == 0 and f"stopping 0 supervisors of {queue}" in out
    code, out = run("status", str(config))
    assert code == 0 and f"queue {queue} (namespace {NAMESPACE})" in out


def test_an_operator_command_without_the_client_certificate_fails_clearly(
    tmp_path, mutual_server, certs, capsys
):
    config = write_config(tmp_path, mutual_server.url, broker={"tls_ca": str(certs.ca.cert)})
    code = cli.main(["status", str(config)])
    assert code == 1
    error = capsys.readouterr().err
    assert error.startswith("error: status failed: cannot reach Redis at rediss://127.0.0.1")
    assert "set [broker] tls_cert and tls_key" in error


async def test_the_demo_publisher_connects_over_mutual_tls(tmp_path, mutual_server, certs):
    from examples.demo import publish

    tls = {"tls_ca": str(certs.ca.cert), "tls_cert": str(certs.client.cert),
           "tls_key": str(certs.client.key)}
    config = write_config(tmp_path, mutual_server.url, broker=tls, nats={"ack_wait": 5.0})
    totals = await publish(str(config), 5)
    assert totals["executions"] == 5
    code, out = await asyncio.to_thread(run, "status", str(config), "--json")
    assert code == 0 and orjson.loads(out)["ready"] == 5
