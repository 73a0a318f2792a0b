"""Every process of a job logs in the job's format: the stats-usage example's chDB writer (a
process the handlers start, not a fork of the supervisor) included."""

from __future__ import annotations

import signal

import orjson
import pytest

from examples.stats_usage import make_payload
from support.envelopes import publish
from support.supervision import counter, wait_for, write_config

pytestmark = pytest.mark.slow  # every test here takes a second or more


def test_every_line_of_the_stats_usage_job_is_json_the_writers_too(
    redis_url, client, tmp_path, supervisors
):
    config = write_config(tmp_path, redis_url, handler="examples.stats_usage:handle",
                          job={"coroutines": 1})
    publish(client, [make_payload("p1", {"executions": 1})])
    supervisor = supervisors(config, redis_url, STATS_USAGE_DB=str(tmp_path / "usage.chdb"))
    wait_for(lambda: counter(client, "success") == 1, 120, "the message to be counted")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(60) == 0, supervisor.output()
    records = [orjson.loads(line) for line in supervisor.output().splitlines() if line]
    writer = [r for r in records if r["logger"] == "stats-usage writer"]
    assert any(r["message"].startswith("serving ") and r["level"] == "info" for r in writer)
    assert {r["process"] for r in writer}.isdisjoint({supervisor.pid})
