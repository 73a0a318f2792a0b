"""supervisor.figures: the per-supervisor figures of the running jobs' copy and their rates
(issue 41 item 9: the canary's supervisors told apart)."""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import orjson
import psutil
import pytest

from broker.base import Action
from supervisor import figures, running
from supervisor.figures import Figures, QueueWait, RateBook, rates
from supervisor.metrics import Metrics


def reading(at: float, **totals: float) -> Figures:
    base = dict(prefetch=8, coroutines=2, tasks=1, done=0, failed=0, retried=0, reserved=0,
                reserve_calls=0, settled=0, settle_calls=0, cpu=0.0)
    return Figures(at, **{**base, **totals})  # type: ignore[arg-type]


def claimed(*stamps: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(timestamp=stamp) for stamp in stamps]


def test_the_queue_wait_is_whole_seconds_over_the_last_minute():
    wait = QueueWait()
    wait.add(claimed(*[1000] * 98, 998, 990), now=1000.7)  # 98 within the second
    assert wait.percentiles(now=1000.9) == (0, 2)
    assert wait.percentiles(now=1000 + figures.WAIT_WINDOW + 1) is None  # a minute later
    wait.add(claimed(1100), now=1105.2)
    assert wait.percentiles(now=1105.5) == (5, 5)  # this second's claims count at once
    assert wait.buckets()[1] == 101 - 1  # the histogram: as of the last roll
    wait.roll(1106)
    cumulative, count, total = wait.buckets()  # the histogram keeps all since the start
    assert count == 101 and total == 2 + 10 + 5
    assert dict(cumulative)[0.0] == 98 and dict(cumulative)[5.0] == 100
    assert dict(cumulative)[10.0] == 101


def test_a_future_or_absurd_timestamp_is_bounded():
    wait = QueueWait()
    wait.add(claimed(2000, -10**12), now=1000.0)
    wait.roll(1001)
    assert sorted(wait.total) == [0, figures.WAIT_CAP]


def test_percentiles_of_a_histogram():
    assert figures.percentiles({}) is None
    assert figures.percentiles({3: 1}) == (3, 3)
    assert figures.percentiles({0: 50, 1: 49, 7: 1}) == (0, 1)
    assert figures.percentiles({0: 50, 1: 48, 7: 2}) == (0, 7)


def test_rates_between_two_readings_of_one_supervisor():
    earlier = reading(100.0, done=1000, failed=10, retried=3, reserved=1010, reserve_calls=101,
                      settled=1000, settle_calls=50, cpu=10.0)
    later = reading(110.0, done=2990, failed=20, retried=7, reserved=3010, reserve_calls=201,
                    settled=3000, settle_calls=100, cpu=12.0)
    found = rates(earlier, later)
    assert found is not None
    assert found.seconds == 10 and found.jobs_per_s == pytest.approx(200)
    assert found.cpu_us_per_job == pytest.approx(1000)  # 2 s over 2,000 jobs
    assert found.per_reserve == pytest.approx(20) and found.per_settle == pytest.approx(40)
    assert found.retried == 4


def test_no_rate_without_time_or_across_a_restart_and_none_per_job_without_jobs():
    first = reading(100.0, done=500, cpu=3.0)
    assert rates(first, first) is None
    assert rates(first, reading(105.0, done=10)) is None  # a total went down
    idle = rates(first, reading(105.0, done=500, cpu=3.1))
    assert idle is not None and idle.jobs_per_s == 0
    assert (idle.cpu_us_per_job, idle.per_reserve, idle.per_settle) == (None, None, None)


