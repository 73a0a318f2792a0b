"""NATS over TLS: nats-servers whose config requires TLS (``tls {}`` block, ``verify`` for
mutual TLS), with a CA and certificates made by ``openssl`` for this module.

Shows: the broker's whole cycle (publish, receive, ack) over tls:// and over nats:// to a
server that requires TLS; the hostname check on by default (a certificate for another name
is refused, with the reason) and turned off only by the key; mutual TLS working with the
client certificate and failing with a hint without it; a plaintext server refused when TLS
is configured (nats-py alone would talk plaintext to it, even for a tls:// URL); and a real
``python -m supervisor`` run plus ``publish`` and ``status`` over mutual TLS.
"""

from __future__ import annotations

import asyncio
import signal

import orjson
import pytest

from broker.base import Action, Settlement
from broker.nats import NatsBroker
from broker.nats import tls as nats_tls
from broker.nats.link import Unavailable
from broker.tls import TlsSettings
from supervisor import cli
from support.servers import NatsServer
from support.supervision import Supervisor, lines, wait_for, write_config
from tests.tls import TlsNatsServer, run, status, trusting, with_client_cert

QUEUE = "tls"
#: Short, so that refused connections fail the test quickly (the link retries until then).
CONNECT_TIMEOUT = 2.0


pytestmark = pytest.mark.usefixtures("no_url_override")


@pytest.fixture
def server(certs):
    """Requires TLS, no client certificate."""
    started = TlsNatsServer(certs).start()
    yield started
    started.close()


@pytest.fixture
def mutual_server(certs):
    """Requires TLS and a client certificate signed by the CA (``verify: true``)."""
    started = TlsNatsServer(certs, verify=True).start()
    yield started
    started.close()


def new_broker(url: str, tls: TlsSettings | None) -> NatsBroker:
    return NatsBroker(url, QUEUE, tls=tls, ack_wait=5.0, request_timeout=2.0,
                      connect_timeout=CONNECT_TIMEOUT)


async def round_trip(url: str, tls: TlsSettings | None) -> None:
    """Publish, receive and ack three messages; the work stream is empty afterwards."""
    broker = new_broker(url, tls)
    await broker.connect()
    try:
        pids = await broker.publish_many(QUEUE, [{"n": n} for n in range(3)])
        got = []
        for _ in range(20):
            got += (await broker.receive(3 - len(got), 1.0)).deliveries
            if len(got) == 3:
                break
        assert sorted(d.pid for d in got) == sorted(pids)
        results = await broker.settle([Settlement(Action.COMMIT, d) for d in got])
        assert all(result.ok for result in results)
    finally:
        await broker.close()
    assert await stream_messages(url, tls) == 0


async def stream_messages(url: str, tls: TlsSettings | None) -> int:
    client = await nats_tls.connect(url, **nats_tls.tls_options(url, tls))
    try:
        return (await client.jetstream().stream_info("Q_TLS")).state.messages
    finally:
        await client.close()


async def connect_error(url: str, tls: TlsSettings | None) -> str:
    broker = new_broker(url, tls)
    try:
        with pytest.raises(Unavailable) as caught:
            await broker.connect()
    finally:
        await broker.close()
    return str(caught.value)


async def test_a_job_cycle_over_a_tls_url(server, certs):
    await round_trip(server.tls_url, trusting(certs))


async def test_a_nats_url_to_a_server_that_requires_tls(server, certs):
    await round_trip(server.url, trusting(certs))


@pytest.mark.slow
async def test_the_server_certificate_is_verified_against_the_trusted_cas(server):
    # Without tls_ca only the system's CAs are trusted: the test CA is not one of them.
    message = await connect_error(server.tls_url, None)
    assert "certificate verify failed" in message


@pytest.mark.slow
async def test_a_certificate_for_another_name_is_refused_by_default(certs):
    other = TlsNatsServer(certs, pair=certs.wrong_name).start()
    try:
        message = await connect_error(other.tls_url, trusting(certs))
        assert f"no NATS connection to {other.tls_url} within" in message
        assert "certificate verify failed: IP address mismatch" in message
        # Only the (unsafe) key turns the check off; the CA check still applies.
        await round_trip(other.tls_url, trusting(certs, verify_hostname=False))
        message = await connect_error(other.tls_url, TlsSettings(verify_hostname=False))
        assert "certificate verify failed" in message
    finally:
        other.close()


async def test_mutual_tls_works_with_the_client_certificate(mutual_server, certs):
    await round_trip(mutual_server.tls_url, with_client_cert(certs))


