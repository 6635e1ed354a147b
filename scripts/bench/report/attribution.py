"""The BENCHMARKS.md section for attribution patching (scripts/bench/attribution.py)."""

from __future__ import annotations

from typing import Any

from scripts.bench.report.markdown import table, yes

TITLE = "## 13. Attribution patching"
HAND, GRADS, STUDY, FORWARDS = "hand AtP", "hand AtP, autograd.grad", "study AtP", "forwards only"


def attribution_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    """Section 13 and its target rows: study AtP against AtP by hand, the forwards' share, IG against steps."""
    if data is None:
        return [TITLE, "", "Not run.", ""], [], []
    t, (low, high) = data["times"], data["quartiles"]
    md = [
        TITLE,
        "",
        "`scripts/bench/attribution.py`. The 3-layer GPT-2 and 3 × 13 residual-patching grid of section 11,"
        " every cell estimated by attribution patching (AtP: one clean forward, one corrupted forward and"
        " backward). `hand AtP` is the estimate as AtP is usually written with plain hooks (`retain_grad` on each"
        " block's input, the metric's `backward()`, `(clean - corrupted) · grad` per position), equal to the"
        " study's values to 1e-9 before timing. The study takes the gradients with `torch.autograd.grad` at the"
        " sites alone, so its backward computes no weight gradients (and leaves any `.grad` the model holds as it"
        " was); `hand AtP, autograd.grad` is the hand-written AtP doing the same, which leaves the study's own"
        " fixed costs. `forwards only` is the passes alone (a clean forward; a corrupted forward and the backward"
        " to the first block's input). CPU time, one thread, interleaved rounds.",
        "",
        *table(
            [
                "hand AtP",
                "hand AtP, autograd.grad",
                "study AtP",
                "forwards only",
                "study / hand",
                "quartiles",
                "study / hand by autograd.grad",
                "forwards' share of the study",
            ],
            [
                [
                    f"{t[HAND] * 1e3:.1f} ms",
                    f"{t[GRADS] * 1e3:.1f} ms" if GRADS in t else "-",
                    f"{t[STUDY] * 1e3:.1f} ms",
                    f"{t[FORWARDS] * 1e3:.1f} ms",
                    f"{data['ratio']:.2f}",
                    f"{low:.2f}–{high:.2f}",
                    _ratio(data, "ratio_grads", "quartiles_grads"),
                    f"{data['forward_share']:.0%}",
                ]
            ],
        ),  # fmt: skip
        "Integrated gradients (`method: integrated_gradients`), seconds per study against `steps`: "
        + ", ".join(f"{r['steps']}: {r['seconds'] * 1e3:.0f} ms" for r in data["ig"])
        + f" — {data['ig_seconds_per_step'] * 1e3:.1f} ms per step on a fixed"
        f" {data['ig_intercept'] * 1e3:.0f} ms (linear: one forward and backward per edited site and step).",
        "",
    ]
    if "in_forwards" in data:
        md += [
            f"In forwards: the study costs {data['in_forwards']:.1f} forwards of the corrupted prompts"
            f" ({t['one forward'] * 1e3:.1f} ms each), the hand-written AtP {data['hand_in_forwards']:.1f}"
            " (published figures put AtP at about 3–4).",
            "",
        ]
    if data.get("memory"):
        md += [
            "Peak RSS added by one study of the grid in a fresh process:"
            + ";".join(f" {r['method']} {r['added_mib']:.1f} MiB" for r in data["memory"])
            + " (attribution keeps one activation and one gradient per site; an exact study keeps the captures"
            " of its source pass and every cell's plan).",
            "",
        ]
    if data.get("wide"):
        w = data["wide"]
        wl, wh = w["quartiles"]
        md += [
            f"The same grid on a model {w['width'] // 64}× wider (hidden {w['width']}): hand AtP"
            f" {w['times'][HAND] * 1e3:.1f} ms, study AtP {w['times'][STUDY] * 1e3:.1f} ms:"
            f" **{w['ratio']:.2f}×** ({wl:.2f}–{wh:.2f}); against hand AtP by autograd.grad"
            f" {_ratio(w, 'ratio_grads', 'quartiles_grads')}: where the passes cost more, planning and the Python"
            " around them weigh less.",
            "",
        ]
    if "plan_share" in data:
        other = 1 - data["forward_share"] - data["plan_share"]
        md += [
            f"Where the study's time goes (each part timed alone in the same rounds): the forwards"
            f" {data['forward_share']:.0%}; planning the 39 cells {data['plan_share']:.0%}"
            f" ({t['planning the cells'] * 1e3:.1f} ms: one `compile_plan` per layer, the other cells' edits derived"
            " from their layer's plan with their own index, no probe forward: shapes are checked on the"
            f" attribution's own pass); the rest {max(other, 0):.0%} (the hooks keeping each site's activation,"
            " the products read in one gather per site, the metric on the source run, the result's tensors).",
            "",
        ]
    if data.get("note"):
        md += [data["note"], ""]
    ok = data["verdict"] == "met"
    shown = yes(ok) if ok or data["verdict"] == "over" else data["verdict"]
    targets = [["study AtP / AtP by hand (3 × 13 grid)", f"≤ {data['target']:.1f}",
                f"{data['ratio']:.2f} ({low:.2f}–{high:.2f})", shown]]  # fmt: skip
    misses = [] if ok else [f"attribution: study AtP is {data['ratio']:.2f}× AtP by hand (section 13)"]
    return md, targets, misses


def _ratio(data: dict[str, Any], ratio: str, quartiles: str) -> str:
    """``1.23 (1.20–1.26)``, or ``-`` for a run made before the figure was taken."""
    if ratio not in data:
        return "-"
    low, high = data[quartiles]
    return f"{data[ratio]:.2f} ({low:.2f}–{high:.2f})"
