"""The TLS keys of ``[broker]``: defaults, paths, and every way a TLS setting is refused.

Each refusal is one line naming the file and the key (as every config error), raised at
load time, so a supervisor or an operator command never starts with TLS files it cannot use.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from broker.tls import TlsSettings
from supervisor import config
from supervisor.config import ConfigError, load

CONFIGURATION = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def job_file(directory: Path, broker: str, url: str = "rediss://127.0.0.1:6380/0") -> Path:
    path = directory / "job.toml"
    path.write_text(textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        {textwrap.dedent(broker).strip()}
        [job]
        queue = "q"
        handler = "examples.noop:handle"
    """))
    return path


def error_of(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load(path, environ=environ or {})
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_defaults_are_system_trust_with_the_hostname_checked(tmp_path):
    loaded = load(job_file(tmp_path, ""), environ={})
    assert loaded.broker.tls == TlsSettings("", "", "", True)
    assert not loaded.broker.tls.configured
    context = loaded.broker.tls.context()
    assert context.check_hostname and context.verify_mode.name == "CERT_REQUIRED"


def test_relative_paths_are_relative_to_the_job_file(tmp_path, certs):
    folder = tmp_path / "etc"
    (folder / "tls").mkdir(parents=True)
    for pair in (certs.ca, certs.client):
        (folder / "tls" / pair.cert.name).write_bytes(pair.cert.read_bytes())
    (folder / "tls" / "client.key").write_bytes(certs.client.key.read_bytes())
    path = job_file(folder, """
        tls_ca = "tls/ca.pem"
        tls_cert = "tls/client.pem"
        tls_key = "tls/client.key"
    """)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)  # the operator's or systemd's working directory does not matter
    try:
        loaded = load(path, environ={})
    finally:
        os.chdir(cwd)
    assert loaded.broker.tls_ca == str(folder / "tls" / "ca.pem")
    assert loaded.broker.tls_cert == str(folder / "tls" / "client.pem")
    assert loaded.broker.tls_key == str(folder / "tls" / "client.key")
    assert loaded.broker.tls.context().check_hostname


def test_a_missing_file_is_one_line_naming_the_key(tmp_path):
    message = error_of(job_file(tmp_path, 'tls_ca = "nowhere/ca.pem"'))
    assert f'[broker] tls_ca = "{tmp_path}/nowhere/ca.pem" cannot be read: No such file' in message


def test_a_folder_is_not_a_readable_file(tmp_path):
    message = error_of(job_file(tmp_path, f'tls_ca = "{tmp_path}"'))
    assert "[broker] tls_ca" in message and "cannot be read: Is a directory" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_refused(tmp_path, certs):
    private = tmp_path / "ca.pem"
    private.write_bytes(certs.ca.cert.read_bytes())
    private.chmod(0)
    message = error_of(job_file(tmp_path, 'tls_ca = "ca.pem"'))
    assert "[broker] tls_ca" in message and "Permission denied" in message


def test_a_file_without_certificates_is_refused(tmp_path, certs):
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    message = error_of(job_file(tmp_path, 'tls_ca = "junk.pem"'))
    assert "[broker] tls_ca" in message and "holds no PEM certificate" in message
    message = error_of(job_file(tmp_path, f"""
        tls_cert = "{certs.client.key}"
        tls_key = "{certs.client.key}"
    """))
    assert "[broker] tls_cert" in message and "holds no PEM certificate" in message


@pytest.mark.parametrize(("given", "missing"), [("tls_cert", "tls_key"), ("tls_key", "tls_cert")])
def test_cert_and_key_go_together(tmp_path, certs, given, missing):
    path = certs.client.cert if given == "tls_cert" else certs.client.key
    message = error_of(job_file(tmp_path, f'{given} = "{path}"'))
    assert f"[broker] {given} is set without {missing}: mutual TLS needs both" in message


