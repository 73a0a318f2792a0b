"""TLS for tests: a private CA and certificates made with ``openssl``, and TLS servers.

``Certificates(directory)`` writes a CA, a server certificate for 127.0.0.1 and localhost,
a server certificate for another name (for hostname verification), and a client
certificate (for mutual TLS), all signed by the CA and valid for a day.
``TlsRedisServer`` listens with TLS only (``--port 0``), ``TlsCluster`` is a Redis Cluster
whose clients and cluster bus use TLS only, ``TlsNatsServer`` requires TLS from a config
file's ``tls {}`` block. None ever touches the machine's own servers.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis

from broker.tls import TlsSettings
from supervisor import cli
from support.cluster import ClusterNode, PrivateCluster, cluster_ports
from support.servers import NatsServer, RedisServer, nats_server_binary, wait_for_port

#: What the server certificate is valid for: the loopback address and its usual name.
SERVER_NAMES = "IP:127.0.0.1,DNS:localhost"
#: What the wrong server certificate is valid for: anything but where the server runs.
OTHER_NAMES = "DNS:other.example"
#: One curve for every key: fast to make, accepted by every TLS stack involved.
KEY_OPTIONS = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, both PEM files."""

    cert: Path
    key: Path


class Certificates:
    """A test CA and the certificates it signed, as files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        if not shutil.which("openssl"):
            raise RuntimeError("openssl is not installed (apt-get install -y openssl)")
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = self._make_ca()
        # Servers get clientAuth too: a TLS Redis Cluster node presents its certificate to
        # the other nodes when it connects to their cluster bus.
        self.server = self.issue("server", "localhost", SERVER_NAMES, "serverAuth,clientAuth")
        self.wrong_name = self.issue("other", "other.example", OTHER_NAMES, "serverAuth")
        self.client = self.issue("client", "queue-supervisor", None, "clientAuth")

    def _make_ca(self) -> Pair:
        pair = Pair(self.dir / "ca.pem", self.dir / "ca.key")
        _openssl(
            "req", "-x509", *KEY_OPTIONS, "-keyout", pair.key.name, "-out", pair.cert.name,
            "-days", "1", "-subj", "/CN=queue-supervisor test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=self.dir,
        )
        return pair

    def issue(self, name: str, common_name: str, alt_names: str | None, usage: str) -> Pair:
        """A certificate signed by the CA; ``alt_names`` e.g. ``"IP:127.0.0.1,DNS:localhost"``."""
        pair = Pair(self.dir / f"{name}.pem", self.dir / f"{name}.key")
        extensions = self.dir / f"{name}.ext"
        lines = [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature",
            f"extendedKeyUsage={usage}",
            "subjectKeyIdentifier=hash",
            "authorityKeyIdentifier=keyid",
        ]
        if alt_names:
            lines.append(f"subjectAltName={alt_names}")
        extensions.write_text("\n".join(lines) + "\n")
        _openssl(
            "req", *KEY_OPTIONS, "-keyout", pair.key.name, "-out", f"{name}.csr",
            "-subj", f"/CN={common_name}", cwd=self.dir,
        )
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", self.ca.cert.name,
            "-CAkey", self.ca.key.name, "-CAcreateserial", "-days", "1",
            "-extfile", extensions.name, "-out", pair.cert.name, cwd=self.dir,
        )
        return pair


class TlsRedisServer(RedisServer):
    """A ``redis-server`` that speaks only TLS, with ``pair`` as its certificate.

    ``client_certs``: ``"yes"`` requires a client certificate the CA signed (mutual TLS),
    ``"no"`` accepts clients without one.
    """

    def __init__(self, certs: Certificates, pair: Pair | None = None,
                 client_certs: str = "no") -> None:
        pair = pair or certs.server
        super().__init__(extra=[
            "--tls-cert-file", str(pair.cert), "--tls-key-file", str(pair.key),
            "--tls-ca-cert-file", str(certs.ca.cert), "--tls-auth-clients", client_certs,
        ])
        # RedisServer.start passes --port first; this later one wins: a TLS port only.
        self.extra += ["--port", "0", "--tls-port", str(self.port)]
        self.certs = certs

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        certs = self.certs
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), "--tls", "--cacert", str(certs.ca.cert),
             "--cert", str(certs.client.cert), "--key", str(certs.client.key), *args],
            capture_output=True, text=True, check=True,
        )
        return out.stdout.strip()


class TlsNatsServer(NatsServer):
    """A ``nats-server -js`` that requires TLS; ``verify=True`` also requires a client
    certificate the CA signed (mutual TLS)."""

    def __init__(self, certs: Certificates, pair: Pair | None = None,
                 verify: bool = False) -> None:
        super().__init__()
        self.pair = pair or certs.server
        self.certs = certs
        self.verify = verify

    @property
    def tls_url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def start(self) -> TlsNatsServer:
        conf = self.dir / "server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f'jetstream {{ store_dir: "{self.dir}" }}\n'
            "tls {\n"
            f'  cert_file: "{self.pair.cert}"\n'
            f'  key_file: "{self.pair.key}"\n'
            f'  ca_file: "{self.certs.ca.cert}"\n'
            f"  verify: {'true' if self.verify else 'false'}\n"
            "  timeout: 5\n"
            "}\n"
        )
        self.process = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        return self


class TlsClusterNode(ClusterNode):
    """A cluster node that speaks TLS only, to clients and on its cluster bus."""

    def __init__(self, port: int, directory: Path, certs: Certificates) -> None:
        super().__init__(port, directory)
        self.client.close()
        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10,
                                   **client_tls(certs))
        self.certs = certs

    def start(self) -> None:
        certs = self.certs
        self.process = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server", "--port", "0",
                "--tls-port", str(self.port), "--tls-cluster", "yes",
                "--tls-cert-file", str(certs.server.cert), "--tls-key-file", str(certs.server.key),
                "--tls-ca-cert-file", str(certs.ca.cert), "--tls-auth-clients", "no",
                "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "no", "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / f"nodes-{self.port}.conf"),
                "--cluster-node-timeout", "5000", "--logfile", str(self.dir / f"{self.port}.log"),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_for_port(self.port)


class TlsCluster(PrivateCluster):
    """Three TLS masters; the bus port of each is its TLS port + 10000."""

    def __init__(self, certs: Certificates) -> None:
        super().__init__()
        self.certs = certs

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.nodes[0].port}/0"

    def _start_once(self) -> None:
        certs = self.certs
        self.nodes = [TlsClusterNode(port, self.dir, certs) for port in cluster_ports(3)]
        for node in self.nodes:
            node.start()
        subprocess.run(
            ["redis-cli", "--tls", "--cacert", str(certs.ca.cert), "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, check=True, timeout=30,
        )
        self.wait_ok()


def client_tls(certs: Certificates, client_cert: bool = True) -> dict[str, str | bool]:
    """redis-py arguments for a TLS client of the test servers (for setup and checks)."""
    options: dict[str, str | bool] = {"ssl": True, "ssl_ca_certs": str(certs.ca.cert)}
    if client_cert:
        options.update(ssl_certfile=str(certs.client.cert), ssl_keyfile=str(certs.client.key))
    return options


# -- shared by the TLS tests ------------------------------------------------------------------


def trusting(certs: Certificates, **settings) -> TlsSettings:
    """Settings that trust the test CA (plus what ``settings`` add)."""
    return TlsSettings(ca=str(certs.ca.cert), **settings)


def with_client_cert(certs: Certificates) -> TlsSettings:
    return trusting(certs, cert=str(certs.client.cert), key=str(certs.client.key))


def run(*args: str) -> tuple[int, str]:
    """``python -m supervisor ARGS`` in this process: (exit code, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(args))
    return code, out.getvalue()


def status(config: Path) -> dict:
    code, out = run("status", str(config), "--json")
    assert code == 0, out
    return orjson.loads(out)
