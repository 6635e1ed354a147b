"""A study's ``report.md``: the plots first, then the baselines, where the numbers are, and the normalization."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from surgery.study.result import StudyResult


def study_markdown(report: dict[str, Any], result: StudyResult) -> str:
    """report.md of a study: the plots first, then the baselines and where the numbers are."""
    section = report["study"]
    sizes = " × ".join(f"{name} ({len(values)})" for name, values in result.grid.items())
    lines = [f"# surgery study: {sizes}, {section['examples']} examples", ""]
    lines += [f"![{Path(p).stem}]({p})" for p in report["plots"]] + [""]
    lines += [f"- `{name}` {why}" for name, why in report.get("plot_notes", {}).items()]
    lines += [""] if report.get("plot_notes") else []
    lines += ["| metric | unmodified | source |", "|---|---|---|"]
    base = section["baselines"]
    for name in result.metrics:
        source = f"{base['source'][name]:.6g}" if "source" in base else ""
        lines.append(f"| {name} | {base['unmodified'][name]:.6g} | {source} |")
    lines += ["", f"Every cell's mean and interval: `study.csv`; per-example values: `study.safetensors` "
              f"(`values/METRIC`, shaped [{', '.join(result.grid)}, examples]).", ""]  # fmt: skip
    scale = result.normalization
    if scale is not None:
        ends = {end: scale[end] if isinstance(scale[end], str) else f"the actions {', '.join(scale[end])} alone"
                for end in ("zero", "one")}  # fmt: skip
        over = " on the means over examples" if scale["over"] == "mean" else " per example"
        lines.append(f"`{scale['metric']}` is normalized{over}: 0 = {ends['zero']}, 1 = {ends['one']}.")
        if scale["zero_denominators"]:
            lines.append(f"{scale['zero_denominators']} example(s) score the same in both and are left out (NaN).")
    return "\n".join(lines) + "\n"