def test_a_key_of_another_certificate_is_refused(tmp_path, certs):
    message = error_of(job_file(tmp_path, f"""
        tls_cert = "{certs.client.cert}"
        tls_key = "{certs.server.key}"
    """))
    assert "[broker] tls_key" in message and "is not the key of the client certificate" in message


def test_a_file_that_is_not_a_key_is_refused(tmp_path, certs):
    message = error_of(job_file(tmp_path, f"""
        tls_cert = "{certs.client.cert}"
        tls_key = "{certs.client.cert}"
    """))
    assert "[broker] tls_key" in message and "is not a PEM private key" in message


def test_an_encrypted_key_is_refused_without_a_prompt(tmp_path, certs):
    encrypted = tmp_path / "client.key"
    subprocess.run(["openssl", "pkey", "-in", str(certs.client.key), "-aes256", "-passout",
                    "pass:secret", "-out", str(encrypted)], check=True)
    message = error_of(job_file(tmp_path, f"""
        tls_cert = "{certs.client.cert}"
        tls_key = "client.key"
    """))
    assert "[broker] tls_key" in message and "is encrypted" in message


@pytest.mark.parametrize("setting", ["tls_ca = \"{ca}\"", "tls_verify_hostname = false"])
def test_tls_keys_with_a_plain_redis_url_are_an_error(tmp_path, certs, setting):
    key = setting.split()[0]
    path = job_file(tmp_path, setting.format(ca=certs.ca.cert), url="redis://127.0.0.1:6379/0")
    message = error_of(path)
    assert f"[broker] {key} is a TLS setting but [broker] url" in message
    assert "write rediss://" in message


def test_the_url_override_is_checked_against_the_tls_keys(tmp_path, certs):
    path = job_file(tmp_path, f'tls_ca = "{certs.ca.cert}"')
    message = error_of(path, {"QUEUE_BROKER_URL": "redis://:secret@10.0.0.5:6379/0"})
    assert "QUEUE_BROKER_URL" in message and "secret" not in message
    loaded = load(path, environ={"QUEUE_BROKER_URL": "rediss://:secret@10.0.0.5:6379/0"})
    assert loaded.broker.tls_ca == str(certs.ca.cert)


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222", "tls://127.0.0.1:4222"])
def test_tls_keys_are_accepted_with_either_nats_url(tmp_path, certs, url):
    loaded = load(job_file(tmp_path, f"""
        tls_ca = "{certs.ca.cert}"
        tls_cert = "{certs.client.cert}"
        tls_key = "{certs.client.key}"
    """, url=url), environ={})
    assert loaded.broker.tls.configured


@pytest.mark.parametrize("query", ["ssl_cert_reqs=none", "ssl_check_hostname=false",
                                   "ssl_ca_certs=/tmp/ca.pem"])
def test_redis_url_tls_parameters_are_refused(tmp_path, query):
    # redis-py lets them override its arguments, i.e. the tls_* keys and their defaults.
    message = error_of(job_file(tmp_path, "", url=f"rediss://127.0.0.1:6380/0?{query}"))
    assert f"sets {query.partition('=')[0]} in its query" in message
    assert "tls_* keys" in message


def test_the_documented_key_table_is_generated_from_the_declarations():
    generated = config.describe()
    for key in ("tls_ca", "tls_cert", "tls_key", "tls_verify_hostname"):
        assert f"`[broker] {key}`" in generated
    assert generated in CONFIGURATION.read_text()


@pytest.mark.parametrize("error", [
    ConnectionResetError(104, "Connection reset by peer"),
    BrokenPipeError(32, "Broken pipe"),  # the server hung up while the handshake was sent
])
def test_a_connection_the_server_closed_hints_at_mutual_tls(error):
    from broker.tls import TlsSettings

    assert "set [broker] tls_cert and tls_key" in TlsSettings(ca="ca.pem").hint(error)
    assert TlsSettings(ca="ca.pem", cert="c.pem", key="k.pem").hint(error) == ""
