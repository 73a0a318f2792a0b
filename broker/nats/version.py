"""The oldest nats-server this broker can share a queue on, checked at every connection.

2.10.0 brought what the queue's setup relies on: stream and consumer ``metadata`` (queue 5's
queue identity, and its ``utopia_queue_spare_delivery`` mark that keeps one delivery of
MaxDeliver spare) and a consumer's ``filter_subjects`` (the work and retry subjects).
An older server accepts the request and silently drops both: the consumer then filters
nothing we asked for, looks foreign at every check, and the spare delivery runs as one more
attempt (3 attempts become 4). Refused before anything is created.
"""

from __future__ import annotations

import re
from typing import Any

from broker.base import BrokerRefused
from broker.urls import redact

MINIMUM = (2, 10, 0)
WHY = ("stream and consumer metadata and a consumer's filter_subjects, which older servers "
       "drop without a word: queue 5's spare delivery would run as one more attempt")
_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


class ServerTooOld(BrokerRefused):
    """The server answered, but lacks what the queue needs: restarting cannot help."""


def parse(version: str) -> tuple[int, int, int] | None:
    match = _VERSION.match(version.strip())
    if match is None:
        return None
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def check(server: str, server_info: dict[str, Any]) -> None:
    """Raise ServerTooOld when the INFO of ``server`` (host:port) names a version below
    MINIMUM (a version that cannot be read is let through: a development build, say)."""
    version = str(server_info.get("version", ""))
    parsed = parse(version)
    if parsed is None or parsed >= MINIMUM:
        return
    raise ServerTooOld(
        f"NATS server at {redact(server)} runs version {version}; this supervisor needs "
        f"{'.'.join(map(str, MINIMUM))} or newer ({WHY}): upgrade nats-server"
    )
