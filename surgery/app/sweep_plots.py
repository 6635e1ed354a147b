"""The pictures of a sweep: one metric against the swept value, or every metric (a heatmap over two keys).

A sweep directory may come from others, and its size decides a figure's: the cost is checked before
anything is drawn (:func:`too_large`), and a figure past the bounds is not drawn (the summary says why;
summary.csv holds every value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgery.files.write import write_figure

MAX_PANELS = 16  # metrics side by side in one figure
MAX_CELLS = 2_500  # heatmap cells per panel (e.g. 50 x 50)
MAX_POINTS = 2_000  # jobs on one line plot
MAX_INCHES = 60.0  # a figure's width or height (6,000 pixels at 100 dpi)
LABELLED_CELLS = 400  # heatmaps larger than this leave out the number in each cell


def too_large(panels: int, cells: int = 0, points: int = 0) -> str | None:
    """Why a figure of ``panels`` panels (``cells`` heatmap cells or ``points`` points each) is not drawn, or None."""
    if panels > MAX_PANELS:
        return f"{panels} metrics, more than the {MAX_PANELS} panels a figure holds"
    if cells > MAX_CELLS:
        return f"a heatmap of {cells:,} cells, more than {MAX_CELLS:,}"
    if points > MAX_POINTS:
        return f"{points:,} jobs, more than the {MAX_POINTS:,} points a plot holds"
    return None


def _inches(value: float) -> float:
    return min(value, MAX_INCHES)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metric(path: Path, points: dict[str, float], metric: str, axis: dict[str, Any]) -> None:
    """Draw the metric against the x axis into a PNG: one line per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(_inches(max(7.0, 0.5 * len(points))), 4.5), dpi=100)
    try:
        draw_lines(ax, points, axis, annotate=len(points) <= 100)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} over {len(points)} job(s)")
        fig.tight_layout()
        write_figure(path, fig, "summary.png")
    finally:
        plt.close(fig)


def draw_lines(ax: Any, points: dict[str, float], axis: dict[str, Any], annotate: bool) -> None:
    """Points of ``{job: y}`` at ``axis["values"][job]``, a line per series, job labels as ticks if by index."""
    series: dict[str, list[str]] = {}
    for job in sorted(points, key=lambda j: axis["values"][j]):
        series.setdefault(axis["series"].get(job, ""), []).append(job)
    by_index = bool(axis["ticks"])  # jobs side by side: points, no line between them
    for name, members in series.items():
        xs = [axis["values"][j] for j in members]
        ys = [points[j] for j in members]
        ax.plot(xs, ys, marker="o", linewidth=0 if by_index else 1.5, label=name or None)
        if annotate:
            for x_value, y_value in zip(xs, ys):
                ax.annotate(f"{y_value:.4g}", (x_value, y_value), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=8)  # fmt: skip
    if by_index:
        jobs = list(axis["ticks"])
        slanted = len(jobs) > 8
        ax.set_xticks([axis["values"][j] for j in jobs])
        ax.set_xticklabels([axis["ticks"][j] for j in jobs], fontsize=8, rotation=40 if slanted else 0,
                           ha="right" if slanted else "center")  # fmt: skip
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.set_xlabel(axis["label"])
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.08, y=0.15)


def plot_metrics(
    path: Path, values: dict[str, dict[str, float]], baseline: dict[str, float], axis: dict[str, Any]
) -> None:
    """One panel per metric: the surgered value per job, the unmodified model's as a dashed line."""
    plt = _pyplot()
    names = list(values)
    fig, axes = plt.subplots(1, len(names), figsize=(_inches(max(4.5 * len(names), 7.0)), 4.2), dpi=100,
                             squeeze=False)  # fmt: skip
    try:
        for ax, name in zip(axes[0], names):
            draw_lines(ax, values[name], axis, annotate=len(values[name]) <= 12)
            if name in baseline:
                ax.axhline(baseline[name], color="grey", linestyle="--", linewidth=1, label="unmodified")
                ax.legend(fontsize=8)
            ax.set_title(name)
        fig.tight_layout()
        write_figure(path, fig, "summary.png")
    finally:
        plt.close(fig)


def plot_heatmaps(path: Path, values: dict[str, dict[str, float]], rows: dict[str, str], cols: dict[str, str],
                  labels: tuple[str, str]) -> None:  # fmt: skip
    """One heatmap per metric over two swept keys: ``rows[job]`` and ``cols[job]`` place each job's value."""
    plt = _pyplot()
    row_keys = _ordered(rows.values())
    col_keys = _ordered(cols.values())
    names = list(values)
    width = max(4.0, 0.6 * len(col_keys) + 2.5)
    fig, axes = plt.subplots(1, len(names), figsize=(_inches(width * len(names)),
                             _inches(max(3.5, 0.5 * len(row_keys) + 2))), dpi=100, squeeze=False)  # fmt: skip
    row_at = {key: i for i, key in enumerate(row_keys)}
    col_at = {key: j for j, key in enumerate(col_keys)}
    try:
        for ax, name in zip(axes[0], names):
            grid = [[float("nan")] * len(col_keys) for _ in row_keys]
            for job, value in values[name].items():
                grid[row_at[rows[job]]][col_at[cols[job]]] = value
            image = ax.imshow(grid, cmap="viridis", aspect="auto")
            labelled = len(row_keys) * len(col_keys) <= LABELLED_CELLS
            for i, row in enumerate(grid if labelled else []):
                for j, value in enumerate(row):
                    if value == value:  # not NaN
                        ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=8, color="white")
            ax.set_xticks(range(len(col_keys)), col_keys, fontsize=8, rotation=30, ha="right")
            ax.set_yticks(range(len(row_keys)), row_keys, fontsize=8)
            ax.set_xlabel(labels[1])
            ax.set_ylabel(labels[0])
            ax.set_title(name)
            fig.colorbar(image, ax=ax, label=name)
        fig.tight_layout()
        write_figure(path, fig, "summary.png")
    finally:
        plt.close(fig)


def heatmap_cells(rows: dict[str, str], cols: dict[str, str]) -> int:
    """The cells of a heatmap placing each job at ``(rows[job], cols[job])``, counted without building it."""
    return len(set(rows.values())) * len(set(cols.values()))


def _ordered(values: Any) -> list[str]:
    """Distinct values, numerically sorted when they all are numbers, else in first-seen order."""
    distinct = list(dict.fromkeys(values))
    try:
        return sorted(distinct, key=float)
    except ValueError:
        return distinct
