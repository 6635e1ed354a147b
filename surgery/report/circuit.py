"""A circuit in ``report.html``, from the run's ``circuit.json`` (SPEC §21): the graph of the top edges as inline
SVG (nodes in model order, left to right: ``embed``, ``attn.L`` or ``head.L.H``, ``mlp.L``, ``logits``) and the
faithfulness curve of the pruned circuits.

``circuit.json`` is data: node names are parsed, never trusted; one the layout does not know goes last.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from surgery.files.gate import member, read_json
from surgery.report.page import escape, number, table
from surgery.report.study import verify_html
from surgery.report.svg import Point, xy_chart

EDGES_SHOWN = 60  # the strongest edges drawn
CIRCUIT_MAX = 64 * 2**20
NAME = re.compile(r"(embed|attn|head|mlp|logits)(?:\.(\d+))?(?:\.(\d+))?")
COUNT_KEYS = ("edges", "top_edges", "top", "n", "count")
VALUE_KEYS = ("faithfulness", "value", "score")
COLUMN, ROW, PAD = 90, 22, 40


def read_circuit(out_dir: Path) -> Any:
    """``circuit.json`` of the run directory, or None when the run wrote none."""
    if not (out_dir / "circuit.json").is_file():
        return None
    return read_json(member(out_dir, "circuit.json", "report.html", "circuit.json"), "report.html", CIRCUIT_MAX)


def _place(name: str) -> tuple[float, int]:
    """(column, row) of a node: columns in model order, heads of one block stacked in their block's column."""
    found = NAME.fullmatch(name)
    if found is None:
        return math.inf, 0
    kind, layer, head = found.group(1), found.group(2), found.group(3)
    if kind == "embed":
        return 0.0, 0
    if kind == "logits":
        return math.inf, 0
    # block L: attn.L (a receiver, and the sender with blocks), its heads just after, then mlp.L
    column = 3 * int(layer or 0) + {"attn": 1.0, "head": 2.0, "mlp": 3.0}[kind]
    return column, int(head) if head is not None else 0


def _names(circuit: Mapping[str, Any], edges: list[Mapping[str, Any]]) -> list[str]:
    nodes = circuit.get("nodes")
    if isinstance(nodes, Mapping):  # {"senders": [...], "receivers": [...]}
        nodes = [n for group in nodes.values() if isinstance(group, list) for n in group]
    named = [str(n.get("name")) if isinstance(n, Mapping) else str(n) for n in nodes] if isinstance(nodes, list) else []
    for edge in edges:
        named += [str(edge.get("sender")), str(edge.get("receiver"))]
    return list(dict.fromkeys(named))


def graph_svg(circuit: Mapping[str, Any]) -> str:
    """The strongest ``EDGES_SHOWN`` edges as arcs between nodes; width by |score|, red positive, blue negative."""
    edges = [e for e in circuit.get("edges") or [] if isinstance(e, Mapping) and _score(e) is not None]
    top = sorted(edges, key=lambda e: -abs(_score(e) or 0.0))[:EDGES_SHOWN]
    used = set(_names({}, top))
    names = [n for n in _names(circuit, top) if n in used]
    if not names:
        return ""
    places = {n: _place(n) for n in names}
    columns = sorted({c for c, _ in places.values()})
    rows = max(r for _, r in places.values()) + 1
    x = {n: PAD + columns.index(c) * COLUMN for n, (c, _) in places.items()}
    lift = 0.15 * (len(columns) - 1) * COLUMN  # room above the nodes for the arcs (a long edge arcs higher)
    y = {n: PAD + lift + (r + 0.5) * ROW for n, (_, r) in places.items()}
    width, height = PAD * 2 + (len(columns) - 1) * COLUMN, PAD * 2 + lift + ROW * rows
    strongest = max(abs(_score(e) or 0.0) for e in top) or 1.0
    lines = []
    for e in reversed(top):  # the strongest drawn last, on top
        s = _score(e) or 0.0
        a, b = str(e.get("sender")), str(e.get("receiver"))
        tip = f"{a} → {b}: {s:.4g}"
        bend = (x[a] + x[b]) / 2, (y[a] + y[b]) / 2 - 0.3 * abs(x[b] - x[a])  # an arc over the nodes between
        lines.append(f'<path class="edge {"up" if s >= 0 else "down"}" d="M{x[a]},{y[a]:.1f} Q{bend[0]:.1f},'
                     f'{bend[1]:.1f} {x[b]},{y[b]:.1f}" stroke-width="{0.5 + 4.5 * abs(s) / strongest:.2f}">'
                     f"<title>{escape(tip)}</title></path>")  # fmt: skip
    dots = [f'<circle class="node" cx="{x[n]}" cy="{y[n]:.1f}" r="6"><title>{escape(n)}</title></circle>'
            f'<text class="label" x="{x[n]}" y="{y[n] - 9:.1f}" text-anchor="middle">{escape(n)}</text>'
            for n in names]  # fmt: skip
    return (f'<svg class="graph" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
            f'{"".join(lines)}{"".join(dots)}</svg>')  # fmt: skip


