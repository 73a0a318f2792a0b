"""What a hostile review of issue 25 found: each test failed before its fix."""

from __future__ import annotations

import pytest

from support.supervision import keys
from tests.test_failed_jobs import conf, listed, php_failed, run  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_url_override")


async def test_retry_steps_over_a_pid_that_is_not_utf8(conf, run, redis_client):  # noqa: F811
    """A corrupt entry at the oldest end stopped every `retry --all` with a traceback
    (UnicodeDecodeError), so nothing behind it could ever be retried."""
    await redis_client.lpush(keys().failed, b"\xff\xfe-not-utf8")
    good = await php_failed(redis_client, "failed", {"ok": 1})
    code, out = await run("failed", conf, "retry", "--all", "--dry-run")
    assert code == 1 and "would move (dry run, nothing changed) 1 failed" in out and "left 1 job records" in out and "not UTF-8" in out
    code, out = await run("failed", conf, "retry", "--all")
    assert code == 1 and "moved 1 failed jobs" in out and good in out
    assert await redis_client.lrange(keys().failed, 0, -1) == [b"\xff\xfe-not-utf8"]
    assert await redis_client.llen(keys().ready) == 1
