"""The BENCHMARKS.md section of scripts/bench/splice.py: an SAE spliced with its features captured, against the
same SAE in a hand-written hook, and feature capture memory (in memory, ``features_top``, ``to: disk``)."""

from __future__ import annotations

from typing import Any

from scripts.bench.report.markdown import table, yes

TITLE = "## 14. Splices: an SAE in a GPT-2-shaped model"


def splice_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    """The section, its target rows and its misses."""
    if data is None:
        return [TITLE, "", "Not run.", ""], [], []
    rows = [[name, f"{seconds * 1e3:.2f} ms"] for name, seconds in data["times"].items()]
    ratio_rows = [
        [f"{r['variant']} / {r['base']}", f"{r['ratio']:.3f}", f"{r['quartiles'][0]:.3f}–{r['quartiles'][1]:.3f}",
         f"≤ {r['target']:.2f}: {r['verdict']}" if r["target"] else ""]
        for r in data["ratios"]
    ]  # fmt: skip
    memory = [[r["variant"], f"{r['added_mib']:.1f} MiB", f"{r['held_mib']:.2f} MiB"] for r in data["memory"]]
    batches = data["memory"][0]["batches"] if data["memory"] else 0
    md = [
        TITLE,
        "",
        "`scripts/bench/splice.py`. A 6-layer GPT-2 (width 256, 4 heads, eager attention, random weights), 2 prompts"
        " of 64 tokens; a standard SAE with 4,096 features (SAELens format, `b_dec` subtracted from the input)"
        " spliced into block 3's output with `capture: true`. `hand` is a forward hook computing"
        " `relu((y - b_dec) @ W_enc + b_enc) @ W_dec + b_dec` and appending the features to a list; the error-term"
        " variants add `y - reconstruction`. Checked before timing: each splice equals its hand-written hook bit for"
        f" bit. CPU time per forward, median of {data['rounds']} interleaved rounds (5 forwards each); ratios are"
        " medians of per-round ratios, quartiles beside them.",
        "",
        *table(["variant", "per forward"], rows),
        *table(["ratio", "median", "quartiles", "target"], ratio_rows),
        f"Feature capture memory over {batches} batches (each in a fresh process, after one warm-up batch; RSS added"
        " and the bytes the records hold): every feature kept in memory grows with the batches; `features_top: 32`"
        " keeps 32 values and indices per position; `to: disk`, with each batch's features written as one shard as"
        " the CLI does, stays flat.",
        "",
        *table(["features", "RSS added", "held by records"], memory),
    ]
    targets, misses = [], []
    for r in data["ratios"]:
        if not r["target"]:
            continue
        low, high = r["quartiles"]
        label = "with the error term" if "error" in r["variant"] else "features captured"
        targets.append([f"splice / the same SAE in a hand-written hook ({label})", f"≤ {r['target']:.2f}",
                        f"{r['ratio']:.3f} ({low:.3f}–{high:.3f})",
                        yes(True) if r["verdict"] == "met" else r["verdict"]])  # fmt: skip
        if r["verdict"] == "over":
            misses.append(f"splice: {r['variant']} is {r['ratio']:.2f}× {r['base']} (section 14)")
    return md, targets, misses
