"""A 3 × 13 layer × position patching grid: ``surgery.study`` against the same hooks in a hand-written loop.

    python -m scripts.bench.study [--quick] [--json out.json]

A 3-layer GPT-2 (width 64, eager attention, random weights, torch on one thread), 4 prompts of 13
tokens, clean and corrupted (position 6 changed). Every cell patches the residual stream entering
block ``layer`` at position ``pos`` with the clean run's, and scores ``logit[3] - logit[4]`` at the
last position per example (plus the unmodified and clean baselines, which a study also returns).
Variants, timed interleaved in one process (CPU time, one call = the whole grid):

* ``hand``: plain forward pre-hooks; one clean pass caching every layer's input, one unmodified
  pass, then one forward per cell.
* ``study, 1 cell a forward``: ``surgery.study(..., batch_cells=1)``; bit-identical to ``hand``.
* ``hand, rows replicated``: the hand loop sharing forwards the way ``batch_cells: auto`` does
  (each prompt repeated k times in a row, cell j patching rows j::k).
* ``study, batch_cells auto``: ``surgery.study(...)``; allclose to ``hand, rows replicated``.
* ``apply per cell``: the route before studies: ``surgery.apply`` of each cell's actions (planned
  every cell) and a source pass per cell.

Targets: study / hand loop doing the same forwards ≤ 1.10 (one cell a forward, and cells sharing forwards);
``batch_cells: auto`` ≥ 3× faster than the one-forward-per-cell hand loop (study / hand ≤ 1/3).
Memory: peak RSS added by one grid, ``study, batch_cells auto``
against ``hand, rows replicated``, each in a fresh child process. Then scripts/bench/study_scale.py:
the CLI study against one plain CLI run (≤ 1.5) and a multirun, and ``surgery.study`` at 10, 100 and
1,000 cells (time per cell ≤ 1.2× the 10-cell one; peak RSS).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scripts.bench.common import ROOT, Variant, interleave, machine, nothing, run_child, verdict, write_json

TARGET = 1.10
SPEEDUP_TARGET = 3.0  # batch_cells: auto against the one-forward-per-cell hand loop
LAYERS, POSITIONS, PROMPTS, VOCAB = 3, 13, 4, 512
CORRECT, WRONG = 3, 4
HAND, STUDY1 = "hand", "study, 1 cell a forward"
HAND_ROWS, STUDY = "hand, rows replicated", "study, batch_cells auto"
APPLY = "apply per cell"
PATCH = {
    "cap": {"kind": "capture", "select": "transformer.h.{layer}", "what": ["input"]},
    "patch": {"kind": "modify_input", "select": "transformer.h.{layer}", "op": "set", "index": "[:, {pos}]",
              "from": {"capture": "cap", "what": "input"}},
}  # fmt: skip
GRID = {"layer": f"0:{LAYERS}", "pos": f"0:{POSITIONS}"}
METRICS = [{"logit_diff": {"correct": CORRECT, "wrong": WRONG}}]


def setup(width: int = 64) -> tuple[Any, Any, Any]:
    """The model (hidden size ``width``, 16 dims a head), clean and corrupted token ids."""
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=width, n_head=width // 16, n_positions=64,
                                     vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).eval()
    clean = torch.randint(5, VOCAB, (PROMPTS, POSITIONS), generator=torch.Generator().manual_seed(0))
    corrupt = clean.clone()
    corrupt[:, POSITIONS // 2] = (clean[:, POSITIONS // 2] + 1) % VOCAB
    return model, clean, corrupt


def _hidden(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, x: Any) -> tuple[tuple, dict]:
    return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})


def _diff(logits: Any) -> Any:
    z = logits[:, -1].double()
    return z[:, CORRECT] - z[:, WRONG]


def _baselines(model: Any, clean: Any, corrupt: Any) -> tuple[dict[int, Any], Any, Any]:
    """One clean pass caching every block's input, and one unmodified pass: what every hand loop starts with."""
    cache: dict[int, Any] = {}
    blocks = model.transformer.h
    handles = [
        block.register_forward_pre_hook(lambda m, a, k, i=i: cache.__setitem__(i, _hidden(a, k)), with_kwargs=True)
        for i, block in enumerate(blocks)
    ]
    try:
        source = _diff(model(clean).logits)
    finally:
        for handle in handles:
            handle.remove()
    return cache, _diff(model(corrupt).logits), source


def hand_loop(model: Any, clean: Any, corrupt: Any) -> Any:
    """One forward per cell, a pre-hook on the cell's block setting its position to the clean input:
    ``[layers, positions, prompts]`` in float64 on the host, for any GPT-2 and prompt size, on any device."""
    import torch

    layers, (prompts, positions) = len(model.transformer.h), clean.shape
    out = torch.empty(layers, positions, prompts, dtype=torch.float64)
    with torch.no_grad():
        cache, _, _ = _baselines(model, clean, corrupt)
        for layer in range(layers):
            for pos in range(positions):

                def pre(m: Any, a: tuple, k: dict, pos: int = pos, saved: Any = cache[layer]) -> Any:
                    x = _hidden(a, k).clone()
                    x[:, pos] = saved[:, pos]
                    return _with_hidden(a, k, x)

                handle = model.transformer.h[layer].register_forward_pre_hook(pre, with_kwargs=True)
                try:
                    out[layer, pos] = _diff(model(corrupt).logits)
                finally:
                    handle.remove()
    return out