def _score(edge: Mapping[str, Any]) -> float | None:
    s = edge.get("score")
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) else None


def faithfulness_points(found: Any, total: int | None = None) -> tuple[str, list[Point]]:
    """(metric, points of edges kept against faithfulness) from circuit.json's ``faithfulness``: a list of
    ``{"edges": N, "faithfulness": {METRIC: value}}`` (the first metric drawn) or of ``{"edges": N,
    "faithfulness": value}``, or ``{"N": value}``; with ``total`` edges, the ends (0 edges: 0, all: 1) too."""
    pairs: list[tuple[Any, Any]] = []
    metric = ""
    if isinstance(found, Mapping):
        pairs = list(found.items())
    elif isinstance(found, list):
        for item in found:
            if not isinstance(item, Mapping):
                continue
            count = next((item[k] for k in COUNT_KEYS if k in item), None)
            value = next((item[k] for k in VALUE_KEYS if k in item), None)
            if isinstance(value, Mapping) and value:  # one per metric: the first
                metric = metric or str(next(iter(value)))
                value = value.get(metric)
            pairs.append((count, value))
    points = []
    for count, value in pairs:
        try:
            n, v = float(count), float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(n) and math.isfinite(v):
            points.append(Point(n, v, f"top {n:g} edges: faithfulness {v:.4g}"))
    if points and total:
        points += [Point(0.0, 0.0, "no edge: 0"), Point(float(total), 1.0, f"every edge ({total}): 1")]
    return metric, sorted(points, key=lambda p: p.x)


def circuit_html(circuit: Any) -> str:
    """The circuit's section: the graph, the faithfulness curve, and the strongest edges as a table."""
    if not isinstance(circuit, Mapping):
        return f"<p>circuit.json is not an object: <code>{escape(json.dumps(circuit)[:200])}</code></p>"
    edges = [e for e in circuit.get("edges") or [] if isinstance(e, Mapping)]
    parts = [f"<p>{len(edges)} edges; the {min(len(edges), EDGES_SHOWN)} strongest drawn (hover for scores).</p>",
             graph_svg(circuit)]  # fmt: skip
    metric, points = faithfulness_points(circuit.get("faithfulness"), len(edges))
    if points:
        label = f"faithfulness ({metric})" if metric else "faithfulness"
        parts.append("<h3>Faithfulness</h3>" + xy_chart(points, "edges kept", label, line=True))
    elif circuit.get("faithfulness") is not None:
        parts.append(f"<h3>Faithfulness</h3><pre>{escape(json.dumps(circuit['faithfulness'])[:2000])}</pre>")
    rows = [[e.get("sender"), e.get("receiver"), number(_score(e))]
            for e in sorted(edges, key=lambda e: -abs(_score(e) or 0.0))[:20]]  # fmt: skip
    parts.append("<h3>Strongest edges</h3>" + table(["sender", "receiver", "score"], rows, {2}))
    if isinstance(circuit.get("verify"), Mapping):
        parts.append("<h3>Verify: estimated against exact</h3>" + verify_html(circuit["verify"]))
    return "\n".join(p for p in parts if p)
