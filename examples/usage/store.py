"""What every usage store keeps and promises (see ``examples.usage`` for the choice of one)."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class Usage(NamedTuple):
    """One validated message: what it adds to which project, and in which hour."""

    pid: str
    project: str
    period: int  # Unix seconds of the start of the hour the message was published in
    metrics: list[tuple[str, int]]


class NoTotals(Exception):
    """The target holds no usage totals (it does not exist, or no job has written it)."""


class Store(Protocol):
    def add(self, batch: list[Usage]) -> None:
        """Count every message of ``batch`` not counted before; durable when it returns."""

    def totals(self) -> dict[tuple[str, str], int]:
        """Every total: ``{(project, metric): value}``."""

    def seen(self) -> set[str]:
        """The pids counted (messages with at least one metric, for ClickHouse)."""

    def close(self) -> None: ...
