"""Attribution patching: ``surgery.study(method="attribution")`` against AtP written by hand, and IG's cost in steps.

    python -m scripts.bench.attribution [--quick] [--json out.json]

The 3-layer GPT-2 and the 3 × 13 layer × position residual-patching grid of scripts/bench/study.py
(4 prompts of 13 tokens, clean and corrupted). Attribution estimates every cell of the grid from one
clean forward and one forward + backward of the corrupted prompts.

* ``hand AtP``: plain hooks, as AtP is usually written: a clean pass caching every block's input, a
  corrupted pass whose pre-hooks keep each block's input gradient (``retain_grad``), the ``backward()`` of
  ``logit[3] - logit[4]`` summed over prompts (every weight's gradient too, cleared after), then
  ``(clean - corrupted)[:, pos] · grad[:, pos]`` per cell, plus the unmodified metric. Checked allclose to
  the study's values first.
* ``hand AtP, autograd.grad``: the same, the gradients taken with ``torch.autograd.grad`` at the block inputs
  only, as the study takes them (no weight gradients): the study's own fixed costs, against the same passes.
* ``study AtP``: ``surgery.study(..., method="attribution")``.
* ``forwards only``: the passes AtP of these sites cannot avoid, no hooks or products: a clean forward, a
  corrupted forward and the backward down to the first block's input: what share of a study's time is the
  model's own.
* ``one forward``: the corrupted prompts once without a gradient: the study's time in forwards.
* ``planning the cells``: what the study does before running anything (``surgery.study.template.derive``: one
  plan per distinct selection, each cell's edits derived from it): its share of the study.
* Memory: peak RSS added by an exact (``patch``) study and by attribution of the grid, each in a fresh process.
* Integrated gradients: ``method="integrated_gradients"`` at 1, 2, 4 and 8 steps: seconds against steps
  (one forward + backward per edited site and step, so linear in steps): the median of 5 rounds over every step count.

Target: study AtP / hand AtP ≤ 1.2 (reported too: against hand AtP by autograd.grad). CPU time, torch on one
thread, interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from scripts.bench.common import ROOT, Variant, interleave, machine, nothing, run_child, verdict, write_json
from scripts.bench.study import CORRECT, GRID, LAYERS, METRICS, PATCH, POSITIONS, PROMPTS, _hidden, setup

TARGET = 1.2
WIDE = 512  # the second model's hidden size: the same study where a forward costs more than the bookkeeping
IG_STEPS = (1, 2, 4, 8)
HAND, STUDY, FORWARDS, ONE, PLAN = "hand AtP", "study AtP", "forwards only", "one forward", "planning the cells"
GRADS = "hand AtP, autograd.grad"  # the same by hand, taking only the activations' gradients as the study does


def _diff(logits: Any) -> Any:
    z = logits[:, -1].double()
    return z[:, CORRECT] - z[:, CORRECT + 1]


def hand_atp(model: Any, clean: Any, corrupt: Any, grads_only: bool = False) -> Any:
    """Every cell's AtP estimate plus the unmodified metric, ``[layers, positions, prompts]``, by plain hooks.

    As AtP is usually written, the metric's ``backward()`` with ``retain_grad`` on each block's input (which also
    fills every weight's ``.grad``); with ``grads_only``, ``torch.autograd.grad`` at the block inputs alone.
    """
    import torch

    blocks, cache, held = model.transformer.h, {}, {}
    handles = [b.register_forward_pre_hook(lambda m, a, k, i=i: cache.__setitem__(i, _hidden(a, k)), with_kwargs=True)
               for i, b in enumerate(blocks)]  # fmt: skip
    with torch.no_grad():
        model(clean)
    for h in handles:
        h.remove()

    def leaf(m: Any, a: tuple, k: dict, i: int) -> None:
        x = _hidden(a, k)  # the residual stream: computed from the embedding's weights, so it has a graph
        if not grads_only:
            x.retain_grad()
        held[i] = x

    handles = [b.register_forward_pre_hook(lambda m, a, k, i=i: leaf(m, a, k, i), with_kwargs=True)
               for i, b in enumerate(blocks)]  # fmt: skip
    try:
        base = _diff(model(corrupt).logits)
        if grads_only:
            grads = torch.autograd.grad(base.sum(), [held[i] for i in range(LAYERS)])
        else:
            base.sum().backward()
            grads = [held[i].grad for i in range(LAYERS)]
    finally:
        for h in handles:
            h.remove()
    if not grads_only:
        model.zero_grad(set_to_none=True)
    out = torch.empty(LAYERS, POSITIONS, PROMPTS, dtype=torch.float64)
    for layer in range(LAYERS):
        delta = (cache[layer] - held[layer].detach()).double()
        out[layer] = base.detach() + (delta * grads[layer].double()).sum(-1).T
    return out


def forwards(model: Any, clean: Any, corrupt: Any) -> None:
    """The passes any AtP of these sites needs, without its hooks: a clean forward, a corrupted forward, and the
    backward down to the first block's input (``torch.autograd.grad`` there: no weight gradients)."""
    import torch

    with torch.no_grad():
        model(clean)
    first: dict[str, Any] = {}
    handle = model.transformer.h[0].register_forward_pre_hook(
        lambda m, a, k: first.__setitem__("x", _hidden(a, k)), with_kwargs=True
    )
    try:
        metric = _diff(model(corrupt).logits).sum()
    finally:
        handle.remove()
    torch.autograd.grad(metric, [first["x"]])


def by_study(model: Any, clean: Any, corrupt: Any, method: str, steps: int | None = None) -> Any:
    import surgery

    result = surgery.study(model, PATCH, GRID, corrupt, METRICS, source=clean, method=method, steps=steps)
    return result.values["logit_diff"]


def planning(model: Any) -> Any:
    """The study's planning alone: every cell's edits derived from one plan per selection (no forward)."""
    from surgery.core.compiler import load_actions
    from surgery.study.grid import cells, parse_grid
    from surgery.study.template import derive

    spec, grid_cells = load_actions(PATCH), cells(parse_grid(GRID, positions=POSITIONS))
    return lambda: derive(model, spec, grid_cells, 0, True, False)


def wider() -> dict[str, Any]:
    """The same grid on a model 8× wider (512, 32 heads): study AtP against AtP by hand, interleaved."""
    import torch

    model, clean, corrupt = setup(WIDE)
    torch.testing.assert_close(by_study(model, clean, corrupt, "attribution"), hand_atp(model, clean, corrupt),
                               rtol=1e-9, atol=1e-9)  # fmt: skip
    variants = [Variant(HAND, nothing, lambda: hand_atp(model, clean, corrupt)),
                Variant(GRADS, nothing, lambda: hand_atp(model, clean, corrupt, grads_only=True)),
                Variant(STUDY, nothing, lambda: by_study(model, clean, corrupt, "attribution"))]  # fmt: skip
    timing = interleave(variants, rounds=15, reps=2)
    return {
        "width": WIDE,
        "times": {n: timing.median(n) for n in (HAND, GRADS, STUDY)},
        "ratio": timing.ratio(STUDY, HAND),
        "quartiles": list(timing.spread(STUDY, HAND)),
        "ratio_grads": timing.ratio(STUDY, GRADS),
        "quartiles_grads": list(timing.spread(STUDY, GRADS)),
    }


def one_forward(model: Any, corrupt: Any) -> None:
    """One forward of the corrupted prompts, no gradient: the unit AtP's cost is quoted in."""
    import torch

    with torch.no_grad():
        model(corrupt)


def child(method: str) -> dict[str, Any]:
    """Peak RSS added by one study of the grid by ``method`` in this fresh process (model built and run first)."""
    from scripts.bench.memory import peak_mib, rss_mib

    model, clean, corrupt = setup()
    forwards(model, clean, corrupt)  # torch's own lazy allocations (autograd too) belong to the floor
    before = rss_mib()
    by_study(model, clean, corrupt, method)
    return {"method": method, "added_mib": peak_mib() - before}


def memory() -> list[dict[str, Any]]:
    """Peak RSS added by an exact (``patch``) study and by attribution of the same grid, each in a fresh process."""
    rows = []
    for method in ("patch", "attribution"):
        run = run_child([sys.executable, "-m", "scripts.bench.attribution", "--child", method], cwd=ROOT)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--child", choices=["patch", "attribution"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    import torch

    model, clean, corrupt = setup()
    hand, study = hand_atp(model, clean, corrupt), by_study(model, clean, corrupt, "attribution")
    torch.testing.assert_close(study, hand, rtol=1e-9, atol=1e-9)  # the same estimate before anything is timed
    torch.testing.assert_close(hand_atp(model, clean, corrupt, grads_only=True), hand, rtol=1e-9, atol=1e-9)
    variants = [
        Variant(HAND, nothing, lambda: hand_atp(model, clean, corrupt)),
        Variant(GRADS, nothing, lambda: hand_atp(model, clean, corrupt, grads_only=True)),
        Variant(STUDY, nothing, lambda: by_study(model, clean, corrupt, "attribution")),
        Variant(FORWARDS, nothing, lambda: forwards(model, clean, corrupt)),
        Variant(ONE, nothing, lambda: one_forward(model, corrupt)),
        Variant(PLAN, nothing, planning(model)),
    ]
    settled = (lambda t: (lambda q: q[1] - q[0] < 0.08)(t.spread(STUDY, HAND))) if not args.quick else None
    timing = interleave(variants, rounds=4 if args.quick else 31, reps=1 if args.quick else 3, settled=settled,
                        max_s=0.0 if args.quick else 90.0)  # fmt: skip
    low, high = timing.spread(STUDY, HAND)
    wide = None if args.quick else wider()
    by_study(model, clean, corrupt, "integrated_gradients", 1)  # warm-up: its first call pays one-time costs
    ig_steps = IG_STEPS[:2] if args.quick else IG_STEPS
    seconds: dict[int, list[float]] = {steps: [] for steps in ig_steps}
    for _ in range(1 if args.quick else 5):  # rounds over every step count: a passing slow spell hits them all
        for steps in ig_steps:
            begin = time.process_time()
            by_study(model, clean, corrupt, "integrated_gradients", steps)
            seconds[steps].append(time.process_time() - begin)
    ig = [{"steps": steps, "seconds": statistics.median(seconds[steps])} for steps in ig_steps]
    xs, ys = [r["steps"] for r in ig], [r["seconds"] for r in ig]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)  # least squares
    data = {
        "machine": machine(),
        "cells": LAYERS * POSITIONS,
        "times": {name: timing.median(name) for name in (HAND, GRADS, STUDY, FORWARDS, ONE, PLAN)},
        "ratio_grads": timing.ratio(STUDY, GRADS),
        "quartiles_grads": list(timing.spread(STUDY, GRADS)),
        "plan_share": timing.ratio(PLAN, STUDY),
        "in_forwards": timing.ratio(STUDY, ONE),
        "hand_in_forwards": timing.ratio(HAND, ONE),
        "memory": [] if args.quick else memory(),
        "ratio": timing.ratio(STUDY, HAND),
        "quartiles": [low, high],
        "target": TARGET,
        "verdict": verdict(low, high, TARGET),
        "forward_share": timing.ratio(FORWARDS, STUDY),
        "ig": ig,
        "wide": wide,
        "ig_seconds_per_step": slope,
        "ig_intercept": my - slope * mx,
    }
    write_json(args.json, data)
    print(f"study AtP / hand AtP {data['ratio']:.3f} ({low:.3f}-{high:.3f}); forwards are "
          f"{data['forward_share']:.0%} of the study; IG " + ", ".join(
              f"{r['steps']} steps {r['seconds'] * 1e3:.0f} ms" for r in ig))  # fmt: skip
    fit = [abs(r["seconds"] - (data["ig_intercept"] + slope * r["steps"])) / r["seconds"] for r in ig]
    print(f"IG linear in steps: worst deviation from the line {max(fit):.1%}; {statistics.mean(fit):.1%} on average")
    return 0


if __name__ == "__main__":
    sys.exit(main())
