"""Edge attribution patching: every edge's effect estimated from one forward and backward (EAP, EAP-IG).

An edge's exact effect adds ``delta_s = sender(source) - sender(main)`` to its receiver's input alone. EAP
takes the first-order term, ``Σ delta_s · ∂metric/∂input_r`` over positions and the model width, with the
gradient at the main run; EAP-IG averages that gradient over ``steps`` runs whose stream entering block 0
is the midpoint ``main + (k + ½)/steps · (source - main)``. The gradient at a receiver is taken at its own
copy of the stream (the norm's input), so it counts only what reaches the metric through that branch.

Every sender's delta is stacked ``[senders, batch, positions, d_model]``, every receiver's gradient
``[receivers, ...]``; one einsum gives all ``senders × receivers`` products, of which the edges are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from surgery.circuit.graph import Graph
from surgery.circuit.hooks import Senders, hooked
from surgery.errors import ConfigError

Metrics = Callable[[torch.Tensor], list[torch.Tensor]]  # logits -> each metric per example (differentiable)
Forward = Callable[[], torch.Tensor]  # one forward of the batch: its logits


def estimate(
    graph: Graph, run: Forward, source: Senders, metrics: Metrics, steps: int | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each metric's estimated effect of every edge ``[edges, batch]`` (float64), and its unmodified value ``[batch]``.

    ``source``: what every sender wrote in the source run; ``steps``: EAP-IG's number of points.
    """
    main = Senders()
    grads, base = _gradients(graph, run, metrics, main, None)
    deltas = source.stacked(graph) - main.stacked(graph)
    if steps is not None:
        source_embed = source.embed_value()
        start = main.embed_value()
        total = [torch.zeros_like(g) for g in grads]
        for k in range(steps):
            point = (start + (k + 0.5) / steps * (source_embed - start)).detach()
            for t, g in zip(total, _gradients(graph, run, metrics, None, point)[0], strict=True):
                t += g
        grads = [t / steps for t in total]
    return [_products(graph, deltas, g) for g in grads], base


def _products(graph: Graph, deltas: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``Σ delta[sender] · grad[receiver]`` over positions and width, for every edge: ``[edges, batch]``."""
    every = torch.einsum("sbpd,rbpd->srb", deltas.to(grads.dtype), grads)
    return every[graph.sender, graph.receiver].double()


def _gradients(
    graph: Graph, run: Forward, metrics: Metrics, senders: Senders | None, point: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward and backward: per metric, ``∂Σmetric/∂input`` at every receiver ``[receivers, B, P, D]``;
    and each metric's values. ``point`` replaces the stream entering block 0; ``senders`` records the forward."""
    inputs: dict[int, torch.Tensor] = {}
    senders = senders if senders is not None else Senders()  # its stream shape gives every gradient one shape

    def own_copy(r: int, x: torch.Tensor) -> torch.Tensor:
        inputs[r] = x.clone()  # the branch's own tensor: its gradient is what reaches the metric through it
        return inputs[r]

    def rooted(x: torch.Tensor) -> torch.Tensor:
        start = x if point is None else point
        return start if start.requires_grad else start.detach().requires_grad_(True)

    with torch.enable_grad(), hooked(graph, senders, embed=rooted, change=own_copy):
        values = metrics(run())
    order = sorted(inputs)
    if order != list(range(len(graph.reads))):
        missing = sorted(set(range(len(graph.reads))) - set(order))
        raise ConfigError(f"study.method: the receivers {', '.join(graph.receivers[r].name for r in missing)} were"
                          " never read in the forward")  # fmt: skip
    out = []
    for i, value in enumerate(values):
        found = torch.autograd.grad(value.sum(), [inputs[r] for r in order], retain_graph=i < len(values) - 1,
                                    allow_unused=True)  # fmt: skip
        grads = [torch.zeros_like(inputs[r]) if g is None else g for r, g in zip(order, found, strict=True)]
        out.append(torch.stack([g.reshape(senders.shape()) for g in grads]))
    return out, [v.detach() for v in values]
