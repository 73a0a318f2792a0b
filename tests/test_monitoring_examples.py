"""examples/monitoring: the Prometheus alert rules and the Grafana dashboard use only
metrics the supervisor exports (a typo'd name would alert on nothing, silently)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker.base import Action
from broker.gauges import QueueGauges
from supervisor import metrics
from support.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "examples" / "monitoring" / "alerts.yml"
DASHBOARD = ROOT / "examples" / "monitoring" / "grafana-dashboard.json"
RULE_TESTS = ROOT / "tests" / "data" / "alerts_test.yml"
METRIC = re.compile(r"\b(queue_supervisor_[a-z0-9_]+)\b")
#: What every alert docs/metrics.md promises watches (issue 25 item 3).
ALERTED = {
    "queue_supervisor_ready_messages", "queue_supervisor_oldest_ready_age_seconds",
    "queue_supervisor_failed_messages", "queue_supervisor_dead_messages",
    "queue_supervisor_build_info", "queue_supervisor_ready",
    "queue_supervisor_unreplicated_writes_total", "queue_supervisor_broker_reconnects_total",
    "queue_supervisor_nats_leaderless_seconds", "queue_supervisor_slow_jobs",
    # issue 39.3: retries nobody promotes, while supervisors run and once none does
    "queue_supervisor_delayed_overdue_seconds", "queue_supervisor_delayed_messages",
}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name a supervisor serves, with each gauge of the sample known."""
    served = metrics.start("q", free_port(), broker="nats")
    try:
        every = {name: 1 for name in QueueGauges.__dataclass_fields__}
        served.gauges(QueueGauges(**{**every, "leader": True}))
        served.settled(Action.COMMIT)
        served.handler_done(0.1)
        served.rejected("failed", "ValueError")
        served.settle_batch(1, 0.001)
        with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics") as answer:
            text = answer.read().decode()
    finally:
        served.close()
    return {sample.name for family in text_string_to_metric_families(text)
            for sample in family.samples}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def panel_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert panels
    return [(panel["title"], target["expr"]) for panel in panels
            for target in panel["targets"]]


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed")
def test_promtool_accepts_the_rules():
    subprocess.run(["promtool", "check", "rules", str(ALERTS)], check=True)


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed")
def test_the_delayed_retry_alerts_fire_when_nobody_promotes_them():
    """Issue 39.3, by promtool's rule tests (tests/data/alerts_test.yml): the last
    supervisor killed with retries waiting fires QueueDelayedRetriesUnattended although it
    reports nothing any more; retries overdue beside running supervisors fire
    QueueDelayedRetriesOverdue; a queue still served, or lost with nothing delayed, fires
    neither."""
    done = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_complete_and_names_only_exported_metrics(exported):
    found = rules()
    assert len({rule["alert"] for rule in found}) == len(found)
    used = set()
    for rule in found:
        assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
        names = set(METRIC.findall(rule["expr"]))
        assert names, f"{rule['alert']} watches no metric of ours"
        assert names <= exported, f"{rule['alert']}: {sorted(names - exported)} not exported"
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        used |= names
    assert used >= ALERTED, sorted(ALERTED - used)


def test_every_dashboard_panel_names_only_exported_metrics(exported):
    shown = set()
    for title, expr in panel_exprs():
        names = set(METRIC.findall(expr))
        assert names, f"panel {title!r} shows no metric of ours"
        assert names <= exported, f"panel {title!r}: {sorted(names - exported)} not exported"
        shown |= names
    alerted = {name for rule in rules() for name in METRIC.findall(rule["expr"])}
    assert alerted <= shown, f"alerted on but not on the dashboard: {sorted(alerted - shown)}"


def test_a_misspelt_metric_would_be_caught(exported):
    assert not set(METRIC.findall("rate(queue_supervisor_deliveries_comitted_total[5m])")) \
        <= exported


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed")
def test_promtool_parses_every_dashboard_expression(tmp_path):
    """Each panel's query, as a recording rule ($queue as Grafana would fill it in)."""
    records = [{"record": f"panel:{index}", "expr": expr.replace("$queue", ".*")}
               for index, (_, expr) in enumerate(panel_exprs())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": records}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_canary_table_compares_the_supervisors_of_a_queue_by_instance():
    """Issue 41 item 9: per supervisor (instance) its prefetch, coroutines, jobs/s, CPU per
    job, messages per reserve and per settle call, queue wait p50/p99 and retries."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    [table] = [panel for panel in panels if panel["title"].startswith("Supervisors side by side")]
    assert table["type"] == "table"
    shown = {target["legendFormat"]: target["expr"] for target in table["targets"]}
    assert list(shown) == ["prefetch", "coroutines", "jobs/s", "CPU µs per job",
                           "msgs per reserve", "msgs per settle", "queue wait p50 (s)",
                           "queue wait p99 (s)", "retries (10 min)"]
    for name, expr in shown.items():
        assert "instance" in expr, name  # one row per supervisor, not per queue
    assert "queue_supervisor_cpu_seconds_total" in shown["CPU µs per job"]
    assert 'operation="receive"' in shown["msgs per reserve"]
    assert "queue_supervisor_settle_batch_size_sum" in shown["msgs per settle"]
    assert "queue_supervisor_queue_wait_seconds_bucket" in shown["queue wait p99 (s)"]
    assert 'outcome="retrying"' in shown["retries (10 min)"]
    assert all(target.get("instant") and target.get("format") == "table"
               for target in table["targets"])
    assert [step["id"] for step in table["transformations"]] == ["merge", "organize"]
