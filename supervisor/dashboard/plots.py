"""Line charts drawn on the server as SVG: numbers only (no message text ever reaches a
chart), no JavaScript library, and they scale with the page."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Chart:
    """What the template draws: a polyline's points in a ``width`` x ``height`` box."""

    points: str  # "x,y x,y ..." (numbers only)
    width: int
    height: int
    top: float  # the value at the top edge
    last: float | None
    count: int
    span: float  # seconds from the left edge to the right


def chart(series: list[tuple[float, float]], end: float, span: float = 3600,
          width: int = 600, height: int = 120) -> Chart:
    """The last ``span`` seconds up to ``end``; the y axis from 0 to the largest value."""
    shown = [(t, v) for t, v in series if end - span <= t <= end]
    top = max((v for _, v in shown), default=0.0) or 1.0
    points = " ".join(
        f"{width * (1 - (end - t) / span):.1f},{height - 2 - (height - 4) * v / top:.1f}"
        for t, v in shown)
    return Chart(points, width, height, top, shown[-1][1] if shown else None, len(shown), span)


def span(first: float | None, end: float, longest: float = 3600, shortest: float = 60) -> float:
    """The seconds a chart shows: the last hour, or since the first sample when the
    dashboard is younger than that (a minute at least), so that a new one is readable."""
    if first is None:
        return shortest
    return min(longest, max(shortest, end - first))
