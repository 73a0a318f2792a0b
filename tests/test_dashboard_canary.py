"""The canary's supervisors side by side on the queue page (issue 41 item 9): two real
supervisors of one Redis queue with different prefetch, under a steady publisher, each a
row with its prefetch and its rates (``supervisor.dashboard.compare``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.dashboard import Dashboard, poll, table_rows
from support.supervision import write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_url_override")]

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

COLUMNS = ("supervisor", "prefetch", "coroutines", "jobs/s", "cpu", "per_reserve",
           "per_settle", "wait", "retries", "over", "done")


def figure_rows(body: str) -> list[dict[str, str]]:
    """The "Supervisors side by side" table: each row's cells (text) by column."""
    rows = table_rows(body, "figures", COLUMNS)
    assert rows is not None, body
    return rows




def test_two_supervisors_of_one_queue_are_told_apart_by_prefetch_and_rates(
        tmp_path: Path, redis_url, supervisors, steady):
    configs = []
    for prefetch in (1, 32):
        folder = tmp_path / f"p{prefetch}"
        folder.mkdir()
        configs.append(write_config(folder, redis_url, handler="examples.noop:handle",
                                    job={"prefetch": prefetch}))
    launched = [supervisors(config, redis_url) for config in configs]
    dashboard = Dashboard([configs[0]], tmp_path)
    try:
        def both_moving() -> list[dict[str, str]] | None:
            rows = figure_rows(dashboard.client.get("/live/q/0")[1])
            moving = [row for row in rows if row["jobs/s"] not in ("—", "0.0")]
            return rows if len(rows) == 2 and len(moving) == 2 else None

        slow, fast = poll(both_moving, "two rows with their rates", timeout=60)
    finally:
        dashboard.stop()
    assert (slow["prefetch"], fast["prefetch"]) == ("1", "32")  # ordered by prefetch
    pids = {row["supervisor"].rsplit(" ", 1)[-1] for row in (slow, fast)}
    assert pids == {str(supervisor.pid) for supervisor in launched}
    for row in (slow, fast):
        assert row["coroutines"] == "1" and float(row["jobs/s"].replace(",", "")) > 0
        assert row["cpu"].endswith(" µs") and row["retries"] == "0"
        assert re.fullmatch(r"\d+ s / \d+ s", row["wait"]), row
        assert float(row["per_reserve"]) >= 1 and float(row["per_settle"]) >= 1
    assert float(slow["per_reserve"]) == 1.0  # prefetch 1: one message per reserve call


async def test_the_sampler_goes_on_when_the_figures_cannot_be_read():
    from types import SimpleNamespace

    from supervisor.dashboard.app import Dashboard as App
    from supervisor.figures import RateBook

    class Refusing:
        async def figures(self, consumers: list[str]) -> dict:
            raise RuntimeError("NOPERM")  # an ACL user of an older version, say

    queue = SimpleNamespace(name="q", rates=RateBook())
    await App.sample_figures(SimpleNamespace(interval=1.0), queue, Refusing(), ["a"])
    assert queue.rates.rates("a") is None
