"""The chaos soak on a Redis Cluster with replicas, CI-sized: real supervisors while the
queue's master fails over (a manual CLUSTER FAILOVER, then a SIGKILL and an election, in
turn), with handler and supervisor kills between. Nothing may be lost and the totals must
stay exact; a failover may only cost duplicate runs. The long run is
``python -m bench.chaos --broker redis-cluster`` (docs/chaos-soak.md)."""

from __future__ import annotations

import pytest

from support.soak_run import soak

pytestmark = pytest.mark.slow  # every test here takes a second or more


@pytest.mark.timeout(150)
def test_cluster_soak_through_failovers_loses_nothing():
    result = soak("redis-cluster", "--messages", "1200", "--seconds", "16", "--seed", "5",
                  "--gap", "4,5", "--faults", "failover,supervisor_kill", "--store", "sqlite")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "failover" in result.stdout and "supervisor_kill" in result.stdout
