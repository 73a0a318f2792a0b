"""Who takes the blame when a handler process dies (supervisor.blame)."""

from __future__ import annotations

from broker.base import Delivery
from supervisor import blame
from supervisor.buffer import Entry


def entries(count: int) -> list[Entry]:
    return [Entry(n, Delivery(f"p{n}", "q", 0, 0, {}, b"", None)) for n in range(1, count + 1)]


def ids(found: list[Entry]) -> list[int]:
    return [entry.id for entry in found]


def split(running: list[Entry], *, concurrent: bool, returned: set[int], overdue: set[int]):
    """``(blamed, rerun)``, with the ``returned`` ones reported HELD by the process."""
    for entry in running:
        entry.held = entry.id in returned
    blamed = blame.blamed(running, concurrent=concurrent, overdue=overdue)
    return blamed, [entry for entry in running if entry not in blamed]


def test_one_at_a_time_the_newest_started_takes_the_blame():
    blamed, rerun = split(entries(3), concurrent=False, returned=set(), overdue=set())
    assert (ids(blamed), ids(rerun)) == ([3], [1, 2])


def test_a_crash_with_thirty_in_flight_blames_every_running_one_and_no_returned_one():
    running = entries(30)
    returned = {entry.id for entry in running[::3]}  # ten had returned, waiting for flush()
    blamed, rerun = split(running, concurrent=True, returned=returned, overdue=set())
    assert ids(rerun) == sorted(returned)
    assert ids(blamed) == [entry.id for entry in running if entry.id not in returned]


def test_our_kill_for_a_timeout_blames_only_the_overdue():
    blamed, rerun = split(entries(5), concurrent=True, returned={1}, overdue={2, 4})
    assert (ids(blamed), ids(rerun)) == ([2, 4], [1, 3, 5])


def test_a_death_while_only_returned_ones_wait_blames_them_as_a_failing_flush_would():
    blamed, rerun = split(entries(3), concurrent=True, returned={1, 2, 3}, overdue=set())
    assert (ids(blamed), ids(rerun)) == ([1, 2, 3], [])
