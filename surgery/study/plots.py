"""Pictures of a study, one PNG per metric: two variables a heatmap (positions labelled by their
tokens), one variable a line with its confidence band, more a heatmap panel per value of the others."""

from __future__ import annotations

import itertools
import math
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surgery.files.write import write_atomic

if TYPE_CHECKING:
    from surgery.study.result import StudyResult

MAX_PANELS = 16
POSITION_NAMES = ("pos", "position", "positions")
DPI = 100


def plot_study(result: StudyResult, directory: Path) -> list[Path]:
    """Write ``study_METRIC.png`` for every metric into ``directory``; returns the paths."""
    written = []
    for name in result.metrics:
        fig = study_figure(result, name)
        path = directory / f"study_{name}.png"
        try:
            write_atomic(path, partial(_save, fig))
        finally:
            fig.clear()
        written.append(path)
    if result.verify:
        fig = verify_figure(result.verify)
        path = directory / "study_verify.png"
        try:
            write_atomic(path, partial(_save, fig))
        finally:
            fig.clear()
        written.append(path)
    return written


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


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, format="png", dpi=DPI)


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
    combos = list(itertools.product(*(range(len(result.grid[n])) for n in rest)))[:MAX_PANELS]
    columns = min(len(combos), 4)
    rows = math.ceil(len(combos) / columns)
    x_name, y_name = names[-1], names[-2]
    fig = Figure(
        figsize=(max(5, 0.5 * len(result.grid[x_name]) + 2) * columns, (0.45 * len(result.grid[y_name]) + 2) * rows)
    )
    for k, combo in enumerate(combos):
        ax = fig.add_subplot(rows, columns, k + 1)
        panel = means[combo] if combo else means
        limit = float(panel.abs().nan_to_num(0).max()) or 1.0
        if float(panel.nan_to_num(0).min()) >= 0:  # probabilities, ranks, losses: a one-sided scale from 0
            image = ax.imshow(panel.float().numpy(), cmap="viridis", vmin=0, vmax=limit, aspect="auto")
        else:  # signed effects: white at 0, red up, blue down
            image = ax.imshow(panel.float().numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        turned = 90 if result.tokens and x_name in POSITION_NAMES else 0
        ax.set_xticks(range(len(result.grid[x_name])), _labels(result, x_name), rotation=turned)
        ax.set_yticks(range(len(result.grid[y_name])), [str(v) for v in result.grid[y_name]])
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
    ax.set_xticks(xs, _labels(result, name), rotation=90 if result.tokens and name in POSITION_NAMES else 0)
    ax.set_xlabel(name)
    ax.set_ylabel(metric)


def _labels(result: StudyResult, name: str) -> list[str]:
    values = result.grid[name]
    tokens = result.tokens
    if tokens is not None and name in POSITION_NAMES:
        return [f"{tokens[v]!r}"[1:-1] + f" ({v})" if isinstance(v, int) and -len(tokens) <= v < len(tokens)
                else str(v) for v in values]  # fmt: skip
    return [str(v) for v in values]
