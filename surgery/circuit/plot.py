"""Pictures of a circuit: the graph of its top edges, and the faithfulness of its pruned circuits.

The graph reads bottom to top: ``embed``, then per block a row of attention (one dot per head with
``nodes: heads``) and a row for the MLP, then ``logits``. An edge is drawn from its sender to its
receiver (a receiver ``attn.L`` of heads is the bar under block L's heads: every head reads that input),
its width the edge's |score| against the largest drawn, red where patching it raises the metric, blue
where it lowers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from surgery.files.write import write_figure
from surgery.safe.costs import figure_refusal

if TYPE_CHECKING:
    from surgery.circuit.result import CircuitResult

DPI = 100
ROW = 0.55  # inches per row of the graph


def write(path: Path, fig: Any) -> None:
    """Write ``fig`` as a PNG at ``path`` and free it."""
    try:
        write_figure(path, fig, dpi=DPI)
    finally:
        fig.clear()


def _places(result: CircuitResult) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]], float]:
    """Where each sender and each receiver is drawn (x, y), and the width of the picture in node columns."""
    g = result.graph
    across = float(max(g.heads, 1)) if g.nodes == "heads" else 1.0
    middle = (across - 1) / 2
    out: dict[str, tuple[float, float]] = {"embed": (middle, 0.0)}
    into: dict[str, tuple[float, float]] = {}
    for node in g.senders[1:]:
        row = 2 * node.layer + (1 if node.kind in ("attn", "head") else 2)
        x = float(node.head) if node.head is not None else middle
        out[node.name] = (x, float(row))
    for node in g.receivers:
        if node.kind == "logits":
            into[node.name] = (middle, 2.0 * g.layers + 1)
        else:
            row = 2 * node.layer + (1 if node.kind == "attn" else 2)
            into[node.name] = (middle, row - (0.35 if g.nodes == "heads" and node.kind == "attn" else 0.0))
    return out, into, across


def circuit_figure(result: CircuitResult, top: int = 30) -> Any:
    """The matplotlib Figure of the ``top`` edges by |score| of the first metric."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch

    g = result.graph
    out, into, across = _places(result)
    rows = 2 * g.layers + 2
    width, height = max(6.0, 1.0 + 0.75 * across), 1.5 + ROW * rows
    if figure_refusal(width, height, DPI) is not None:  # a very deep model: squeezed rows, still drawn
        height = 4000 / DPI - 0.1
    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot(1, 1, 1)
    edges = result.ranked(top)
    used = {e["sender"] for e in edges} | {e["receiver"] for e in edges}
    largest = max((abs(e["score"]) for e in edges), default=0.0) or 1.0
    for name, (x, y) in out.items():
        ax.plot([x], [y], "o", color="black" if name in used else "lightgrey", markersize=6, zorder=3)
    if g.nodes == "heads":
        for layer in range(g.layers):
            ax.plot([-0.3, across - 0.7], [2 * layer + 0.65] * 2, color="grey", linewidth=2, zorder=2)
    ax.plot([into["logits"][0]], [into["logits"][1]], "s", color="black", markersize=8, zorder=3)
    for e in reversed(edges):  # the largest drawn last, on top
        start, end = out[e["sender"]], into[e["receiver"]]
        span = end[1] - start[1]
        bend = 0.0 if span <= 1 else 0.25 * (1 if (start[0] + span) % 2 else -1)
        color = "tab:red" if e["score"] > 0 else "tab:blue"
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=8, connectionstyle=f"arc3,rad={bend}",
                                     linewidth=0.5 + 4.5 * abs(e["score"]) / largest, color=color, alpha=0.75,
                                     zorder=1))  # fmt: skip
    for name, (x, y) in out.items():
        if name in used or g.nodes == "blocks":
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 3), fontsize=7)
    ax.annotate("logits", into["logits"], textcoords="offset points", xytext=(8, 0), fontsize=8)
    labels = ["embed"] + [f"{part} {layer}" for layer in range(g.layers) for part in ("attn", "mlp")] + ["logits"]
    ax.set_yticks(range(rows), labels, fontsize=7)
    ax.set_xticks([])
    ax.set_xlim(-0.8, across - 0.2 + (0.6 if across == 1 else 0))
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_title(f"{result.method}: top {len(edges)} of {len(result.edges)} edges by |{result.metrics[0]} effect|"
                 f"\nred: patching raises it, blue: lowers it", fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig


def faithfulness_figure(result: CircuitResult) -> Any:
    """The faithfulness of the first metric against the number of edges kept (ends: 0 edges 0, every edge 1)."""
    from matplotlib.figure import Figure

    name = result.metrics[0]
    total = len(result.edges)
    points = sorted({(0, 0.0), (total, 1.0)} | {(r["edges"], r["faithfulness"][name]) for r in result.faithfulness
                                                if r["faithfulness"][name] is not None})  # fmt: skip
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    if total > 100:  # thousands of edges: the small circuits would crowd the left edge on a linear axis
        ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(0, total * 1.03)
    ax.set_xlabel(f"edges kept (of {total}), by |score|")
    ax.set_ylabel(f"faithfulness ({name})")
    ax.set_title("1 = the unmodified model, 0 = every edge patched to its source value", fontsize=9)
    fig.tight_layout()
    return fig
