"""A circuit study's ``report.md``: the pictures, the top edges, the faithfulness of each pruned circuit."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from surgery.circuit.result import CircuitResult


def circuit_markdown(report: dict[str, Any], result: CircuitResult) -> str:
    """report.md of a circuit study: the pictures, the top edges, the faithfulness of each pruned circuit."""
    section = report["circuit"]
    lines = [f"# surgery circuit: {result.method}, {section['edges']} edges ({section['nodes']}),"
             f" {section['examples']} examples", ""]  # fmt: skip
    lines += [f"![{Path(p).stem}]({p})" for p in report["plots"]] + [""]
    lines += [f"| edge | {result.metrics[0]} effect | {result.metrics[0]} under the patch |", "|---|---|---|"]
    lines += [f"| {e['sender']} → {e['receiver']} | {e['score']:.4g} | {e['value']:.4g} |" for e in result.ranked(10)]
    if result.faithfulness:
        lines += ["", "| edges kept | faithfulness |", "|---|---|"]
        for row in result.faithfulness:
            f = row["faithfulness"][result.metrics[0]]
            lines.append(f"| {row['edges']} | {'n/a' if f is None else f'{f:.4f}'} |")
    lines += [
        "",
        "Every edge: `circuit.json` (by |score|) and `circuit.safetensors` (`scores/METRIC`, `values/METRIC`).",
    ]
    return "\n".join(lines) + "\n"
