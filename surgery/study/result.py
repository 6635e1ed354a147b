"""What a study gives: per-example values shaped like the grid, their means and intervals, and the files.

``values[METRIC]`` is ``[*grid sizes, examples]``; ``mean``, ``ci_low`` and ``ci_high`` are
``[*grid sizes]``. ``baselines["unmodified"][METRIC]`` (and ``["source"]``) are ``[examples]``: the
metric on the unmodified model, and on the source run, which normalization compares with.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class StudyResult:
    """A study's results (see the module docstring for the shapes)."""

    grid: dict[str, list]
    cells: list[dict[str, Any]]
    values: dict[str, torch.Tensor]
    mean: dict[str, torch.Tensor]
    ci_low: dict[str, torch.Tensor] = field(default_factory=dict)
    ci_high: dict[str, torch.Tensor] = field(default_factory=dict)
    ci: float | None = None
    normalized: str | None = None  # the metric whose values are normalized, if any
    baselines: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    tokens: list[str] | None = None  # the first example's tokens, to label positions
    verify: dict[str, Any] | None = None  # verify_top: the top cells exact vs estimated, with correlations
    normalization: dict[str, Any] | None = None  # zero, one, over, metric and how many examples had no scale
    seconds: dict[str, float] = field(default_factory=dict)  # plan (parse, compile, probe) and run (every pass)

    @property
    def metrics(self) -> list[str]:
        """The metric names, in the order they were given."""
        return list(self.values)

    def tensors(self) -> dict[str, torch.Tensor]:
        """``values/M``, ``mean/M``, ``ci_low/M``, ``ci_high/M`` for every metric M: what study.safetensors holds."""
        out: dict[str, torch.Tensor] = {}
        for part, table in (("values", self.values), ("mean", self.mean), ("ci_low", self.ci_low),
                            ("ci_high", self.ci_high)):  # fmt: skip
            out.update({f"{part}/{name}": t.contiguous() for name, t in table.items()})
        return out

    def csv_text(self, metric: str | None = None) -> str:
        """One row per cell and metric (or only ``metric``): the grid values, the metric, its mean, ci_low, ci_high."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow([*self.grid, "metric", "mean", "ci_low", "ci_high"])
        for name in self.metrics if metric is None else [metric]:
            means = self.mean[name].reshape(-1)
            low = self.ci_low[name].reshape(-1) if name in self.ci_low else None
            high = self.ci_high[name].reshape(-1) if name in self.ci_high else None
            for i, cell in enumerate(self.cells):
                bounds = ["" if b is None else repr(float(b[i])) for b in (low, high)]
                writer.writerow([*cell.values(), name, repr(float(means[i])), *bounds])
        return buffer.getvalue()

    def to_csv(self, path: str | Path) -> Path:
        """Write :meth:`csv_text` to ``path``."""
        from surgery.files.write import write_text

        target = Path(path)
        write_text(target, self.csv_text())
        return target

    def plot(self, directory: str | Path) -> list[Path]:
        """``study_METRIC.png`` per metric in ``directory``: a heatmap, a line with its band, or panels."""
        from surgery.study.plots import plot_study

        return plot_study(self, Path(directory))

    def __repr__(self) -> str:
        sizes = " × ".join(f"{k}[{len(v)}]" for k, v in self.grid.items())
        examples = next(iter(self.values.values())).shape[-1] if self.values else 0
        return f"StudyResult({sizes}, {examples} examples, metrics: {', '.join(self.metrics)})"
