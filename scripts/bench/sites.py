"""Sites on a 70B-class Llama on the meta device: a recipe written with ``@`` sites plans as fast as the same
recipe written with globs (issue 28).

Each recipe pair selects the same modules: ``surgery.plan`` on the built model (no example inputs), CPU time,
median of interleaved rounds, with the site map cached (the usual case: every plan after the first on a model)
and cold (the map worked out again in every plan: the first plan on a model, or a study's first cell).

    python -m scripts.bench.sites [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from scripts.bench.common import machine, write_json
from scripts.bench.report.markdown import table

TARGET = 1.10  # a site recipe's plan time over the glob recipe's, site map cached
PAIRS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "residual": (
        "capture every decoder layer's output",
        {"kind": "capture", "select": "@resid_post"},
        {"kind": "capture", "type": "LlamaDecoderLayer", "item": 0},
    ),
    "ablate_mlp": (
        "zero the MLP output of layers 40–49",
        {"kind": "modify_output", "select": [f"@mlp.{i}" for i in range(40, 50)], "op": "zero"},
        {"kind": "modify_output", "select": "model.layers.4[0-9].mlp", "op": "zero", "item": 0},
    ),
    "scale_attention": (
        "halve every attention output (item 0)",
        {"kind": "modify_output", "select": "@attn", "op": "mul", "value": 0.5},
        {"kind": "modify_output", "select": "model.layers.*.self_attn", "item": 0, "op": "mul", "value": 0.5},
    ),
    "heads": (
        "zero head 3 of layer 40 (o_proj's input as [..., 64, 128])",
        {"kind": "modify_output", "select": "@heads.40", "head": 3, "op": "zero"},
        {"kind": "modify_input", "select": "model.layers.40.self_attn.o_proj", "heads": 64, "index": "[..., 3, :]",
         "op": "zero"},
    ),
}  # fmt: skip


def speed(rounds: int) -> dict[str, Any]:
    """CPU seconds of ``surgery.plan`` per recipe: glob, site (map cached), site (map cold); interleaved rounds."""
    import surgery
    from surgery.arch import sites as site_module
    from surgery.models.hf import llama_meta

    clock = time.process_time()
    model = llama_meta()
    build_s = time.process_time() - clock
    for _, site, glob in PAIRS.values():  # the same modules either way (checked before timing)
        a, b = surgery.plan(model, {"a": site}).to_dict()[0], surgery.plan(model, {"a": glob}).to_dict()[0]
        assert a["matched"] == b["matched"], (a["matched"][:3], b["matched"][:3])
    times: dict[str, dict[str, list[float]]] = {n: {"glob": [], "site": [], "site, cold": []} for n in PAIRS}
    for _ in range(rounds):
        for name, (_, site, glob) in PAIRS.items():
            for variant, action in (("glob", glob), ("site", site), ("site, cold", site)):
                if variant == "site, cold":
                    site_module._CACHE.clear()
                clock = time.process_time()
                surgery.plan(model, {"a": action}, reuse=False)  # compiled every time, not found in the plan cache
                times[name][variant].append(time.process_time() - clock)
    rows = []
    for name, by in times.items():
        ratios = [s / g for s, g in zip(by["site"], by["glob"], strict=True)]
        cold = [s / g for s, g in zip(by["site, cold"], by["glob"], strict=True)]
        ratio = statistics.median(ratios)
        rows.append({"recipe": name, "what": PAIRS[name][0], **{k: statistics.median(v) for k, v in by.items()},
                     "ratio": ratio, "cold_ratio": statistics.median(cold),
                     "verdict": "met" if ratio <= TARGET else "over"})  # fmt: skip
    return {"rounds": rounds, "build_s": build_s, "modules": sum(1 for _ in model.modules()), "rows": rows}


def sites_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    """Section 12 and its target row: site recipes against the same recipes written with globs."""
    title = "## 16. Sites: planning a site recipe on a 70B-class Llama"
    if data is None:
        return [title, "", "Not run.", ""], [], []
    rows = [
        [f"`{r['recipe']}`: {r['what']}", *(f"{r[k] * 1e3:.1f} ms" for k in ("glob", "site", "site, cold")),
         f"{r['ratio']:.3f}", f"{r['cold_ratio']:.3f}"]
        for r in data["rows"]
    ]  # fmt: skip
    worst = max(data["rows"], key=lambda r: r["ratio"])
    md = [
        title,
        "",
        "`scripts/bench/sites.py`. `surgery.models.hf.llama_meta` (80 decoder layers, hidden 8192, 64 query heads,"
        f" 8 key/value heads; {data['modules']:,} modules) on the meta device; each recipe written with `@` sites and"
        " with the globs (or `type:`) that select the same modules, checked equal before timing. `surgery.plan`"
        " alone, CPU time, median of"
        f" {data['rounds']} interleaved rounds; ratios are medians of per-round ratios. `site` reuses the model's"
        " site map (every plan after the first on a model); `site, cold` works it out again in each plan.",
        "",
        *table(["recipe", "glob", "site", "site, cold", "site / glob", "cold / glob"], rows),
    ]
    met = worst["ratio"] <= TARGET
    targets = [["sites: site recipe plan / glob recipe plan (70B meta Llama)", f"≤ {TARGET:.2f}",
                f"{worst['ratio']:.3f} (worst, `{worst['recipe']}`)", "**met**" if met else "**not met**"]]  # fmt: skip
    misses = [] if met else [f"sites: `{worst['recipe']}` plans {worst['ratio']:.2f}× its glob recipe"]
    return md, targets, misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    result = speed(3 if args.quick else 15)
    for r in result["rows"]:
        times = "  ".join(f"{k} {r[k] * 1e3:7.1f} ms" for k in ("glob", "site", "site, cold"))
        print(f"{r['recipe']:16} {times}  site/glob {r['ratio']:.3f}  cold/glob {r['cold_ratio']:.3f}")
    write_json(args.json, {"machine": machine(), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
