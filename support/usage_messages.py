"""Messages for calling the stats-usage example handler in-process, without a worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from examples.stats_usage import make_payload


@dataclass
class Message:
    """Stands in for the worker's message object."""

    pid: str
    payload: dict[str, Any]
    queue: str = "stats-usage"
    timestamp: int = 1_700_000_000
    attempts: int = 0
    receipt: Any = field(default=None, repr=False)


def message(pid: str, project: str = "p1", **metrics: int) -> Message:
    return Message(pid, make_payload(project, metrics))
