"""Line charts drawn on the server as SVG: numbers only (no message text ever reaches a
chart), no JavaScript library, and they scale with the page.

Each chart carries its scale (round ticks from 0 to ``top``, with the unit) and its time
axis ("-5 min" ... "now") as text the template lays out beside it, and its samples as
numbers in data- attributes, which static/plots.js reads to show the value under the
pointer (the page's Content-Security-Policy runs no inline script).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Bases of a round tick step (times a power of ten).
STEPS = (1.0, 2.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class Chart:
    """What the template draws: a polyline's points in a ``width`` x ``height`` box."""

    points: str  # "x,y x,y ..." (numbers only)
    width: int
    height: int
    top: float  # the value at the top edge: the highest tick, a round number
    peak: float  # the largest value drawn (0 when none)
    last: float | None
    count: int
    span: float  # seconds from the left edge to the right
    end: float  # unix seconds at the right edge
    unit: str  # "" (a count) or "/s"
    y_ticks: tuple[str, ...]  # labels from the top edge down to 0, evenly spaced
    x_ticks: tuple[str, ...]  # labels from the left edge ("-5 min") to the right ("now")
    grid: tuple[float, ...]  # y of each tick's line in the box, top first
    ages: str  # each sample's seconds before ``end``, oldest first ("12.5 7.5 2.5")
    values: str  # each sample's value, in the same order


def chart(series: list[tuple[float, float]], end: float, span: float = 3600,
          width: int = 600, height: int = 120, ticks: int = 5, unit: str = "",
          whole: bool = True) -> Chart:
    """The last ``span`` seconds up to ``end``; the y axis from 0 to a round number above
    the largest value, in ``ticks`` labels (``whole``: counts, so no step below 1)."""
    shown = [(t, v) for t, v in series if end - span <= t <= end]
    peak = max((v for _, v in shown), default=0.0)
    step = tick_step(peak, ticks - 1, whole)
    top = step * (ticks - 1)
    points = " ".join(f"{_x(t, end, span, width):.1f},{_y(v, top, height):.1f}"
                      for t, v in shown)
    return Chart(
        points, width, height, top, peak, shown[-1][1] if shown else None, len(shown), span,
        end, unit,
        y_ticks=tuple(compact(step * n) + unit for n in range(ticks - 1, -1, -1)),
        x_ticks=tuple(before(span * (1 - n / (ticks - 1))) for n in range(ticks)),
        grid=tuple(round(_y(step * n, top, height), 1) for n in range(ticks - 1, -1, -1)),
        ages=" ".join(f"{end - t:.1f}" for t, _ in shown),
        values=" ".join(f"{v:.6g}" for _, v in shown),
    )


def _x(t: float, end: float, span: float, width: int) -> float:
    return width * (1 - (end - t) / span)


def _y(value: float, top: float, height: int) -> float:
    """2 units of margin above and below, so that a line at 0 or at the top shows."""
    return height - 2 - (height - 4) * value / top


def tick_step(peak: float, intervals: int, whole: bool = True) -> float:
    """The smallest round step (1, 2, 2.5 or 5 times a power of ten) whose ``intervals``
    reach ``peak``: 1,840 in 4 -> 500 (0 ... 2,000). A count's step is at least 1."""
    if peak <= 0:
        return 1.0
    raw = peak / intervals
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(base * power for base in STEPS if base * power >= raw * (1 - 1e-9))
    if whole and step < 1:
        return 1.0
    if whole and step == 2.5:  # 2.5 messages is no count
        return 5.0
    return step


def compact(value: float) -> str:
    """A tick label: 0, 0.25, 40, 900, 2.5k, 1.2M (at most 3 significant digits)."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def before(seconds: float) -> str:
    """A time-axis label: "now", "-40 s", "-15 min", "-1 h"."""
    if seconds < 0.5:
        return "now"
    if seconds < 120:
        return f"-{seconds:.0f} s"
    if seconds < 3600:
        return f"-{seconds / 60:.0f} min"
    return f"-{seconds / 3600:.3g} h"


def span(first: float | None, end: float, longest: float = 3600, shortest: float = 60) -> float:
    """The seconds a chart shows: the last hour, or since the first sample when the
    dashboard is younger than that (a minute at least), so that a new one is readable."""
    if first is None:
        return shortest
    return min(longest, max(shortest, end - first))
