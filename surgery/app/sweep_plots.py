"""The pictures of a sweep: one metric against the swept value, or every metric (a heatmap over two keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metric(path: Path, points: dict[str, float], metric: str, axis: dict[str, Any]) -> None:
    """Draw the metric against the x axis into a PNG: one line per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * len(points)), 4.5), dpi=100)
    try:
        draw_lines(ax, points, axis, annotate=True)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} over {len(points)} job(s)")
        fig.tight_layout()
        fig.savefig(path, format="png")
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
    fig, axes = plt.subplots(1, len(names), figsize=(max(4.5 * len(names), 7.0), 4.2), dpi=100, squeeze=False)
    try:
        for ax, name in zip(axes[0], names):
            draw_lines(ax, values[name], axis, annotate=len(values[name]) <= 12)
            if name in baseline:
                ax.axhline(baseline[name], color="grey", linestyle="--", linewidth=1, label="unmodified")
                ax.legend(fontsize=8)
            ax.set_title(name)
        fig.tight_layout()
        fig.savefig(path, format="png")
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
    fig, axes = plt.subplots(1, len(names), figsize=(width * len(names), max(3.5, 0.5 * len(row_keys) + 2)),
                             dpi=100, squeeze=False)  # fmt: skip
    try:
        for ax, name in zip(axes[0], names):
            grid = [[float("nan")] * len(col_keys) for _ in row_keys]
            for job, value in values[name].items():
                grid[row_keys.index(rows[job])][col_keys.index(cols[job])] = value
            image = ax.imshow(grid, cmap="viridis", aspect="auto")
            for i, row in enumerate(grid):
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
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def _ordered(values: Any) -> list[str]:
    """Distinct values, numerically sorted when they all are numbers, else in first-seen order."""
    distinct = list(dict.fromkeys(values))
    try:
        return sorted(distinct, key=float)
    except ValueError:
        return distinct
