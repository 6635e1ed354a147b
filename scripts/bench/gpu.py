"""On a CUDA GPU: hook overhead per kind, a study grid, harvest and generation, each beside plain PyTorch.

    python -m scripts.bench --gpu [--out DIR]      (or python -m scripts.bench.gpu --json DIR/gpu.json)

A GPT-2-small-shaped model (12 blocks, width 768, 12 heads, vocabulary 50257; random weights,
float32, eval). Times are GPU time from CUDA events around ``reps`` calls after a warm-up, the
device synchronised before each block; variants are interleaved in each round (A B C, then C B A)
and compared within the round; medians over rounds. Peak GPU memory is ``max_memory_allocated``
over one call, above what was allocated before it.

* Hook overhead: every task of scripts/bench/cases.py (the CPU table's), done by surgery and by the
  same hooks written by hand, checked equal (outputs, gradients, captures) on the GPU first, at two
  shapes: 1 × 32 tokens (launch-bound: the GPU waits on Python) and 8 × 128 (the GPU busy).
* Study: a 12-layer × 8-position patching grid, ``surgery.study(batch_cells=1)`` against the same
  pre-hooks in a hand loop (one clean pass, one unmodified pass, one forward per cell), equal first.
* Generation: greedy ``generate`` of 64 new tokens for 8 prompts, with every block's output captured
  against a plain ``generate``.
* Harvest (when ``mode=harvest`` is in this checkout): tokens/s of ``surgery.harvest`` against the
  bare forward on the same batches.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, machine, quartiles, write_json

TARGET = 1.03  # surgery / hand-written hooks
HARVEST_TARGET = 0.8  # harvest tokens/s over the bare forward's
SHAPES = {"launch-bound": (1, 32), "GPU-bound": (8, 128)}
LAYERS, GRID_POSITIONS = 12, 8


def cuda_timer(step: Callable[[], Any], reps: int) -> float:
    """Seconds per call of ``step`` on the GPU: CUDA events around ``reps`` calls, synchronised."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def peak_of(step: Callable[[], Any]) -> int:
    """Bytes of GPU memory one call of ``step`` needs above what is allocated before it."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def interleaved(
    variants: dict[str, tuple[Callable[[], Callable[[], None]], Callable[[], Any]]], rounds: int, reps: int
) -> dict[str, list[float]]:
    """Per-round seconds per call of each variant: ``attach()`` returns ``detach``; ``step`` runs one call."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            attach, step = variants[name]
            detach = attach()
            try:
                step()  # warm-up: kernels, allocator, the hooks' first call
                times[name].append(cuda_timer(step, reps))
            finally:
                detach()
    return times


def ratio_row(times: dict[str, list[float]], name: str, base: str, target: float | None) -> dict[str, Any]:
    """Median of the per-round ratios ``name``/``base``, their quartiles, and the verdict against ``target``."""
    ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
    low, high = quartiles(ratios)
    verdict = "" if target is None else ("met" if high <= target else "over" if low > target else "within noise")
    return {"variant": name, "base": base, "ratio": statistics.median(ratios), "quartiles": [low, high],
            "target": target, "verdict": verdict}  # fmt: skip


