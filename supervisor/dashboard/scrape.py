"""Read a supervisor's own metrics endpoint (``[supervisor] metrics_port`` of its job file):
prefetch use, busy handler processes and handler latency percentiles. Only the supervisor
at that address is read (one per host and port); a job file without a port has none."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.config import Config
from supervisor.metrics import PREFIX

#: Seconds for the whole request.
TIMEOUT = 2.0
#: Bytes of answer read at most.
MAX_ANSWER = 1 << 20


async def read(config: Config) -> dict[str, Any] | None:
    """The figures, None if the job has no metrics endpoint; {"error": ...} if unreadable."""
    sup = config.supervisor
    if not sup.metrics_port:
        return None
    where = f"{sup.metrics_host}:{sup.metrics_port}"
    try:
        async with asyncio.timeout(TIMEOUT):
            reader, writer = await asyncio.open_connection(sup.metrics_host, sup.metrics_port)
            try:
                writer.write(b"GET /metrics HTTP/1.0\r\nHost: dashboard\r\n\r\n")
                answer = await reader.read(MAX_ANSWER)
            finally:
                writer.close()
    except (OSError, TimeoutError) as error:
        return {"where": where, "error": f"metrics endpoint {where} unreadable: {error!r}"}
    _, _, body = answer.partition(b"\r\n\r\n")
    return {"where": where, **figures(body.decode(errors="replace"))}


def figures(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    build: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{PREFIX}_build_info":  # served by newer supervisors
                    build = dict(sample.labels)
                elif sample.name.endswith("_bucket"):
                    if sample.labels.get("operation", "settle") == "settle":
                        buckets.setdefault(sample.name, []).append(
                            (float(sample.labels["le"]), sample.value))
                else:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except (ValueError, KeyError, IndexError) as error:
        return {"error": f"metrics answer unreadable: {error}"}
    handler = buckets.get(f"{PREFIX}_handler_seconds_bucket", [])
    settle = buckets.get(f"{PREFIX}_broker_call_seconds_bucket", [])
    return {
        "version": build.get("version"),
        "python": build.get("python"),
        "outstanding": values.get(f"{PREFIX}_buffer_outstanding"),
        "prefetch": values.get(f"{PREFIX}_buffer_prefetch"),
        "busy": values.get(f"{PREFIX}_busy_handlers"),
        "committed": values.get(f"{PREFIX}_deliveries_committed_total"),
        "rejected": values.get(f"{PREFIX}_deliveries_rejected_total"),
        "restarts": values.get(f"{PREFIX}_child_restarts_total"),
        "handler": {f"p{q}": quantile(handler, q / 100) for q in (50, 90, 99)},
        "settle": {f"p{q}": quantile(settle, q / 100) for q in (50, 90, 99)},
    }


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of a cumulative histogram
    (None: no observation; inf: beyond the last bound)."""
    ordered = sorted(buckets)
    total = ordered[-1][1] if ordered else 0
    if not total:
        return None
    for bound, count in ordered:
        if count >= q * total:
            return bound
    return float("inf")
