"""Small inline SVG charts drawn here, not by a library: an x-y chart (points, a line, the diagonal) with axes.

Every label is escaped; each point carries a ``<title>`` (the browser's own tooltip) with its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from surgery.report.page import escape

WIDTH, HEIGHT, PAD = 420, 320, 48


@dataclass(frozen=True)
class Point:
    """One point of a chart: its coordinates and what its tooltip says."""

    x: float
    y: float
    label: str = ""


def _span(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    if low == high:
        low, high = low - 0.5, high + 0.5
    margin = (high - low) * 0.05
    return low - margin, high + margin


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) between ``low`` and ``high``, about ``count`` of them."""
    raw = (high - low) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step)
    return [i * step for i in range(first, math.floor(high / step) + 1)]


def _tick(value: float) -> str:
    return f"{0.0 if abs(value) < 1e-12 else value:.3g}"


def xy_chart(
    points: Sequence[Point], x_label: str, y_label: str, line: bool = False, diagonal: bool = False, title: str = ""
) -> str:
    """An SVG chart of ``points`` (a polyline through them with ``line``, the y = x line with ``diagonal``)."""
    shown = [p for p in points if math.isfinite(p.x) and math.isfinite(p.y)]
    xs, ys = [p.x for p in shown], [p.y for p in shown]
    if diagonal:
        xs = ys = xs + ys
    x0, x1 = _span(xs)
    y0, y1 = _span(ys)
    if line and ys and all(-0.05 <= v <= 1.05 for v in ys):  # a fraction (faithfulness): show 0 and 1
        y0, y1 = min(y0, -0.05), max(y1, 1.05)

    def sx(v: float) -> float:
        return PAD + (v - x0) / (x1 - x0) * (WIDTH - 2 * PAD)

    def sy(v: float) -> float:
        return HEIGHT - PAD - (v - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    parts = [f'<rect class="frame" x="{PAD}" y="{PAD}" width="{WIDTH - 2 * PAD}" height="{HEIGHT - 2 * PAD}"/>']
    for v in _ticks(x0, x1):
        below = HEIGHT - PAD + 14
        parts.append(f'<text class="tick" x="{sx(v):.1f}" y="{below}" text-anchor="middle">{_tick(v)}</text>')
    for v in _ticks(y0, y1):
        parts.append(f'<text class="tick" x="{PAD - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{_tick(v)}</text>')
    if diagonal:
        low, high = max(x0, y0), min(x1, y1)
        parts.append(f'<line class="diagonal" x1="{sx(low):.1f}" y1="{sy(low):.1f}" x2="{sx(high):.1f}"'
                     f' y2="{sy(high):.1f}"/>')  # fmt: skip
    if line and shown:
        path = " ".join(f"{sx(p.x):.1f},{sy(p.y):.1f}" for p in shown)
        parts.append(f'<polyline class="curve" points="{path}"/>')
    for p in shown:
        tip = f"<title>{escape(p.label)}</title>" if p.label else ""
        parts.append(f'<circle class="dot" cx="{sx(p.x):.1f}" cy="{sy(p.y):.1f}" r="4">{tip}</circle>')
    parts.append(f'<text class="axis" x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(f'<text class="axis" x="12" y="{HEIGHT / 2}" text-anchor="middle"'
                 f' transform="rotate(-90 12 {HEIGHT / 2})">{escape(y_label)}</text>')  # fmt: skip
    if title:
        parts.append(f'<text class="title" x="{WIDTH / 2}" y="20" text-anchor="middle">{escape(title)}</text>')
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}"'
            f' role="img">{"".join(parts)}</svg>')  # fmt: skip
