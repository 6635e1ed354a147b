"""The BENCHMARKS.md section for the GPU run (scripts/bench/gpu.py), with the card named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.bench.report.markdown import table, yes

LAST_RUN = Path(__file__).resolve().parent.parent / "gpu-last.json"  # kept in the repo: no GPU where the rest runs


def last_gpu_run() -> dict[str, Any] | None:
    """The results of the last GPU run merged into BENCHMARKS.md (scripts/bench/gpu-last.json), if any."""
    return json.loads(LAST_RUN.read_text()) if LAST_RUN.is_file() else None


TITLE = "## 12. On a GPU"


def gpu_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    """Section 12 and its target rows: hook overhead per kind, study, generation and harvest on a CUDA card."""
    if data is None:
        return [TITLE, "", "Not run: no CUDA machine was at hand (`scripts/gpu_check DIR` on one).", ""], [], []
    info = data["machine"]
    card = f"{info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})"
    rows = [
        [r["shape"], r["task"] + (" *" if r["slow_path"] else ""), r["mode"], f"{r['ms']['bare']:.2f}",
         f"{r['ms']['hand']:.2f}", f"{r['ms']['surgery']:.2f}", f"{r['ratio']:.3f}",
         f"{r['quartiles'][0]:.3f}–{r['quartiles'][1]:.3f}",
         f"{r['peak_mib']['hand']:.0f} / {r['peak_mib']['surgery']:.0f}"]
        for r in data["overhead"]
    ]  # fmt: skip
    md = [
        TITLE,
        "",
        f"`scripts/bench/gpu.py`, run by `scripts/gpu_check` on **{card}**. A GPT-2-small-shaped model (12"
        " blocks, width 768, vocabulary 50257, random weights, float32 with TF32 off). GPU time from CUDA events"
        " around repeated calls after a warm-up, the device synchronised first; surgery, the same hooks by hand and"
        " the bare model interleaved in each round; ratios are medians of per-round ratios. Every task is checked"
        " equal to the hand-written hooks on the GPU (outputs, gradients, captures) before it is timed. Peak: GPU"
        " memory one call needs above what was allocated before it (MiB). `*`: one of the engine's slower paths.",
        "",
        *table(
            [
                "shape",
                "task",
                "mode",
                "bare ms",
                "hand ms",
                "surgery ms",
                "surgery / hand",
                "quartiles",
                "peak hand / surgery",
            ],
            rows,
        ),  # fmt: skip
    ]
    if data.get("rerun_tasks"):
        md += [f"Rows of {', '.join(data['rerun_tasks'])}: from a later run on the same card.", ""]
    study, gen, harvest = data["study"], data["generation"], data.get("harvest")
    md += [
        f"Study: a {study['cells']}-cell layer × position patching grid on {study['prompts']} prompts of"
        f" {study['tokens']} tokens, `surgery.study(batch_cells=1)` {study['ms']['study']:.0f} ms against the same"
        f" pre-hooks in a hand loop {study['ms']['hand']:.0f} ms (equal bit for bit): **{study['ratio']:.3f}×**.",
        "",
        f"Generation: greedy, {gen['new_tokens']} new tokens for {gen['prompts']} prompts, every block's output"
        f" captured {gen['ms']['captures']:.0f} ms against plain `generate` {gen['ms']['plain']:.0f} ms:"
        f" **{gen['ratio']:.3f}×**; peak {gen['peak_mib']['captures']:.0f} MiB against {gen['peak_mib']['plain']:.0f}"
        " MiB (the captures are the difference).",
        "",
    ]
    if harvest:
        start = harvest.get("start_s", {}).get("harvest, one block", 0.0)
        md += [
            f"Harvest (`scripts/bench/harvest_gpu.py`): {harvest['tokens']:,} tokens of a packed corpus, one"
            " block's output stored as float16 (`harvest_corpus`: reading, tokenizing, the forward, the copy to the"
            " host and the shard writes)"
            f" {harvest['harvest_tps']:,.0f} tokens/s against the bare forward's {harvest['forward_tps']:,.0f}"
            f" on the same batches: **{harvest['ratio']:.3f}×** (target ≥ 0.8); every block's output"
            f" ({harvest['every_block_tps']:,.0f} tokens/s, 12× the bytes): {harvest['every_block_ratio']:.3f}×."
            + (
                f" Rates between a 10- and a {harvest['tokens'] // 1024}-batch run; a harvest's start-up (the"
                f" model's weights fingerprinted, the plan, a probe forward) is {start:.2f}"
                f" s once, so over the whole {harvest['tokens'] // 1024}-batch run it makes"
                f" {harvest['whole_ratio']:.3f}× the bare forward's rate."
                if "start_s" in harvest
                else ""
            ),
            "",
        ]
    else:
        md += ["Harvest: not in this run (`mode=harvest` was not in the checkout measured).", ""]
    main = [r for r in data["overhead"] if not r["slow_path"]]
    worst = max(main, key=lambda r: r["ratio"])
    met = sum(r["verdict"] == "met" for r in main)
    over = sum(r["verdict"] == "over" for r in main)
    verdict = yes(True) if met == len(main) else "over" if over else "within noise"
    targets = [[f"GPU hook overhead, surgery / hand-written, fast paths ({info['gpu']})", "≤ 1.03",
                f"worst {worst['ratio']:.3f}; met in {met} of {len(main)}, above in {over}", verdict]]  # fmt: skip
    misses = [
        f"GPU: {r['task']} ({r['shape']}, {r['mode']}) at {r['ratio']:.3f}× the hand-written hooks (section 12)"
        for r in data["overhead"]
        if r["verdict"] == "over"
    ]
    if harvest:
        ok = harvest["ratio"] >= 0.8
        targets.append([f"GPU harvest tokens/s / bare forward's ({info['gpu']})", "≥ 0.8", f"{harvest['ratio']:.3f}",
                        yes(True) if ok else "over"])  # fmt: skip
        if not ok:
            misses.append(f"GPU: harvest at {harvest['ratio']:.3f}× the bare forward's tokens/s (section 12)")
    return md, targets, misses
