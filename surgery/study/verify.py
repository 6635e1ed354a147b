"""``verify_top: K``: the K cells an attribution estimates to matter most, run exactly and compared."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from surgery.study.baselines import label, normalized
from surgery.study.cells import Run
from surgery.study.result import StudyResult
from surgery.study.resume import Progress


def verified(run: Run, result: StudyResult, top: int, grid_cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``top`` cells by |estimated effect| on the first metric, exact; their estimates; Pearson and Spearman."""
    name = result.metrics[0]
    estimate = result.mean[name].reshape(-1)
    unmodified = 0.0 if result.normalized == name else float(run.base[name].nanmean())
    chosen = torch.argsort((estimate - unmodified).abs().nan_to_num(-1.0), descending=True)[:top].tolist()
    exact_run = dataclasses.replace(run, attribution=None, k=1, base={}, src_base={}, baseline_plans={}, named={})
    progress = Progress.fresh([m.name for m in run.bound], len(run.plans), run.data.examples)
    progress.done[:] = True
    progress.done[chosen] = False
    exact_run.score(progress)
    values = progress.values[name][chosen]
    scale = result.normalization
    if scale is not None and scale["metric"] == name:  # on the study's own scale (its baselines, already run)
        zero, one = (result.baselines[label(scale[end])][name] for end in ("zero", "one"))
        values = normalized(values, zero, one, scale["over"], name)[0]
    exact = values.nanmean(dim=-1)
    guessed = estimate[chosen]
    return {
        "metric": name,
        "cells": [grid_cells[i] for i in chosen],
        "estimate": guessed.tolist(),
        "exact": exact.tolist(),
        "pearson": correlation(guessed, exact),
        "spearman": spearman(guessed, exact),
    }


def correlation(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Pearson's r of two vectors; None for fewer than two values or no spread."""
    if a.numel() < 2:
        return None
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    scale = float(a.norm() * b.norm())
    return float((a * b).sum()) / scale if scale > 0 else None


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rho of two vectors: Pearson's r of their ranks (ties share their mean rank)."""
    return correlation(_ranks(a), _ranks(b))


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks from 0, ties sharing their mean rank (Spearman's convention)."""
    order = torch.argsort(values)
    ranks = torch.empty_like(values, dtype=torch.float64)
    ranks[order] = torch.arange(len(values), dtype=torch.float64)
    for value in values.unique():
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks
