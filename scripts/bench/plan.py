"""Plan compile time on models of 1k, 10k, 100k and 1M modules built on the meta device.

Five glob/type actions of kinds that bind without touching weights (capture, log,
modify_output) are compiled with ``surgery.plan``; the baseline matches the same five
patterns by hand: one ``named_modules()`` walk, then one compiled regex per pattern over
every module. Each tree is built once (GC disabled while building, and without ``reset_parameters``:
on meta there are no values to initialise, and it took three quarters of the build); ``gc.freeze()``
then moves its objects out of the collector's reach, so a collection of the tree never lands inside a
timing. The 1M-module tree takes about 3 GiB and a minute or more to build; ``--sizes`` picks others.

    python -m scripts.bench.plan [--quick] [--sizes 1000,10000,100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surgery
from scripts.bench.common import machine, write_json

TARGET_S = 0.5  # surgery.plan at 100k modules
TARGET_RATIO = 1.05  # surgery.plan / the hand-written walk plus regexes at 100k modules (issue 32)
TARGET_MODULES = 100_000
LINEAR_GROWTH = 12.0  # per 10x modules: linear (10x) with room for timing noise
LINEAR_TO = 1_000_000  # the curve is judged linear only when it reaches this many modules
SIZES = [1_000, 10_000, 100_000, 1_000_000]
ACTIONS = {
    "qk": {"kind": "capture", "select": "layers.*.attn.[qk]"},
    "norms": {"kind": "modify_output", "type": "LayerNorm", "op": "mul", "value": 1.0},
    "fc2": {"kind": "capture", "select": "**.mlp.fc2"},
    "acts": {"kind": "log", "type": "GELU"},
    "blocks": {"kind": "modify_output", "select": "layers.*", "exclude": "layers.1*", "op": "add", "value": 0.0},
}
# The same five selections as plain regexes: (on the name or on the class name, pattern, exclude pattern)
BASELINE = [
    ("name", r"layers\.[^.]*\.attn\.[qk]", None),
    ("type", r"LayerNorm", None),
    ("name", r"(?:[^.]+\.)*mlp\.fc2", None),
    ("type", r"GELU", None),
    ("name", r"layers\.[^.]*", r"layers\.1[^.]*"),
]


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)


class Block(nn.Module):
    """12 modules: itself, two LayerNorms, attention (q, k, v, o) and an MLP (fc1, act, fc2)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d), FeedForward(d)


class Stack(nn.Module):
    """``layers.0..n-1`` of ``Block``: 12 n + 2 modules."""

    def __init__(self, blocks: int, d: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(blocks))


def build(modules: int) -> tuple[nn.Module, float]:
    """A meta-device Stack of about ``modules`` modules, and the CPU seconds it took to build.

    ``reset_parameters`` of Linear and LayerNorm is skipped while building: on meta it draws nothing,
    only dispatches the init ops (75% of the build time); the tree, its names and shapes are the same.
    """
    start = time.process_time()
    classes = (nn.Linear, nn.LayerNorm)
    saved = [vars(c)["reset_parameters"] for c in classes]
    gc.disable()  # 100k modules are a million objects: collections during the build only cost time
    try:
        for c in classes:
            c.reset_parameters = lambda self: None  # type: ignore[method-assign]
        with torch.device("meta"):
            model = Stack(max(1, math.ceil((modules - 2) / 12)))  # at least `modules`: 100k means 100k
    finally:
        for c, method in zip(classes, saved):
            c.reset_parameters = method  # type: ignore[method-assign]
        gc.enable()
    return model, time.process_time() - start


def rss_mib() -> tuple[float, float]:
    """This process's resident memory now and its peak so far, MiB."""
    now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def baseline(model: nn.Module) -> list[int]:
    """Hand-written matching: one walk, one regex per pattern per module."""
    named = list(model.named_modules())
    counts = []
    for on, pattern, exclude in BASELINE:
        match = re.compile(pattern).fullmatch
        drop = re.compile(exclude).fullmatch if exclude else None
        if on == "name":
            hits = [m for n, m in named if match(n) and not (drop and drop(n))]
        else:
            hits = [m for _, m in named if match(type(m).__name__)]
        counts.append(len(hits))
    return counts


def plan_counts(model: nn.Module) -> list[int]:
    plan = surgery.plan(model, ACTIONS, reuse=False)  # compiled every time: the plan cache would find it again
    return [len(step.targets) for step in plan.steps]


def breakdown(model: nn.Module) -> dict[str, float]:
    """Where ``surgery.plan`` spends its time: the module walk, the index, the plan warnings (internal names;
    a part whose function no longer exists is left out)."""
    from surgery.core import plan_warnings, select

    plan = surgery.plan(model, ACTIONS, reuse=False)
    parts: dict[str, Callable[[], Any]] = {"named_modules() walk": lambda: list(model.named_modules())}
    index_of = getattr(getattr(select, "ModuleIndex", None), "of", None)
    if callable(index_of):
        parts["ModuleIndex.of (surgery's walk: names, modules, classes)"] = lambda: index_of(model)
    warnings = [getattr(plan_warnings, name, None) for name in ("overlap_warnings", "partial_structure_warnings")]
    if all(callable(w) for w in warnings) and plan.index is not None:
        overlap, partial = warnings
        parts["plan warnings (when first read)"] = lambda: (overlap(plan.steps), partial(plan.steps, plan.index))  # type: ignore[misc]
    return {name: timed(fn, 3)[0] for name, fn in parts.items()}


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median CPU seconds of ``fn`` over ``repeat`` calls, and its last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 10k modules only")
    parser.add_argument("--sizes", help=f"comma-separated module counts (default {','.join(map(str, SIZES))})")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else [1_000, 10_000] if args.quick else SIZES
    surgery.plan(build(100)[0], ACTIONS, reuse=False)  # warm imports and caches outside the timings
    rows = []
    parts: dict[str, float] = {}
    for size in sizes:
        before_mib, _ = rss_mib()
        model, build_s = build(size)
        gc.collect()
        gc.freeze()
        tree_mib = rss_mib()[0] - before_mib
        count = sum(1 for _ in model.modules())
        repeat = 5 if size == TARGET_MODULES or size < 100_000 else 3
        plan_times, base_times, got, want = [], [], None, None
        for _ in range(repeat):  # interleaved: each round's ratio compares runs made side by side
            plan_one, got = timed(lambda m=model: plan_counts(m), 1)
            base_one, want = timed(lambda m=model: baseline(m), 1)
            plan_times.append(plan_one)
            base_times.append(base_one)
        plan_s, base_s = statistics.median(plan_times), statistics.median(base_times)
        ratios = [a / b for a, b in zip(plan_times, base_times)]
        if got != want:
            raise AssertionError(f"{count} modules: surgery.plan matched {got}, the regex baseline {want}")
        if size == sizes[-1]:
            parts = breakdown(model)
        rows.append(
            {
                "modules": count,
                "build_s": build_s,
                "plan_s": plan_s,
                "baseline_s": base_s,
                "ratio": plan_s / base_s,
                "round_ratio": statistics.median(ratios),  # median of the per-round ratios
                "round_ratios": ratios,
                "plan_us_per_module": plan_s / count * 1e6,
                "repeats": repeat,
                "matched": got,
                "tree_mib": tree_mib,
                "peak_rss_mib": rss_mib()[1],  # the process's peak so far: this tree, planned (smaller ones are freed)
            }
        )
        print(
            f"{count:>9} modules: build {build_s:6.2f} s  plan {plan_s:.3f} s  baseline {base_s:.3f} s"
            f"  plan/baseline {plan_s / base_s:.2f}  {plan_s / count * 1e6:.2f} µs/module"
            f"  tree {tree_mib:.0f} MiB, peak RSS {rows[-1]['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
        if parts:
            print("  " + "; ".join(f"{name} {seconds:.3f} s" for name, seconds in parts.items()), flush=True)
        del model
        gc.unfreeze()
        gc.collect()
    largest = rows[-1]
    growth = [b["plan_s"] / a["plan_s"] for a, b in zip(rows, rows[1:])]
    at_target = next((r for r in rows if r["modules"] >= TARGET_MODULES), None)
    result = {
        "machine": machine(),
        "gc": "disabled while a tree is built, then `gc.freeze()` moves the tree out of the collector's"
        " generations; collections stay enabled during the timings",
        "actions": ACTIONS,
        "target_s": TARGET_S,
        "target_ratio": TARGET_RATIO,
        "ratio_met": at_target is not None and at_target["round_ratio"] <= TARGET_RATIO,
        "target_modules": TARGET_MODULES,
        "linear_growth": LINEAR_GROWTH,
        "linear_to": LINEAR_TO,
        "rows": rows,
        "met": at_target is not None and at_target["plan_s"] <= TARGET_S,
        "linear": largest["modules"] >= LINEAR_TO and all(g <= LINEAR_GROWTH for g in growth),
        "growth_10x": growth,
        "breakdown": {"modules": largest["modules"], **parts},
    }
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
