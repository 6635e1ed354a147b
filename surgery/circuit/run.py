"""Run a circuit study: score every edge (exactly or by EAP / EAP-IG), then prune and verify.

``run_circuit`` is what ``surgery.circuit`` and a ``study:`` block with ``method: edges | eap | eap_ig`` call.
Examples go in batches (``batch_size``); each batch runs its source pass once, then its main pass (and for
EAP-IG ``steps`` more). Pruned circuits (``top_edges``) and ``verify_top`` run after every edge is scored,
as they pick edges by their score over all examples.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from surgery.circuit.config import METHODS
from surgery.circuit.eap import estimate
from surgery.circuit.exact import Batch, edge_values, pruned_values
from surgery.circuit.graph import NODES, Graph, build_graph
from surgery.circuit.hooks import Senders, hooked
from surgery.circuit.result import CircuitResult
from surgery.core.wrapped import inner_module
from surgery.errors import ConfigError
from surgery.safe.costs import check_circuit, check_forward_rows
from surgery.study.inputs import Inputs
from surgery.study.metrics import parse_metrics
from surgery.study.rows import AUTO_ROWS
from surgery.study.run import MAX_STEPS, check_gradients
from surgery.study.verify import correlation, spearman


def check_circuit_method(
    method: str, nodes: str, steps: Any, top_edges: Any, verify_top: Any, batch_edges: Any = "auto"
) -> list[int]:
    """The options a circuit study takes, checked before any model is built; returns ``top_edges`` as a list."""
    if method not in METHODS:
        raise ConfigError(f"study.method: {method!r} is not one of {', '.join(METHODS)}")
    if nodes not in NODES:
        raise ConfigError(f"study.nodes: {nodes!r} is not one of {', '.join(NODES)}")
    if method == "eap_ig":
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ConfigError(f"study.steps: eap_ig needs a number of points from 1 to {MAX_STEPS}; got {steps!r}")
    elif steps is not None:
        raise ConfigError("study.steps: only for method: eap_ig; drop it")
    given = [] if top_edges is None else [top_edges] if isinstance(top_edges, int) else top_edges
    if isinstance(top_edges, bool) or not isinstance(given, Sequence) or isinstance(given, str) or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in given
    ):  # fmt: skip
        raise ConfigError(f"study.top_edges: a list of edge counts (0 or more), e.g. [10, 50, 200]; got {top_edges!r}")
    if verify_top is not None:
        if method == "edges":
            raise ConfigError("study.verify_top: checks EAP's estimates; method: edges is exact already, drop it")
        if isinstance(verify_top, bool) or not isinstance(verify_top, int) or verify_top < 1:
            raise ConfigError(f"study.verify_top: a number of edges (1 or more); got {verify_top!r}")
    if batch_edges != "auto" and (isinstance(batch_edges, bool) or not isinstance(batch_edges, int) or batch_edges < 1):
        raise ConfigError(
            f"study.batch_cells: 'auto' or a number of edges per forward (1 or more); got {batch_edges!r}"
        )
    return [int(n) for n in given]


def run_circuit(
    model: nn.Module, inputs: Any, source: Any, metrics: Any, *, method: str = "eap", nodes: str = "blocks",
    steps: int | None = None, top_edges: Any = None, tokenizer: Any = None, labels: torch.Tensor | None = None,
    batch_size: int | None = None, batch_edges: Any = "auto", verify_top: int | None = None,
) -> CircuitResult:  # fmt: skip
    """Every edge of ``model``'s graph scored per example (see :func:`surgery.circuit`)."""
    started = time.perf_counter()
    model = inner_module(model)
    sizes = check_circuit_method(method, nodes, steps, top_edges, verify_top, batch_edges)
    if source is None:
        raise ConfigError("source: a circuit patches each edge towards the source run; give one (+source=...)")
    data, src = Inputs.of(inputs, "inputs"), Inputs.of(source, "source")
    n = data.examples
    if src.examples not in (1, n):
        raise ConfigError(f"source: {src.examples} examples; give one, or as many as inputs ({n})")
    bound = parse_metrics(metrics, tokenizer)
    if method != "edges":
        flat = [m.name for m in bound if m.name in ("rank", "accuracy")]
        if flat:
            raise ConfigError(f"study.metrics: {flat[0]} has no gradient, so {method} cannot estimate it; use"
                              " logit_diff, prob, logit, loss or kl, or method: edges")  # fmt: skip
    graph = build_graph(model, nodes)
    edges = len(graph.sender)
    too_many = [size for size in sizes if size > edges]
    if too_many:
        raise ConfigError(f"study.top_edges: {too_many[0]} edges asked for; this graph has {edges}")
    rows = min(batch_size or n, n)
    positions = data.positions() or 1
    width = _width(model)
    stacked = (len(graph.senders) + len(graph.receivers) * len(bound)) * rows * positions * width
    check_circuit(edges, n, exact=method == "edges", steps=steps, runs=len(sizes) + 2 * bool(sizes),
                  verified=verify_top or 0, metrics=len(bound), stacked=stacked)  # fmt: skip
    if method != "edges":
        check_gradients(list(model.modules()), method)
    k = _edges_per_forward(batch_edges, edges, rows)
    check_forward_rows(k * rows if method == "edges" else 2 * rows, positions * _widest(model), 4, "study.batch_cells")
    labels = data.text_labels() if labels is None else labels
    src_labels = src.text_labels()
    if src.examples != n:
        src, src_labels = src.repeated(n), None if src_labels is None else src_labels.expand(n, -1)
    batches = [(a, min(a + rows, n)) for a in range(0, n, rows)]
    parts: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = []
    planned = time.perf_counter()
    for a, b in batches:
        batch = Batch(model, data.rows(a, b), None if labels is None else labels[a:b], bound)
        source_run, source_values = _source(graph, batch, src.rows(a, b), src_labels, a, b)
        parts.append((*_scored(graph, batch, source_run, method, steps, k), source_values))
    effects = [torch.cat([p[0][i] for p in parts], dim=1) for i in range(len(bound))]
    base = [torch.cat([p[1][i] for p in parts]) for i in range(len(bound))]
    names = [m.name for m in bound]
    result = CircuitResult(
        graph=graph, method=method, metrics=names,
        values={m: e + v for m, e, v in zip(names, effects, base, strict=True)},
        scores={m: e.mean(dim=-1) for m, e in zip(names, effects, strict=True)},
        baselines={"unmodified": dict(zip(names, base, strict=True)),
                   "source": {m: torch.cat([p[2][i] for p in parts]) for i, m in enumerate(names)}},
        steps=steps,
    )  # fmt: skip
    scored = time.perf_counter()
    if sizes or verify_top:
        _after(result, graph, model, data, src, labels, bound, batches, sizes, verify_top, k)
    result.seconds = {"plan": planned - started, "run": scored - planned, "prune": time.perf_counter() - scored}
    return result


