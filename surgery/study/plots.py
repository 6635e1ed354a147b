"""Pictures of a study, one PNG per metric: two variables a heatmap (positions labelled by their
tokens), one variable a line with its confidence band, more a heatmap panel per value of the others.

A figure's size is computed from the grid before anything is drawn (:func:`layout`): a wide heatmap is
squeezed to fit ``FIGURE_MAX_PIXELS`` while each cell keeps a few pixels, and one past the caps of
:mod:`surgery.safe.costs` is not drawn at all: its numbers go to ``study_METRIC.csv`` beside, and
:func:`undrawn` says why, for the report.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surgery.files.write import write_figure, write_text
from surgery.safe.costs import FIGURE_MAX_PIXELS, FIGURE_MIN_CELL_PIXELS, figure_refusal

if TYPE_CHECKING:
    from surgery.study.result import StudyResult

POSITION_NAMES = ("pos", "position", "positions")
DPI = 100
MAX_TICKS = 100  # tick labels an axis shows at most; a longer axis labels every k-th value
CELL_WIDTH, CELL_HEIGHT, MARGIN = 0.5, 0.45, 2.0  # inches a heatmap cell takes (before squeezing) and around it


@dataclass(frozen=True)
class Layout:
    """A heatmap figure's size, worked out from the grid alone: panels, their grid, inches, and why not drawn."""

    panels: int
    columns: int
    rows: int
    width: float  # inches
    height: float
    refused: str | None  # why it is not drawn, or None


def layout(result: StudyResult) -> Layout:
    """The heatmap figure of ``result``'s grid (two or more variables), squeezed to fit the pixel cap if it can."""
    names = list(result.grid)
    panels = math.prod(len(result.grid[n]) for n in names[:-2])
    columns = min(panels, 4)
    rows = math.ceil(panels / columns)
    across, down = len(result.grid[names[-1]]), len(result.grid[names[-2]])
    cap = FIGURE_MAX_PIXELS / DPI
    cell_w = min(CELL_WIDTH, (cap / columns - MARGIN) / across)  # a wide grid: narrower cells, same figure cap
    cell_h = min(CELL_HEIGHT, (cap / rows - MARGIN) / down)
    width = max(5.0, cell_w * across + MARGIN) * columns
    height = (cell_h * down + MARGIN) * rows
    refused = figure_refusal(width, height, DPI, panels)
    if refused is None and min(cell_w, cell_h) * DPI < FIGURE_MIN_CELL_PIXELS:
        refused = (f"{across:,} × {down:,} cells in {panels:,} panel(s) leave under {FIGURE_MIN_CELL_PIXELS} pixels"
                   f" a cell within {FIGURE_MAX_PIXELS:,} × {FIGURE_MAX_PIXELS:,} pixels")  # fmt: skip
    return Layout(panels, columns, rows, width, height, refused)


def undrawn(result: StudyResult) -> dict[str, str]:
    """The figures :func:`plot_study` does not draw, by file name, each with why and where the numbers are."""
    if len(result.grid) < 2:
        return {}
    why = layout(result).refused
    if why is None:
        return {}
    return {f"study_{m}.png": f"not drawn: {why}; its numbers are in study_{m}.csv beside it" for m in result.metrics}


def plot_study(result: StudyResult, directory: Path) -> list[Path]:
    """Write ``study_METRIC.png`` for every metric into ``directory``; returns the paths."""
    written = []
    skipped = undrawn(result)
    for name in result.metrics:
        if f"study_{name}.png" in skipped:  # too large to draw: the metric's rows of study.csv instead
            path = directory / f"study_{name}.csv"
            write_text(path, result.csv_text(name))
        else:
            path = directory / f"study_{name}.png"
            _write(path, study_figure(result, name))
        written.append(path)
    if result.verify:
        path = directory / "study_verify.png"
        _write(path, verify_figure(result.verify))
        written.append(path)
    return written


def _write(path: Path, fig: Any) -> None:
    try:
        write_figure(path, fig, dpi=DPI)
    finally:
        fig.clear()