def test_the_rate_book_spans_up_to_a_minute_per_supervisor_and_forgets_the_gone():
    book = RateBook()
    book.add({"a": reading(0.0), "b": reading(50.0)})
    assert book.rates("a") is None  # one reading: no rate yet
    for second in range(5, 100, 5):
        book.add({"a": reading(float(second), done=second * 10),
                  "b": reading(50.0 + second, done=second)})
    a = book.rates("a")
    assert a is not None and a.jobs_per_s == pytest.approx(10)
    assert a.seconds == pytest.approx(figures.RATE_SPAN)
    b = book.rates("b")
    assert b is not None and b.jobs_per_s == pytest.approx(1)
    book.add({"a": reading(200.0, done=2000)})
    assert book.rates("b") is None  # gone from the reading: dropped
    book.add({"a": reading(1.0, done=3)})  # restarted: its clock went back
    assert book.rates("a") is None


def test_the_copy_carries_the_figures_and_reads_them_back_within_bounds():
    mine = reading(12.5, done=7, cpu=0.25, wait_p50=0, wait_p99=3)
    raw = running.encode([], 30, 0.0, mine)
    copy = running.decode(raw, 30_000)
    assert copy is not None and copy.figures == mine and copy.running == 0
    assert running.decode(running.encode([], 30, 0.0), 30_000).figures is None  # older
    value = orjson.loads(raw)
    for crafted in ({**value["figures"], "v": 2}, {**value["figures"], "done": -1},
                    {**value["figures"], "cpu": "x"}, {**value["figures"], "done": 1e30},
                    {**value["figures"], "prefetch": True}, "figures"):
        again = running.decode(orjson.dumps({**value, "figures": crafted}), 30_000)
        assert again is not None and again.figures is None, crafted
    odd = running.decode(orjson.dumps({**value, "figures": {**value["figures"],
                                                            "wait_p99": "slow"}}), 30_000)
    assert odd is not None and odd.figures == dataclasses.replace(mine, wait_p99=None)


def test_the_metrics_count_what_the_figures_carry():
    metrics = Metrics()
    metrics.shape(32, 2, 1)
    metrics.received(10)
    metrics.broker_call("receive", 0.001)
    metrics.broker_call("receive", 0.001)
    metrics.broker_call("extend", 0.001)
    metrics.settle_batch(6, 0.001)
    metrics.settled(Action.COMMIT, 5)
    metrics.settled(Action.REJECT, 1)
    metrics.rejected("retrying in 2 s", "ValueError")
    metrics.rejected("failed", "ValueError")
    metrics.waited(claimed(int(time.time())))
    found = metrics.figures(now=3.0)
    assert (found.at, found.prefetch, found.coroutines, found.tasks) == (3.0, 32, 2, 1)
    assert (found.done, found.failed, found.retried) == (5, 1, 1)
    assert (found.reserved, found.reserve_calls, found.settled, found.settle_calls) == (
        10, 2, 6, 1)
    assert found.cpu > 0 and (found.wait_p50, found.wait_p99) == (0, 0)


def test_the_cpu_clock_counts_this_process_and_its_children():
    clock = figures.CpuClock()
    before = clock.seconds()
    pid = os.fork()
    if not pid:  # a child that spins a little, then exits (reaped below: its parent counts it)
        sum(range(3_000_000))
        os._exit(0)
    os.waitpid(pid, 0)
    assert clock.seconds() > before


def test_the_cpu_clock_lists_the_children_again_only_when_one_is_gone_or_late(monkeypatch):
    now = [0.0]
    clock = figures.CpuClock(clock=lambda: now[0])
    listed = []
    real = psutil.Process.children

    def children(self, recursive=False):
        listed.append(recursive)
        return real(self, recursive=recursive)

    monkeypatch.setattr(psutil.Process, "children", children)
    clock.seconds()
    clock.seconds()
    assert len(listed) == 1  # kept
    now[0] = figures.CHILDREN_EVERY
    clock.seconds()
    assert len(listed) == 2  # late: listed again
    child = os.fork()
    if not child:
        time.sleep(30)
        os._exit(0)
    now[0] = 2 * figures.CHILDREN_EVERY
    clock.seconds()  # listed with the child
    os.kill(child, 9)
    os.waitpid(child, 0)
    clock.seconds()  # the child is gone: listed again at once
    assert len(listed) == 4