@pytest.mark.slow
async def test_mutual_tls_without_a_client_certificate_fails_with_a_hint(mutual_server, certs):
    message = await connect_error(mutual_server.tls_url, trusting(certs))
    assert f"no NATS connection to {mutual_server.tls_url} within" in message
    assert "if it requires client certificates (mutual TLS), set [broker] tls_cert" in message


async def test_a_new_connection_after_a_server_restart_is_tls_again(mutual_server, certs):
    broker = new_broker(mutual_server.tls_url, with_client_cert(certs))
    await broker.connect()
    try:
        [pid] = await broker.publish_many(QUEUE, [{"n": 1}])
        await asyncio.to_thread(mutual_server.restart)
        got = []
        for _ in range(30):
            got += (await broker.receive(1, 1.0)).deliveries
            if got:
                break
        assert [d.pid for d in got] == [pid]
        assert broker.reconnects >= 1
        [result] = await broker.settle([Settlement(Action.COMMIT, got[0])])
        assert result.ok
    finally:
        await broker.close()


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "tls"), [("tls", None), ("nats", "trusting")])
async def test_a_server_without_tls_is_refused_when_tls_is_configured(
    nats_server: NatsServer, certs, scheme, tls
):
    url = f"{scheme}://127.0.0.1:{nats_server.port}"
    message = await connect_error(url, trusting(certs) if tls else None)
    assert "TlsNotStarted" in message and "refusing to connect in plaintext" in message


async def test_a_nats_url_without_tls_settings_still_connects_in_plaintext(nats_server):
    await round_trip(nats_server.url, None)


# -- a real supervisor and the operator commands, over mutual TLS ------------------------------


@pytest.mark.slow
def test_supervisor_publish_and_status_over_mutual_tls(tmp_path, mutual_server, certs):
    tls = {"tls_ca": str(certs.ca.cert), "tls_cert": str(certs.client.cert),
           "tls_key": str(certs.client.key)}
    config = write_config(tmp_path, mutual_server.tls_url, broker=tls,
                          nats={"ack_wait": 5.0})
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(f'{{"n": {n}}}\n' for n in range(20)))

    code, out = run("publish", str(config), str(jobs), "--verbose")
    assert code == 0 and "published 20 messages to e2e" in out
    pids = out.split("\n")[1:-1]
    assert status(config)["ready"] == 20

    supervisor = Supervisor(config, tmp_path, "")
    try:
        wait_for(lambda: sorted(lines(tmp_path / "handled")) == sorted(pids), 60,
                 "every message to be handled")
        wait_for(lambda: status(config)["messages"] == 0, 15, "every message acked")
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(20) == 0, supervisor.output()
    finally:
        supervisor.stop()
    # nats-py's TLS upgrade makes asyncio warn at every close; that notice is filtered.
    assert "eof_received" not in supervisor.output()
    state = status(config)
    assert (state["ready"], state["processing"], state["dead"]) == (0, 0, 0)
    code, out = run("status", str(config))
    assert code == 0 and "queue e2e (NATS stream Q_E2E)" in out


def test_status_without_the_client_certificate_fails_clearly(
    tmp_path, mutual_server, certs, capsys
):
    config = write_config(tmp_path, mutual_server.tls_url, broker={"tls_ca": str(certs.ca.cert)},
                          nats={"ack_wait": 5.0})
    code = cli.main(["status", str(config)])
    assert code == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: status failed: cannot reach NATS at {mutual_server.tls_url}")
    assert "set [broker] tls_cert and tls_key" in error


@pytest.mark.slow
def test_the_supervisor_exits_1_naming_a_refused_certificate(tmp_path, certs):
    other = TlsNatsServer(certs, pair=certs.wrong_name).start()
    try:
        config = write_config(tmp_path, other.tls_url, broker={"tls_ca": str(certs.ca.cert)},
                              nats={"ack_wait": 5.0})
        supervisor = Supervisor(config, tmp_path, "")
        try:
            assert supervisor.wait(30) == 1
        finally:
            supervisor.stop()
        assert "IP address mismatch" in supervisor.output()
    finally:
        other.close()


async def test_the_demo_publisher_connects_over_mutual_tls(tmp_path, mutual_server, certs):
    from examples.demo import publish

    tls = {"tls_ca": str(certs.ca.cert), "tls_cert": str(certs.client.cert),
           "tls_key": str(certs.client.key)}
    config = write_config(tmp_path, mutual_server.tls_url, broker=tls, nats={"ack_wait": 5.0})
    totals = await publish(str(config), 5)
    assert totals["executions"] == 5
    code, out = await asyncio.to_thread(run, "status", str(config), "--json")
    assert code == 0 and orjson.loads(out)["ready"] == 5
