"""A Redis too old for LMOVE/BLMOVE is refused at start with one line and exit 5 (no
restart loop); the version is read with HELLO, which a least-privilege ACL user may send."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from broker.redis import version
from broker.redis.connection import NO_CLIENT_INFO
from support.servers import RedisServer
from support.supervision import Supervisor, write_config


def test_hello_replies_in_resp2_and_resp3_give_the_server_and_its_version() -> None:
    resp2 = [b"server", b"redis", b"version", b"6.2.14", b"proto", 2, b"id", 7]
    assert version.parse(resp2) == ("redis", (6, 2, 14))
    assert version.parse({"server": "valkey", "version": "8.1.8"}) == ("valkey", (8, 1, 8))
    with pytest.raises(ValueError, match="no version"):
        version.parse([b"server", b"redis"])


@pytest.mark.parametrize(("server", "shown", "refused"), [
    ("redis", (6, 0, 16), True), ("redis", (5, 0, 7), True), ("redis", (6, 2, 0), False),
    ("redis", (7, 0, 15), False), ("valkey", (8, 1, 8), False), ("valkey", (7, 2, 5), False),
])
def test_only_redis_before_6_2_is_refused(server: str, shown: tuple[int, ...],
                                          refused: bool) -> None:
    reason = version.refusal("Redis at redis://127.0.0.1:1/0", server, shown)
    assert (reason is not None) == refused
    if reason:
        assert ".".join(map(str, shown)) in reason and "needs Redis 6.2 or later" in reason


def test_a_least_privilege_user_may_read_the_version(own_redis_server: RedisServer) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    admin.execute_command("ACL", "SETUSER", "only-ping", "on", ">pw", "+ping")
    user = redis.Redis(port=own_redis_server.port, username="only-ping", password="pw",
                       **NO_CLIENT_INFO)
    _, found = version.parse(user.execute_command("HELLO"))
    assert found >= version.MINIMUM


@pytest.mark.slow
def test_a_server_without_hello_is_refused_at_start_with_one_line(tmp_path: Path) -> None:
    # No Redis older than 6.0 is at hand; one with HELLO renamed away answers as one would.
    server = RedisServer(extra=["--rename-command", "HELLO", ""]).start()
    try:
        config = write_config(tmp_path, server.url, handler="examples.noop:handle")
        supervisor = Supervisor(config, tmp_path, "")
        assert supervisor.wait(30) == 5  # REFUSED: systemd does not restart it
        records = [orjson.loads(line) for line in supervisor.output().splitlines()]
        errors = [r for r in records if r["level"] in ("error", "critical")]
        assert len(errors) == 1, supervisor.output()
        assert "older than Redis 6.0" in errors[0]["message"]
        assert f"127.0.0.1:{server.port}/0" in errors[0]["message"]
    finally:
        server.close()