def verify_figure(verify: dict[str, Any]) -> Any:
    """The scatter of ``verify_top``: each verified cell's estimate against its exact value, with the diagonal."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 5))
    ax = fig.add_subplot(1, 1, 1)
    estimate, exact = verify["estimate"], verify["exact"]
    ax.scatter(exact, estimate)
    low, high = min(exact + estimate), max(exact + estimate)
    ax.plot([low, high], [low, high], linestyle="--", color="grey")
    ax.set_xlabel(f"exact {verify['metric']}")
    ax.set_ylabel(f"estimated {verify['metric']}")
    r, rho = verify["pearson"], verify["spearman"]
    ax.set_title(f"top {len(exact)} cells: Pearson {r if r is None else f'{r:.3f}'},"
                 f" Spearman {rho if rho is None else f'{rho:.3f}'}")  # fmt: skip
    return fig


def study_figure(result: StudyResult, metric: str) -> Any:
    """The matplotlib Figure of one metric's means (see the module docstring for its layout)."""
    from matplotlib.figure import Figure

    names = list(result.grid)
    means = result.mean[metric]
    title = f"{metric}{' (normalized)' if result.normalized == metric else ''}, mean over examples"
    if len(names) == 1:
        fig = Figure(figsize=(6, 4))
        _line(fig.add_subplot(1, 1, 1), result, metric, names[0])
        fig.suptitle(title)
        return fig
    rest = names[:-2]
    shape = layout(result)
    if shape.refused is not None:
        raise ValueError(f"study_{metric}.png is not drawn: {shape.refused}")
    combos = list(itertools.product(*(range(len(result.grid[n])) for n in rest)))
    x_name, y_name = names[-1], names[-2]
    fig = Figure(figsize=(shape.width, shape.height))
    for k, combo in enumerate(combos):
        ax = fig.add_subplot(shape.rows, shape.columns, k + 1)
        panel = means[combo] if combo else means
        limit = float(panel.abs().nan_to_num(0).max()) or 1.0
        if float(panel.nan_to_num(0).min()) >= 0:  # probabilities, ranks, losses: a one-sided scale from 0
            image = ax.imshow(panel.float().numpy(), cmap="viridis", vmin=0, vmax=limit, aspect="auto")
        else:  # signed effects: white at 0, red up, blue down
            image = ax.imshow(panel.float().numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        turned = 90 if result.tokens and x_name in POSITION_NAMES else 0
        _ticks(ax.set_xticks, _labels(result, x_name), rotation=turned)
        _ticks(ax.set_yticks, [str(v) for v in result.grid[y_name]])
        ax.set_xlabel(x_name)
        ax.set_ylabel(y_name)
        if combo:
            ax.set_title(", ".join(f"{n}={result.grid[n][i]}" for n, i in zip(rest, combo, strict=True)))
        fig.colorbar(image, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _line(ax: Any, result: StudyResult, metric: str, name: str) -> None:
    xs = list(range(len(result.grid[name])))
    ax.plot(xs, result.mean[metric].float().numpy(), marker="o")
    if metric in result.ci_low:
        low, high = result.ci_low[metric].float().numpy(), result.ci_high[metric].float().numpy()
        ax.fill_between(xs, low, high, alpha=0.3, label=f"{result.ci:.0%} CI")
        ax.legend()
    _ticks(ax.set_xticks, _labels(result, name), rotation=90 if result.tokens and name in POSITION_NAMES else 0)
    ax.set_xlabel(name)
    ax.set_ylabel(metric)


def _ticks(set_ticks: Any, labels: list[str], rotation: int = 0) -> None:
    """At most MAX_TICKS labelled ticks (every k-th value): thousands of labels cost more than the picture."""
    every = max(1, math.ceil(len(labels) / MAX_TICKS))
    at = range(0, len(labels), every)
    set_ticks(list(at), [labels[i] for i in at], rotation=rotation)


def _labels(result: StudyResult, name: str) -> list[str]:
    values = result.grid[name]
    tokens = result.tokens
    if tokens is not None and name in POSITION_NAMES:
        return [f"{tokens[v]!r}"[1:-1] + f" ({v})" if isinstance(v, int) and -len(tokens) <= v < len(tokens)
                else str(v) for v in values]  # fmt: skip
    return [str(v) for v in values]
