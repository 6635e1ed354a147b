"""A study in ``report.html``: the data of the interactive heatmap, read from the run's ``study.safetensors``,
the baselines, and the ``verify_top`` scatter.

The heatmap's numbers are the float32 values of ``study.safetensors`` written in their shortest form (the script
reads them back with ``Math.fround``, so a cell shows exactly what the file holds). Cells are in the grid's
row-major order, as ``study.csv`` lists them; per-example values are in the page up to ``VALUES_MAX`` numbers,
past that the first examples of every cell (the page says how many).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from surgery.files.libraries import safetensors_reader
from surgery.report.page import escape, mapping, number, table
from surgery.report.svg import Point, xy_chart

VALUES_MAX = 100_000  # per-example numbers in the page, over every metric (about 1 MB of text)
POSITION_NAMES = ("pos", "position", "positions")  # an axis labelled by the first example's tokens


def compact(tensor: Any) -> list[float | None]:
    """A tensor's values as float32 in their shortest decimal form (NaN and ±inf as None)."""
    texts = tensor.detach().float().reshape(-1).cpu().numpy().astype(str)
    return [v if math.isfinite(v) else None for v in (float(t) for t in texts)]


def axes(grid: Mapping[str, list], tokens: list[str] | None) -> list[dict[str, Any]]:
    """Each grid variable: name, values as text, and (a position axis with tokens) each position's token."""
    found = []
    for name, values in grid.items():
        axis: dict[str, Any] = {"name": str(name), "values": [str(v) for v in values]}
        if tokens and name in POSITION_NAMES:
            axis["tokens"] = [tokens[v] if isinstance(v, int) and -len(tokens) <= v < len(tokens) else None
                              for v in values]  # fmt: skip
        found.append(axis)
    return found


def study_data(section: Mapping[str, Any], out_dir: Path) -> dict[str, Any] | None:
    """The heatmap's data for the page: axes, and per metric the means, interval bounds and per-example values."""
    grid, names = section.get("grid"), section.get("metrics")
    if not isinstance(grid, Mapping) or not isinstance(names, list) or "mean" not in section:
        return None  # mode=plan: no numbers yet
    cells = math.prod(len(v) for v in grid.values())
    metrics = []
    with safetensors_reader(out_dir / "study.safetensors", "report.html") as f:
        keys = set(f.keys())
        first = f.get_slice(f"values/{names[0]}").get_shape()
        examples = int(first[-1])
        shown = max(1, min(examples, VALUES_MAX // max(1, cells * len(names))))
        for name in names:
            part = f.get_slice(f"values/{name}")
            values = part[tuple([slice(None)] * (len(part.get_shape()) - 1) + [slice(0, shown)])]
            bounds = {b: compact(f.get_tensor(f"{b}/{name}")) if f"{b}/{name}" in keys else None
                      for b in ("ci_low", "ci_high")}  # fmt: skip
            metrics.append({"name": str(name), "normalized": section.get("normalized") == name,
                            "mean": compact(f.get_tensor(f"mean/{name}")), "low": bounds["ci_low"],
                            "high": bounds["ci_high"], "values": compact(values)})  # fmt: skip
    tokens = section.get("tokens")
    tokens = [str(t) for t in tokens] if isinstance(tokens, list) else None
    return {"axes": axes(grid, tokens), "cells": cells, "examples": examples, "shown": shown,
            "ci": section.get("ci"), "metrics": metrics}  # fmt: skip


def study_html(section: Mapping[str, Any], data: dict[str, Any] | None) -> str:
    """The study's sections: what was run, one heatmap placeholder per metric (report.js draws it), the baselines."""
    grid = mapping(section.get("grid"))
    sizes = " × ".join(f"{name} ({len(values)})" for name, values in grid.items())
    facts = f"{sizes}: {section.get('cells')} cells"
    if data is None:
        return f"<p>{escape(facts)}, planned and checked (mode=plan); nothing run.</p>"
    facts += f" × {data['examples']} examples"
    if section.get("method"):
        facts += f", method {section['method']}"
    parts = [f"<p>{escape(facts)}. Hover a cell for its numbers; click it for its per-example values.</p>"]
    if data["shown"] < data["examples"]:
        parts.append(f'<p class="warn">The page holds the first {data["shown"]} of {data["examples"]} examples of'
                     " each cell; every one is in study.safetensors (values/METRIC).</p>")  # fmt: skip
    for i, metric in enumerate(data["metrics"]):
        label = metric["name"] + (" (normalized)" if metric["normalized"] else "")
        parts.append(f'<div class="heatmap" data-metric="{i}"><h3>{escape(label)}, mean over examples</h3></div>')
    parts.append('<div id="detail" class="detail" hidden></div>')
    parts.append(_baselines(section))
    scale = section.get("normalization")
    if isinstance(scale, Mapping):
        ends = {end: scale[end] if isinstance(scale.get(end), str) else f"the actions {_names(scale.get(end))} alone"
                for end in ("zero", "one")}  # fmt: skip
        over = " on the means over examples" if scale.get("over") == "mean" else " per example"
        parts.append(f"<p>{escape(scale.get('metric'))} is normalized{escape(over)}: 0 = {escape(ends['zero'])},"
                     f" 1 = {escape(ends['one'])}.</p>")  # fmt: skip
    return "\n".join(parts)


def _names(value: Any) -> str:
    return ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _baselines(section: Mapping[str, Any]) -> str:
    base = section.get("baselines")
    if not isinstance(base, Mapping) or not base:
        return ""
    which = [w for w in base if isinstance(base[w], Mapping)]
    names = section.get("metrics") or []
    rows = [[name, *(number(base[w].get(name)) for w in which)] for name in names]
    return "<h3>Baselines (mean over examples)</h3>" + table(["metric", *which], rows, set(range(1, len(which) + 1)))


def verify_html(verify: Any) -> str:
    """``verify_top``: each verified cell's (or edge's) estimate against its exact value, the diagonal, correlations."""
    if not isinstance(verify, Mapping):
        return ""
    names = verify.get("cells") or verify.get("edges") or []
    estimate, exact = verify.get("estimate") or [], verify.get("exact") or []
    points = []
    for name, guess, value in zip(names, estimate, exact):
        where = " ".join(f"{k}={v}" for k, v in name.items()) if isinstance(name, Mapping) else str(name)
        if isinstance(guess, (int, float)) and isinstance(value, (int, float)):
            points.append(Point(float(value), float(guess), f"{where}: exact {value:.4g}, estimated {guess:.4g}"))
    r, rho = verify.get("pearson"), verify.get("spearman")
    title = f"top {len(points)}: Pearson {number(r)}, Spearman {number(rho)}"
    metric = str(verify.get("metric", ""))
    return xy_chart(points, f"exact {metric}", f"estimated {metric}", diagonal=True, title=title)