def hand_rows(model: Any, clean: Any, corrupt: Any, k: int) -> Any:
    """``k`` cells a forward: each prompt repeated ``k`` times in a row, cell ``j`` patching rows ``j::k``."""
    import torch

    cells = [(layer, pos) for layer in range(LAYERS) for pos in range(POSITIONS)]
    out = torch.empty(len(cells), PROMPTS, dtype=torch.float64)
    with torch.no_grad():
        cache, _, _ = _baselines(model, clean, corrupt)
        replicated = corrupt.repeat_interleave(k, dim=0)
        for start in range(0, len(cells), k):
            group = cells[start : start + k]
            by_layer: dict[int, list[tuple[int, int]]] = {}
            for j, (layer, pos) in enumerate(group):
                by_layer.setdefault(layer, []).append((j, pos))

            def pre(m: Any, a: tuple, kw: dict, patches: list[tuple[int, int]], saved: Any) -> Any:
                x = _hidden(a, kw).clone()
                for j, pos in patches:
                    x[j::k, pos] = saved[:, pos]
                return _with_hidden(a, kw, x)

            handles = [
                model.transformer.h[layer].register_forward_pre_hook(
                    lambda m, a, kw, p=patches, s=cache[layer]: pre(m, a, kw, p, s), with_kwargs=True
                )
                for layer, patches in by_layer.items()
            ]
            try:
                diff = _diff(model(replicated).logits)
            finally:
                for handle in handles:
                    handle.remove()
            for j in range(len(group)):
                out[start + j] = diff[j::k]
    return out.reshape(LAYERS, POSITIONS, PROMPTS)


def apply_per_cell(model: Any, clean: Any, corrupt: Any) -> Any:
    """The route before studies: each cell's actions written out, planned and applied, with its own source pass."""
    import torch

    import surgery

    out = torch.empty(LAYERS, POSITIONS, PROMPTS, dtype=torch.float64)
    with torch.no_grad():
        _diff(model(corrupt).logits), _diff(model(clean).logits)  # the baselines, as the others compute them
        for layer in range(LAYERS):
            for pos in range(POSITIONS):
                actions = {
                    "cap": {**PATCH["cap"], "select": f"transformer.h.{layer}"},
                    "patch": {**PATCH["patch"], "select": f"transformer.h.{layer}", "index": f"[:, {pos}]"},
                }
                with surgery.apply(model, actions) as s:
                    with s.source_pass():
                        model(clean)
                    out[layer, pos] = _diff(model(corrupt).logits)
    return out


def study(model: Any, clean: Any, corrupt: Any, batch_cells: Any) -> Any:
    import surgery

    result = surgery.study(model, PATCH, GRID, corrupt, METRICS, source=clean, batch_cells=batch_cells)
    return result.values["logit_diff"]


def auto_cells() -> int:
    """How many cells ``batch_cells: auto`` puts in one forward for this grid (the hand loop copies it)."""
    from surgery.study.rows import cells_per_forward

    return cells_per_forward("auto", LAYERS * POSITIONS, PROMPTS, None)


def speed(rounds: int, max_s: float) -> dict[str, Any]:
    import torch

    model, clean, corrupt = setup()
    k = auto_cells()
    hand = hand_loop(model, clean, corrupt)
    assert torch.equal(study(model, clean, corrupt, 1), hand), "study (batch_cells=1) differs from the hand loop"
    assert torch.equal(apply_per_cell(model, clean, corrupt), hand), "apply per cell differs from the hand loop"
    rows = hand_rows(model, clean, corrupt, k)
    shared = study(model, clean, corrupt, "auto")
    assert torch.allclose(shared, rows, rtol=1e-5, atol=1e-6), "study (auto) differs from the replicated hand loop"
    assert torch.allclose(rows, hand, rtol=1e-4, atol=1e-5), "replicated rows changed the values"
    variants = [
        Variant(HAND, nothing, lambda: hand_loop(model, clean, corrupt)),
        Variant(STUDY1, nothing, lambda: study(model, clean, corrupt, 1)),
        Variant(HAND_ROWS, nothing, lambda: hand_rows(model, clean, corrupt, k)),
        Variant(STUDY, nothing, lambda: study(model, clean, corrupt, "auto")),
        Variant(APPLY, nothing, lambda: apply_per_cell(model, clean, corrupt)),
    ]

    def settled(t: Any) -> bool:  # quartiles within ±2.5 % of the median ratio, for the three judged ratios
        pairs = [(STUDY1, HAND), (STUDY, HAND_ROWS), (STUDY, HAND)]
        return all((lambda q, m: q[1] - q[0] < 0.05 * m)(t.spread(*p), t.ratio(*p)) for p in pairs)

    timing = interleave(variants, rounds=rounds, reps=1, settled=settled, max_s=max_s)
    ratios = []
    for name, base, target in [(STUDY1, HAND, TARGET), (STUDY, HAND_ROWS, TARGET), (STUDY, HAND, 1 / SPEEDUP_TARGET),
                               (APPLY, HAND, None), (STUDY1, STUDY, None)]:  # fmt: skip
        low, high = timing.spread(name, base)
        ratios.append({"variant": name, "base": base, "ratio": timing.ratio(name, base), "quartiles": [low, high],
                       "target": target, "verdict": verdict(low, high, target) if target else None})  # fmt: skip
    return {
        "cells": LAYERS * POSITIONS,
        "cells_per_forward": k,
        "times": {v.name: timing.median(v.name) for v in variants},
        "ratios": ratios,
        "rounds": len(timing.rounds[HAND]),
    }


