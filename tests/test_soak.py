"""The chaos soak, CI-sized: real supervisors, real servers, faults at seeded moments.

``python -m bench.chaos`` publishes stats-usage messages while it kills handler processes
and supervisors, stops supervisors with SIGTERM, cuts broker connections, flushes the Lua
script cache and restarts the broker; then it checks that every message was handled or
failed for good, that the usage totals (on the embedded ClickHouse engine, whose writer
process it kills too) are exact and that the broker holds nothing. The long run is the same
command with more ``--messages`` and ``--seconds``.

The unsafe variant (``tests/handlers/unsafe_usage.py``: acknowledged before its insert)
runs under handler and supervisor kills only, and must lose usage: what the barrier buys.
"""

from __future__ import annotations

import re
import shutil

import pytest

from support.soak_ledger import Ledger
from support.soak_run import failed_rows, soak


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_redis_soak_loses_nothing_and_keeps_totals_exact():
    result = soak("redis", "--messages", "2000", "--seconds", "36", "--seed", "7",
                  "--gap", "4,6")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "handler_kill" in result.stdout and "broker_restart" in result.stdout
    assert "writer_kill" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_the_barrier_kills_lose_acknowledged_usage():
    result = soak("redis", "--messages", "1500", "--seconds", "20", "--seed", "3",
                  "--gap", "3,4", "--faults", "handler_kill,supervisor_kill",
                  "--drain-timeout", "5", "--handler", "tests.handlers.unsafe_usage:handle")
    output = result.stdout + result.stderr[-3000:]
    assert result.returncode == 1, output
    # The one finding is the loss: nothing counted twice, the broker left clean.
    assert [row.split("  ")[0] for row in failed_rows(result.stdout)] == [
        "countable handled (seen) or failed for good"], output
    lost = int(re.search(r"^lost: (\d+) of \d+ countable", result.stdout, re.M).group(1))
    assert lost > 0, output
    executions = re.search(r"^executions +(-?\d+) +(\d+) +(-?\d+) +(-?\d+) +(-?\d+)$",
                           result.stdout, re.M)
    assert int(executions.group(5)) == lost, output  # each message counts 1 execution
    assert "LOST " in result.stdout
    kept = re.search(r"^kept: .* in (\S+)$", result.stdout, re.M)
    shutil.rmtree(kept.group(1))  # a failed run keeps its folder; this failure is expected


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_redis_soak_with_async_handlers_thirty_at_once_keeps_totals_exact():
    # The async stats-usage handler (aiosqlite), 30 deliveries at once per process, each
    # call 100 ms: handler kills strike processes with many deliveries in flight.
    result = soak("redis", "--messages", "1500", "--seconds", "20", "--seed", "5",
                  "--gap", "3,5", "--async-tasks", "30", "--work-ms", "100")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "x 30 async tasks" in result.stdout and "handler_kill" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_soak_fails_naming_a_lost_message_and_a_wrong_total():
    result = soak("redis", "--messages", "300", "--seconds", "4", "--gap", "100,100",
                  "--drain-timeout", "4", "--sabotage", timeout=50)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    [lost] = [line for line in result.stdout.splitlines() if line.startswith("LOST ")]
    assert "never reached a handler" in lost and "nowhere in Redis" in lost
    assert any(line.startswith("TOTAL (") for line in result.stdout.splitlines())
    assert result.stdout.rstrip().endswith("result (redis): FAIL")


def test_ledger_counts_duplicate_commits_and_reruns(tmp_path):
    path = tmp_path / "ledger"
    path.write_text(
        "I 1.0 10 a 0 x\n"  # a seeded failure: the next call is a retry, not a re-run
        "I 2.0 11 a 1 .\n"
        "C 2.1 11 a\n"
        "I 3.0 12 a 1 .\n"  # a re-run of a success
        "C 3.1 12 a\n"  # a duplicate commit
        "I 4.0 12 b 0 .\n"
        "C 4.1 12 b\n"
        "I 5.0 12 c 0"  # an incomplete line is left for the next read
    )
    ledger = Ledger(path)
    ledger.update()
    assert ledger.duplicate_commits() == [(2.1, 3.1, "a")]
    assert ledger.reruns() == [(2.0, 3.0, "a")]
    assert "c" not in ledger.calls
    assert ledger.first_commit("a") == 2.1
    with open(path, "a") as out:
        out.write(" .\n")
    ledger.update()
    assert [call.attempts for call in ledger.calls["c"]] == [0]


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_nats_soak_loses_nothing_and_keeps_totals_exact():
    result = soak("nats", "--messages", "2000", "--seconds", "36", "--seed", "7",
                  "--gap", "4,6")
    output = result.stdout + result.stderr[-3000:]
    assert failed_rows(result.stdout) == [], output
    assert result.returncode == 0, output
    assert "connection_cut" in result.stdout and "broker_restart" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("processes", [1, 2, 4])
def test_usage_totals_stay_exact_when_handlers_and_the_writer_are_killed(processes):
    # The writer answers a flush once the rows are in its log (not yet in the engine):
    # a handler killed mid-flush and the writer killed with rows only in its log (or mid
    # move into the engine) lose nothing and count nothing twice, with 1, 2, 4 processes
    # feeding the one writer.
    result = soak("redis", "--messages", "1500", "--seconds", "16", "--seed", str(processes),
                  "--gap", "2,3", "--faults", "handler_kill,writer_kill", "--supervisors", "1",
                  "--coroutines", str(processes), "--work-ms", "2")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "handler_kill" in result.stdout and "writer_kill" in result.stdout, result.stdout
    assert f"1 supervisors x {processes} handlers" in result.stdout, result.stdout
