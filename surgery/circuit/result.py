"""What a circuit study gives: every edge's score and per-example values, pruned circuits, and the files.

``values[METRIC]`` is ``[edges, examples]``: the metric with that edge patched alone (the unmodified value
plus the edge's effect, exact or estimated); ``scores[METRIC]`` is ``[edges]``: the effect's mean over
examples, which ranks edges. Edge ``i`` is ``edges[i]`` = ``(sender, receiver)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from surgery.circuit.graph import Graph


@dataclass
class CircuitResult:
    """A circuit study's results (see the module docstring for the shapes)."""

    graph: Graph
    method: str
    metrics: list[str]
    values: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor]
    baselines: dict[str, dict[str, torch.Tensor]]  # unmodified, source -> metric -> [examples]
    steps: int | None = None
    faithfulness: list[dict[str, Any]] = field(default_factory=list)  # per top_edges size: mean and faithfulness
    ends: dict[str, dict[str, float]] = field(default_factory=dict)  # the means faithfulness scales between
    verify: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def edges(self) -> list[tuple[str, str]]:
        """``(sender, receiver)`` of every edge, in the order of ``scores`` and ``values``."""
        return self.graph.edges

    @property
    def edge_names(self) -> list[str]:
        """Every edge as ``"sender -> receiver"``."""
        return [f"{s} -> {r}" for s, r in self.edges]

    def ranked(self, top: int | None = None, metric: str | None = None) -> list[dict[str, Any]]:
        """The edges by |score| (of ``metric``, the first by default), largest first: ``{sender, receiver, score}``."""
        name = metric or self.metrics[0]
        scores = self.scores[name]
        order = torch.argsort(scores.abs().nan_to_num(-1.0), descending=True)[:top].tolist()
        means = self.values[name].mean(dim=-1)
        edges = self.edges
        return [{"sender": edges[i][0], "receiver": edges[i][1], "score": float(scores[i]), "value": float(means[i]),
                 **({"scores": {m: float(self.scores[m][i]) for m in self.metrics}} if len(self.metrics) > 1 else {})}
                for i in order]  # fmt: skip

    def tensors(self) -> dict[str, torch.Tensor]:
        """``scores/M`` ``[edges]`` and ``values/M`` ``[edges, examples]``: what circuit.safetensors holds."""
        out = {f"scores/{m}": self.scores[m].contiguous() for m in self.metrics}
        out.update({f"values/{m}": self.values[m].contiguous() for m in self.metrics})
        return out

    def to_dict(self) -> dict[str, Any]:
        """circuit.json: the nodes, the edges by |score|, the baselines, faithfulness and verification."""
        g = self.graph
        return {
            "method": self.method, "node_kind": g.nodes, "family": g.family, "steps": self.steps,
            "metrics": self.metrics,
            "nodes": {"senders": [n.name for n in g.senders], "receivers": [n.name for n in g.receivers]},
            "edges": self.ranked(),
            "baselines": {w: {m: float(v.mean()) for m, v in t.items()} for w, t in self.baselines.items()},
            "faithfulness": self.faithfulness, "faithfulness_ends": self.ends, "verify": self.verify,
        }  # fmt: skip

    def to_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` to ``path`` as JSON."""
        from surgery.files.write import write_json

        target = Path(path)
        write_json(target, self.to_dict())
        return target

    def plot(self, path: str | Path, top: int = 30) -> Path:
        """Draw the graph of the ``top`` edges by |score| as a PNG at ``path``."""
        from surgery.circuit.plot import circuit_figure, write

        target = Path(path)
        write(target, circuit_figure(self, top))
        return target

    def plot_faithfulness(self, path: str | Path) -> Path:
        """Draw the faithfulness of each pruned circuit against its number of edges as a PNG at ``path``."""
        from surgery.circuit.plot import faithfulness_figure, write

        target = Path(path)
        write(target, faithfulness_figure(self))
        return target

    def __repr__(self) -> str:
        examples = next(iter(self.values.values())).shape[-1] if self.values else 0
        return (f"CircuitResult({self.method}, {self.graph.nodes}: {len(self.edges)} edges, {examples} examples,"
                f" metrics: {', '.join(self.metrics)})")  # fmt: skip