def gpt2_small(device: Any) -> Any:
    """GPT-2 small's shape from a config, random weights, on ``device`` in eval mode."""
    import torch

    from surgery.models.hf import gpt2_tiny

    torch.manual_seed(0)
    model = gpt2_tiny(n_layer=LAYERS, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    return model.to(device).eval()


TASK_FILTER: list[str] = []  # --tasks: only overhead tasks whose name holds one of these


def overhead(model: Any, quick: bool) -> list[dict[str, Any]]:
    """Every CPU-table task on the GPU at both shapes and both modes: surgery, hand-written, bare."""
    import torch

    import surgery
    from scripts.bench.cases import TASKS, ModelCase, step_for
    from scripts.bench.overhead import check_task

    rows = []
    for shape_name, (batch, length) in SHAPES.items():
        ids = torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(0)).to(model.device)
        case = ModelCase(f"GPT-2 small {batch}×{length}", model, {"input_ids": ids}, 0, 0.0, is_gpt2=True)
        for task in TASKS:
            if task.inplace or (TASK_FILTER and not any(f in task.name for f in TASK_FILTER)):
                continue
            plan = surgery.plan(model, task.actions)
            for mode in task.modes:
                check_task(case, task, plan, mode)  # equal on the GPU before anything is timed
                step = step_for(case, mode)

                def engine(plan: Any = plan) -> Callable[[], None]:
                    return surgery.apply(model, plan).remove

                def hand(task: Any = task) -> Callable[[], None]:
                    handles, _ = task.hand(model)
                    return lambda: [h.remove() for h in handles]  # type: ignore[func-returns-value]

                def zero() -> Callable[[], None]:
                    return lambda: model.zero_grad(set_to_none=True)

                variants = {"surgery": (engine, step), "hand": (hand, step), "bare": (zero, step)}
                times = interleaved(variants, 4 if quick else 12, 3 if quick else 10)
                peaks = {}
                for name, (attach, one) in variants.items():
                    detach = attach()
                    try:
                        peaks[name] = peak_of(one)
                    finally:
                        detach()
                        model.zero_grad(set_to_none=True)
                row = ratio_row(times, "surgery", "hand", TARGET)
                rows.append({"shape": shape_name, "tokens": batch * length, "task": task.name, "mode": mode,
                             "slow_path": task.slow, **row,
                             "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
                             "peak_mib": {n: p / 2**20 for n, p in peaks.items()}})  # fmt: skip
                print(f"{shape_name:12} {task.name:42} {mode:7} surgery/hand {row['ratio']:.3f}", flush=True)
    return rows