def breakdown(reps: int) -> dict[str, float]:
    """CPU seconds of one ``surgery.study`` (batch_cells auto) and of its parts alone: templating every cell (a plan
    compiled per layer, every cell's index parsed), the forwards it runs without hooks (the unmodified and the source
    run), and the forwards of the replicated hand loop."""
    import time

    import torch

    from surgery.core.compiler import Shared, load_actions
    from surgery.study.direct import why_not_direct
    from surgery.study.grid import cells, parse_grid

    try:  # the study's own templating step, timed alone; its home may move
        from surgery.study.template import Template
    except ImportError:
        return {}

    model, clean, corrupt = setup()
    k = auto_cells()
    spec, grid_cells = load_actions(PATCH), cells(parse_grid(GRID, positions=POSITIONS))

    def baselines() -> None:
        with torch.no_grad():
            model(corrupt), model(clean)

    parts = {
        "study": lambda: study(model, clean, corrupt, "auto"),
        "template": lambda: Template(
            model, spec, grid_cells, 0, True, False, Shared(), lambda plan: why_not_direct(plan, True)
        ),  # fmt: skip
        "baselines": baselines,
        "hand_rows": lambda: hand_rows(model, clean, corrupt, k),
    }
    out = {}
    for name, fn in parts.items():
        fn()
        begin = time.process_time()
        for _ in range(reps):
            fn()
        out[name] = (time.process_time() - begin) / reps
    return out


def profile(top: int) -> list[dict[str, Any]]:
    """Where ``surgery.study`` (batch_cells auto) spends its time: cProfile's top functions of ours, cumulative."""
    import cProfile
    import pstats

    model, clean, corrupt = setup()
    study(model, clean, corrupt, "auto")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        study(model, clean, corrupt, "auto")
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = max(v[3] for v in stats.values())
    rows = [
        {"where": f"surgery/{path.split('/surgery/', 1)[1]}:{fn}", "calls": calls / 3, "share": cumulative / total}
        for (path, _, fn), (_, calls, _, cumulative, _) in stats.items()
        if "/surgery/" in path and "/site-packages/" not in path
    ]
    return sorted(rows, key=lambda r: -r["share"])[:top]


def child(variant: str) -> dict[str, Any]:
    """Peak RSS added by one grid of ``variant`` in this fresh process (model built and warmed first)."""
    from scripts.bench.memory import peak_mib, rss_mib

    model, clean, corrupt = setup()
    k = auto_cells()
    run = {STUDY: lambda: study(model, clean, corrupt, "auto"), HAND_ROWS: lambda: hand_rows(model, clean, corrupt, k)}
    model(clean)  # torch's own lazy allocations belong to the floor
    before = rss_mib()
    run[variant]()
    return {"variant": variant, "added_mib": peak_mib() - before}


def memory() -> list[dict[str, Any]]:
    rows = []
    for variant in (HAND_ROWS, STUDY):
        run = run_child([sys.executable, "-m", "scripts.bench.study", "--child", variant], cwd=ROOT)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no memory or profile")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=[HAND_ROWS, STUDY], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    result = speed(3 if args.quick else 9, 20.0 if args.quick else 120.0)
    for name, seconds in result["times"].items():
        print(f"{name:26} {seconds * 1e3:8.1f} ms per grid")
    for row in result["ratios"]:
        low, high = row["quartiles"]
        print(f"{row['variant']} / {row['base']}: {row['ratio']:.3f} ({low:.3f}–{high:.3f}) {row['verdict'] or ''}")
    mem = [] if args.quick else memory()
    for row in mem:
        print(f"peak RSS added, {row['variant']}: {row['added_mib']:.1f} MiB")
    parts = breakdown(2 if args.quick else 5)
    print("parts (CPU):", ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in parts.items()))
    where = [] if args.quick else profile(10)
    for row in where:
        print(f"{row['share']:6.1%} {row['calls']:7.0f}  {row['where']}")
    from scripts.bench.study_scale import cli_and_sizes

    on_cli, sizes = cli_and_sizes(args.quick)
    write_json(args.json, {"machine": machine(), **result, "memory": mem, "parts": parts, "profile": where,
                           "cli": on_cli, "scale": sizes})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