def _source(
    graph: Graph, batch: Batch, src: Inputs, labels: torch.Tensor | None, a: int, b: int
) -> tuple[Senders, list[torch.Tensor]]:
    """The source pass of one batch: what every sender wrote, and the metrics on the source run."""
    senders = Senders()
    with torch.no_grad(), hooked(graph, senders):
        logits = Batch(batch.model, src, None, batch.metrics).logits()
    ref = None
    if any(m.needs_reference for m in batch.metrics):
        with torch.no_grad():
            ref = batch.logits()
    values = [m(logits, None if labels is None else labels[a:b], ref) for m in batch.metrics]
    return senders, values


def _scored(
    graph: Graph, batch: Batch, source: Senders, method: str, steps: int | None, k: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each metric's effect of every edge ``[edges, batch]`` and its unmodified value ``[batch]``."""
    if method == "edges":
        main = Senders()
        with torch.no_grad(), hooked(graph, main):
            batch.reference = batch.logits()
        base = batch.score(batch.reference)
        deltas = source.stacked(graph) - main.stacked(graph)
        values = edge_values(graph, batch, deltas, torch.arange(len(graph.sender)), k)
        return [v - u for v, u in zip(values, base, strict=True)], base

    def metrics(logits: torch.Tensor) -> list[torch.Tensor]:
        if batch.reference is None and any(m.needs_reference for m in batch.metrics):
            batch.reference = logits.detach()  # the unmodified logits: the main run's own
        return batch.score(logits)

    return estimate(graph, batch.logits, source, metrics, steps if method == "eap_ig" else None)


def _after(
    result: CircuitResult, graph: Graph, model: nn.Module, data: Inputs, src: Inputs, labels: torch.Tensor | None,
    bound: list[Any], batches: list[tuple[int, int]], sizes: list[int], verify_top: int | None, k: int,
) -> None:  # fmt: skip
    """Pruned circuits' faithfulness (``sizes``) and the top ``verify_top`` edges run exactly, batch by batch."""
    first = result.metrics[0]
    order = torch.argsort(result.scores[first].abs().nan_to_num(-1.0), descending=True)
    edges = len(graph.sender)
    circuits = [edges, 0, *sizes] if sizes else []
    pruned: list[list[list[torch.Tensor]]] = [[] for _ in circuits]
    checked: list[torch.Tensor] = []
    chosen = order[: verify_top or 0]
    for a, b in batches:
        batch = Batch(model, data.rows(a, b), None if labels is None else labels[a:b], bound)
        source, _ = _source(graph, batch, src.rows(a, b), None, a, b)
        if any(m.needs_reference for m in bound):
            with torch.no_grad():
                batch.reference = batch.logits()
        for i, size in enumerate(circuits):
            keep = torch.zeros(edges, dtype=torch.bool)
            keep[order[:size]] = True
            pruned[i].append(pruned_values(graph, batch, source, keep))
        if verify_top:
            main = Senders()
            with torch.no_grad(), hooked(graph, main):
                batch.logits()
            deltas = source.stacked(graph) - main.stacked(graph)
            checked.append(edge_values(graph, batch, deltas, chosen, k)[0])
    if sizes:
        means = [[float(torch.cat([part[j] for part in runs]).mean()) for j in range(len(bound))] for runs in pruned]
        full, empty = means[0], means[1]
        result.faithfulness = [
            {"edges": size, "mean": dict(zip(result.metrics, means[i + 2], strict=True)),
             "faithfulness": {m: _scaled(means[i + 2][j], full[j], empty[j]) for j, m in enumerate(result.metrics)}}
            for i, size in enumerate(sizes)
        ]  # fmt: skip
        result.ends = {"unmodified": dict(zip(result.metrics, full, strict=True)),
                       "every_edge_patched": dict(zip(result.metrics, empty, strict=True))}  # fmt: skip
    if verify_top:
        exact = torch.cat(checked, dim=1).mean(dim=-1)
        guessed = result.values[first][chosen].mean(dim=-1)
        result.verify = {
            "metric": first, "edges": [result.edge_names[i] for i in chosen.tolist()], "estimate": guessed.tolist(),
            "exact": exact.tolist(), "pearson": correlation(guessed, exact), "spearman": spearman(guessed, exact),
        }  # fmt: skip


def _scaled(value: float, full: float, empty: float) -> float | None:
    """``(value - empty) / (full - empty)``: 1 = the unmodified model, 0 = every edge patched; None when they agree."""
    return None if full == empty else (value - empty) / (full - empty)


def _edges_per_forward(wanted: Any, edges: int, rows: int) -> int:
    """How many edges share one forward: ``auto`` fills about AUTO_ROWS rows."""
    if wanted == "auto":
        return max(1, min(edges, AUTO_ROWS // max(rows, 1)))
    return max(1, min(int(wanted), edges))


def _width(model: nn.Module) -> int:
    """The model's hidden width (its embedding's)."""
    getter = getattr(model, "get_input_embeddings", None)
    embed = getter() if callable(getter) else None
    weight = getattr(embed, "weight", None)
    return int(weight.shape[-1]) if isinstance(weight, torch.Tensor) else _widest(model)


def _widest(model: nn.Module) -> int:
    """The model's widest dimension (an LM's vocabulary: what one row's logits hold a position)."""
    return max((max(p.shape) for p in model.parameters() if p.dim()), default=1)