def study(model: Any, quick: bool) -> dict[str, Any]:
    """A LAYERS × GRID_POSITIONS patching grid: surgery.study (one cell a forward) against the hand loop."""
    import torch

    import surgery
    from scripts.bench.study import METRICS, PATCH, hand_loop

    positions = 4 if quick else GRID_POSITIONS
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(5, 50257, (8, positions), generator=gen).to(model.device)
    corrupt = clean.clone()
    corrupt[:, positions // 2] = (clean[:, positions // 2] + 1) % 50257
    grid = {"layer": f"0:{LAYERS}", "pos": f"0:{positions}"}

    def by_study() -> Any:
        return surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, batch_cells=1).values["logit_diff"]

    def by_hand() -> Any:
        return hand_loop(model, clean, corrupt)

    assert torch.equal(by_study().cpu(), by_hand().cpu()), "study and hand loop differ on the GPU"
    variants = {"study": (lambda: lambda: None, by_study), "hand": (lambda: lambda: None, by_hand)}
    times = interleaved(variants, 3 if quick else 7, 1)
    return {"cells": LAYERS * positions, "prompts": int(clean.shape[0]), "tokens": int(clean.shape[1]),
            "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            **ratio_row(times, "study", "hand", None)}  # fmt: skip


def generation(model: Any, quick: bool) -> dict[str, Any]:
    """Greedy generate with every block's output captured, against plain generate."""
    import torch

    import surgery

    new = 16 if quick else 64
    ids = torch.randint(5, 50257, (8, 16), generator=torch.Generator().manual_seed(2)).to(model.device)
    mask = torch.ones_like(ids)

    def generate() -> Any:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)  # fmt: skip

    recipe = {"cap": {"kind": "capture", "select": "transformer.h.*"}}
    plain = generate()
    with surgery.apply(model, recipe) as s:
        captured = generate()
        calls = len(s.captures["cap"]["transformer.h.0"].calls)
    assert torch.equal(plain, captured) and calls == new, "captures changed generation"
    variants = {"captures": (lambda: surgery.apply(model, recipe).remove, generate), "plain": (lambda: lambda: None,
                generate)}  # fmt: skip
    times = interleaved(variants, 3 if quick else 7, 1)
    peaks = {}
    for name, (attach, step) in variants.items():
        detach = attach()
        try:
            peaks[name] = peak_of(step) / 2**20
        finally:
            detach()
    return {"new_tokens": new, "prompts": 8, "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "peak_mib": peaks, **ratio_row(times, "captures", "plain", None)}  # fmt: skip


def harvest(model: Any, quick: bool) -> dict[str, Any] | None:
    """Harvest tokens/s against the bare forward's, when this checkout has ``surgery.harvest``."""
    try:
        from scripts.bench.harvest_gpu import harvest_vs_forward
    except ImportError:
        return None
    return harvest_vs_forward(model, quick)


PARTS = {"study": study, "generation": generation, "harvest": harvest, "overhead": overhead}  # the longest last


def merged_runs(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s parts over ``old``'s (an overhead row replaces the row of the same shape, task and mode)."""
    if old is None or old["machine"].get("gpu") != new["machine"].get("gpu"):
        return new  # figures from another card are not mixed
    data = {**old, **{k: v for k, v in new.items() if k != "overhead"}}
    if "overhead" in new:
        key = lambda r: (r["shape"], r["task"], r["mode"])  # noqa: E731
        fresh = {key(r): r for r in new["overhead"]}
        data["overhead"] = [fresh.pop(key(r), r) for r in old.get("overhead", [])] + list(fresh.values())
        data["rerun_tasks"] = sorted({*old.get("rerun_tasks", []), *(r["task"] for r in new["overhead"])})
    return data


def _write_out(out: Path, data: dict[str, Any]) -> None:
    """DIR/gpu.json (only the parts run) and DIR/gpu.md (the section: them over the last run's)."""
    from scripts.bench.report.gpu import gpu_section, last_gpu_run

    out.mkdir(parents=True, exist_ok=True)
    write_json(str(out / "gpu.json"), data)
    (out / "gpu.md").write_text("\n".join(gpu_section(merged_runs(last_gpu_run(), data))[0]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="(from python -m scripts.bench --gpu; implied)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller grids")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--out", help="a directory: writes gpu.json and gpu.md (the BENCHMARKS.md section) there")
    parser.add_argument("--merge", metavar="DIR", help="no run: DIR/gpu.json into BENCHMARKS.md (and gpu-last.json)")
    parser.add_argument("--only", help=f"comma-separated parts of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--tasks", help="comma-separated words: only the overhead tasks whose name holds one")
    args = parser.parse_args(argv)
    if args.merge:
        from scripts.bench.report.gpu import LAST_RUN, last_gpu_run
        from scripts.bench.report.merge import merge

        data = merged_runs(last_gpu_run(), json.loads((Path(args.merge) / "gpu.json").read_text()))
        LAST_RUN.write_text(json.dumps(data, indent=1) + "\n")  # a full CPU render keeps these figures
        path = ROOT / "BENCHMARKS.md"
        path.write_text(merge(path.read_text(), data, "gpu"))
        print(f"wrote {path}")
        return 0
    parts = args.only.split(",") if args.only else list(PARTS)
    TASK_FILTER[:] = args.tasks.split(",") if args.tasks else []
    import torch

    if not torch.cuda.is_available():
        print("scripts.bench.gpu: torch sees no CUDA device; run it on a GPU machine (scripts/gpu_check)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as written: the same kernels for both sides
    device = torch.device("cuda")
    started = time.perf_counter()
    model = gpt2_small(device)
    data: dict[str, Any] = {
        "machine": {
            **machine(),
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },  # fmt: skip
    }
    for part, run in PARTS.items():
        if part not in parts:
            continue
        begin = time.perf_counter()
        data[part] = run(copy.deepcopy(model) if part == "generation" else model, args.quick)
        print(f"== {part}: {time.perf_counter() - begin:.0f} s", flush=True)
        data["seconds"] = time.perf_counter() - started
        if args.out:  # after every part: a run stopped by gpu_check's time limit keeps what finished
            _write_out(Path(args.out), data)
    write_json(args.json, data)
    if not (args.json or args.out):
        print(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
