"""Edge patching, run exactly: one edge at a time (batched into rows), and pruned circuits.

One edge: its receiver's input alone gets ``sender(source) - sender(main)`` added; every other branch reads
the stream as it was. ``k`` edges share a forward: each example is repeated ``k`` times in a row (as a
study's ``batch_cells``), and edge ``j`` of the chunk changes rows ``j::k`` only.

A pruned circuit keeps some edges: every receiver's input gets, for each edge it does not keep,
``sender(source) - sender(this run)``, so that branch reads the source's value of that sender and the
current value of every kept one (senders downstream of a change are recomputed, as in ACDC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from surgery.circuit.graph import Graph
from surgery.circuit.hooks import Senders, hooked
from surgery.study.inputs import Inputs, logits_of
from surgery.study.metrics import PerExample


@dataclass
class Batch:
    """One batch of examples on one model: its forward (rows repeated ``k`` times) and its metrics."""

    model: Any
    data: Inputs
    labels: torch.Tensor | None
    metrics: list[PerExample]
    reference: torch.Tensor | None = None  # the unmodified logits (kl compares with them)

    @property
    def examples(self) -> int:
        """How many examples."""
        return self.data.examples

    def logits(self, k: int = 1) -> torch.Tensor:
        """The logits of one forward, each example repeated ``k`` times in a row."""
        return logits_of((self.data if k == 1 else self.data.interleaved(k)).run(self.model))

    def score(self, logits: torch.Tensor, k: int = 1) -> list[torch.Tensor]:
        """Each metric per row (float64) of logits whose examples are repeated ``k`` times in a row."""
        labels = self.labels if self.labels is None or k == 1 else self.labels.repeat_interleave(k, dim=0)
        ref = self.reference if self.reference is None or k == 1 else self.reference.repeat_interleave(k, dim=0)
        return [m(logits, labels, ref) for m in self.metrics]


def edge_values(graph: Graph, batch: Batch, deltas: torch.Tensor, edges: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Each metric with each of ``edges`` patched alone: ``[len(edges), examples]`` (float64), ``k`` edges a forward."""
    n, b = len(edges), batch.examples
    out: list[list[torch.Tensor]] = [[] for _ in batch.metrics]
    for start in range(0, n, k):
        chunk = edges[start : start + k]
        rows = len(chunk)
        senders, receivers = graph.sender[chunk], graph.receiver[chunk]
        by_receiver = {int(r): ((receivers == r).nonzero()[:, 0], senders[receivers == r]) for r in receivers.unique()}

        def change(r: int, x: torch.Tensor, by_receiver: Any = by_receiver, rows: int = rows) -> torch.Tensor | None:
            if r not in by_receiver:
                return None
            js, ss = by_receiver[r]
            new = x.clone()
            view = new.view(b, rows, *deltas.shape[2:])
            view[:, js] += deltas[ss].transpose(0, 1).to(new.dtype)
            return new

        with torch.no_grad(), hooked(graph, change=change):
            values = batch.score(batch.logits(rows), rows)
        for kept, value in zip(out, values, strict=True):
            kept.append(value.reshape(b, rows).T)
    return [torch.cat(parts) for parts in out]


def pruned_values(graph: Graph, batch: Batch, source: Senders, keep: torch.Tensor) -> list[torch.Tensor]:
    """Each metric per example ``[examples]`` with only the edges ``keep`` marks (``[edges]``) reading this run."""
    kept = torch.zeros(len(graph.receivers), len(graph.senders), dtype=torch.bool)
    kept[graph.receiver[keep], graph.sender[keep]] = True
    missing = graph.upstream() & ~kept
    current = Senders()
    where = _sender_places(graph)

    def change(r: int, x: torch.Tensor) -> torch.Tensor | None:
        row = missing[r]
        if not row.any():
            return None
        return x + _difference(graph, where, source, current, row).reshape(x.shape).to(x.dtype)

    with torch.no_grad(), hooked(graph, current if missing.any() else None, change=change if missing.any() else None):
        return batch.score(batch.logits())


def _sender_places(graph: Graph) -> dict[tuple[str, int], list[int]]:
    """(kind, block) -> the sender indices there (a block's heads in head order)."""
    places: dict[tuple[str, int], list[int]] = {}
    for i, node in enumerate(graph.senders):
        places.setdefault(("attn" if node.kind == "head" else node.kind, node.layer), []).append(i)
    return places


def _difference(
    graph: Graph, where: dict[tuple[str, int], list[int]], source: Senders, current: Senders, row: torch.Tensor
) -> torch.Tensor:
    """``Σ sender(source) - sender(current)`` over the senders ``row`` marks."""
    total = source.embed_value() - current.embed_value() if row[0] else torch.zeros_like(current.embed_value())
    for (kind, layer), indices in where.items():
        if kind == "embed":
            continue
        mask = row[indices]
        if not mask.any():
            continue
        src, now = (source.mlp, current.mlp) if kind == "mlp" else (source.attn, current.attn)
        if kind == "attn" and graph.nodes == "heads":
            dz = (src[layer] - now[layer]) * mask.to(now[layer].dtype)[:, None]
            total = total + dz.flatten(-2) @ graph.head_weights(layer).detach().flatten(0, 1)
        else:
            total = total + (src[layer] - now[layer])
    return total
