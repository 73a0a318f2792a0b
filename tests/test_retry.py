"""The one retry policy both adapters use (``broker.retry``)."""

from __future__ import annotations

import pytest

from broker.retry import RetryPolicy


@pytest.mark.parametrize(("budget", "attempts", "exhausted"), [
    (1, 0, True), (3, 0, False), (3, 1, False), (3, 2, True), (3, 7, True), (5, 4, True),
])
def test_the_run_that_uses_the_last_of_the_budget_gives_up(budget, attempts, exhausted):
    assert RetryPolicy(budget).exhausted(attempts) is exhausted


def test_delays_double_per_run_or_follow_a_consumers_list():
    policy = RetryPolicy(5, backoff=1.5)
    assert [policy.delay(n) for n in range(4)] == [1.5, 3.0, 6.0, 12.0]
    assert [policy.delay(n, [2, 4]) for n in range(4)] == [2, 4, 4, 4]  # the last repeats
    assert RetryPolicy(3).delay(2) == 0


def test_a_budget_below_one_run_is_refused():
    with pytest.raises(ValueError, match="at least 1 run"):
        RetryPolicy(0)


@pytest.mark.parametrize(("attempts", "after"), [
    (-(2**63), 1), (-1, 1), (0, 1), (4, 5), (2**63 - 2, 2**63 - 1), (2**63 - 1, 2**63 - 1),
])
def test_a_negative_count_is_no_earlier_run_and_the_count_stays_in_64_bits(attempts, after):
    assert RetryPolicy.next_attempts(attempts) == after
    assert RetryPolicy(3).exhausted(attempts) is (max(attempts, 0) >= 2)
    assert not RetryPolicy(2).exhausted(-(2**63))  # it still gets its budget's runs
