"""Read a supervisor's /metrics as a test does: every sample by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample the endpoint on ``port`` serves: (name, sorted labels) -> value."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The value of ``queue_supervisor_<name>`` with exactly ``labels``."""
    return samples[(f"queue_supervisor_{name}", tuple(sorted(labels.items())))]
