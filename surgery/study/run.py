"""Run a study: every cell planned and checked before any runs, then scored batch by batch (cells.py).

``run_study`` is what ``surgery.study`` and ``+study=NAME`` call: it parses the grid and metrics,
fills and compiles each cell's actions once, probes every cell in one forward of the unmodified
model, scores the cells exactly (``method: patch``) or estimates them (``attribution``,
``integrated_gradients``), gathers ranks' cells under torchrun, and returns a ``StudyResult``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import Plan, Shared, compile_plan, load_actions
from surgery.core.probe import check_before_apply
from surgery.core.wrapped import inner_module
from surgery.errors import ConfigError, SurgeryError
from surgery.safe.costs import check_forward_rows, check_study
from surgery.study.baselines import Normalization, label, normalized, parse_normalize
from surgery.study.cells import Attribution, Run
from surgery.study.direct import Direct, why_not_direct
from surgery.study.estimates import EditedCells
from surgery.study.every import every_value
from surgery.study.grid import cells, check_uses, fill, naming, parse_grid
from surgery.study.inputs import Inputs
from surgery.study.metrics import PerExample, parse_metrics
from surgery.study.result import StudyResult
from surgery.study.resume import Progress
from surgery.study.rows import cells_per_forward, restricted, why_not_rowwise
from surgery.study.sources import shared_captures
from surgery.study.stats import N_BOOT, bootstrap, mean
from surgery.study.template import Template, derive
from surgery.study.verify import verified

METHODS = ("patch", "attribution", "integrated_gradients")
MAX_STEPS = 1000


def check_method(method: str, steps: int | None, verify_top: int | None) -> None:
    """``method`` is one of METHODS; ``steps`` goes with integrated_gradients, ``verify_top`` with an estimate."""
    if method not in METHODS:
        circuit = method in ("edges", "eap", "eap_ig")
        raise ConfigError(
            f"study.method: {method!r} is not one of {', '.join(METHODS)}"
            + (" (edges between components: surgery.circuit(..., method=...), docs/circuits.md)" if circuit else "")
        )
    if method == "integrated_gradients":
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ConfigError(
                f"study.steps: integrated_gradients needs a number of points from 1 to {MAX_STEPS}; got {steps!r}"
            )
    elif steps is not None:
        raise ConfigError("study.steps: only for method: integrated_gradients; drop it")
    if verify_top is not None:
        if method == "patch":
            raise ConfigError("study.verify_top: checks an attribution's estimates; patch is exact already, drop it")
        if isinstance(verify_top, bool) or not isinstance(verify_top, int) or verify_top < 1:
            raise ConfigError(f"study.verify_top: a number of cells (1 or more); got {verify_top!r}")


def check_gradients(modules: list[nn.Module], method: str) -> None:
    """An estimate takes a backward pass: refused inside ``torch.inference_mode`` or on inference-mode weights
    (of ``modules``, every module of the model)."""
    if torch.is_inference_mode_enabled():
        raise ConfigError(f"study.method: {method} takes a backward pass, and this study runs inside"
                          " torch.inference_mode(); run it outside inference mode, or use method: patch")  # fmt: skip
    if any(p is not None and p.is_inference() for m in modules for p in m._parameters.values()):
        raise ConfigError(f"study.method: {method} takes a backward pass, and the model's weights were made under"
                          " torch.inference_mode() (inference tensors take no part in one); load the model outside"
                          " inference mode, or use method: patch")  # fmt: skip


def grid_of(grid: Any, actions: dict[str, Any], model: nn.Module, positions: int | None) -> dict[str, list]:
    """The grid's values, ``all`` meaning every block, head or position as the actions use the variable."""
    every = every_value(grid, actions, model, positions) if isinstance(grid, Mapping) else {}
    return parse_grid(grid, positions=positions, every=every)


def plan_cells(
    model: nn.Module,
    actions: dict[str, Any],
    grid_cells: list[dict[str, Any]],
    seed: int,
    strict: bool,
    safe: bool,
    k: int = 1,
    shared: Shared | None = None,
) -> tuple[list[dict[str, Any]], list[Plan]]:
    """Every cell's actions (placeholders filled; with ``k`` cells a forward, cut to its rows) and plan, compiled once.

    A cell that fails is named.
    """
    filled: list[dict[str, Any]] = []
    plans: list[Plan] = []
    shared = shared or Shared()  # one module index; a config or selector seen before is reused
    for i, cell in enumerate(grid_cells):
        node = fill(actions, cell)
        node = node if k == 1 else restricted(node, i % k, k)
        with naming(cell):
            plans.append(compile_plan(model, node, seed=seed, strict=strict, safe=safe, shared=shared))
        if i and not any(step.replaced for step in plans[-1].steps):
            plans[-1].index = None  # the model's own module index, rebuilt if ever read: memory stays flat in cells
        filled.append(node)
    return filled, plans


def probe_cells(model: nn.Module, plans: list[Plan], grid_cells: list[dict[str, Any]], inputs: Inputs) -> None:
    """Check every cell's shapes in one probe forward of the unmodified model; on failure, name the cell."""
    try:
        check_before_apply(model, [s for p in plans for s in p.steps], inputs.args, 1, inputs.kwargs)
    except SurgeryError:
        for plan, cell in zip(plans, grid_cells, strict=True):
            with naming(cell):
                check_before_apply(model, plan.steps, inputs.args, 1, inputs.kwargs)
        raise


def run_study(
    model: nn.Module,
    actions: Any,
    grid: Mapping[str, Any],
    inputs: Any,
    metrics: Any,
    *,
    source: Any = None,
    labels: torch.Tensor | None = None,
    normalize: Any = False,
    ci: float | None = None,
    n_boot: int = N_BOOT,
    tokenizer: Any = None,
    seed: int = 0,
    batch_size: int | None = None,
    batch_cells: Any = "auto",
    strict: bool = True,
    safe: bool = False,
    progress: Progress | None = None,
    ranks: tuple[int, int] | None = None,
    method: str = "patch",
    steps: int | None = None,
    verify_top: int | None = None,
) -> StudyResult:
    """Every cell of ``grid`` applied to ``model`` and scored per example by ``metrics`` (see :func:`surgery.study`)."""
    started = time.perf_counter()
    model = inner_module(model)  # a wrapped model (nnsight) runs as its inner module
    check_method(method, steps, verify_top)
    data = Inputs.of(inputs, "inputs")
    src = Inputs.of(source, "source") if source is not None else None
    if src is not None and src.examples not in (1, data.examples):
        raise ConfigError(f"source: {src.examples} examples; give one, or as many as inputs ({data.examples})")
    ids = data.token_ids()
    spec = load_actions(actions)
    parsed = grid_of(grid, spec, model, data.positions())
    check_uses(parsed, spec)
    bound = parse_metrics(metrics, tokenizer)
    scale = parse_normalize(normalize, spec, src is not None)
    if labels is None:
        labels = data.text_labels()
    n = data.examples
    size = math.prod(len(v) for v in parsed.values())
    check_study(size, n, n_boot=n_boot if ci is not None else None,
                steps=steps if method == "integrated_gradients" else None, metrics=len(bound))  # fmt: skip
    grid_cells = cells(parsed)
    if src is not None and src.examples != n:
        src = src.repeated(n)  # one source example serves every row: the same rows as the inputs
    if method == "patch":
        shared = Shared()
        template = Template(model, spec, grid_cells, seed, strict, safe, shared, partial(why_not_direct,
                            sourced=src is not None))  # fmt: skip
        direct = Direct(template, list(spec)) if template.why_not is None else None
        if direct is not None:
            why = direct.why_not_shared if src is not None else None
        else:
            why = _why_not_rowwise(spec, grid_cells, src is not None)
        k = cells_per_forward(batch_cells, len(grid_cells), batch_size or n, why)
        check_forward_rows(k * min(batch_size or n, n), *_row_values(model, data), "study.batch_cells")
        if direct is not None:  # the cells as edits at sites: checked on the first batch, before any runs
            run = Run(model, [], bound, data, src, labels, batch_size or n, k, None, direct=direct)
        else:
            filled, plans = plan_cells(model, spec, grid_cells, seed, strict, safe, k, shared)
            first = data.rows(0, 1)
            probe_cells(model, plans, grid_cells, first if k == 1 else first.interleaved(k))
            run = Run(model, plans, bound, data, src, labels, batch_size or n, k,
                      shared_captures(filled, plans) if src is not None else None)  # fmt: skip
    else:
        flat = [m.name for m in bound if m.name in ("rank", "accuracy")]
        if flat:
            raise ConfigError(f"study.metrics: {flat[0]} has no gradient, so {method} cannot estimate it; use"
                              " logit_diff, prob, logit, loss or kl, or method: patch")  # fmt: skip
        check_forward_rows(2 * min(batch_size or n, n), *_row_values(model, data), "study.method")  # and a backward
        derived = derive(model, spec, grid_cells, seed, strict, safe)  # one plan per selection, not per cell
        check_gradients(derived.modules, method)
        run = Run(
            model,
            derived.plans,
            bound,
            data,
            src,
            labels,
            batch_size or n,
            1,
            None,
            Attribution(derived.sites, EditedCells(derived.edits), steps if method == "integrated_gradients" else None),
        )
    if scale is not None:
        run.baseline_plans = {label(end): compile_plan(model, {a: spec[a] for a in end}, seed=seed, strict=strict,
                                                       safe=safe) for end in scale.baselines()}  # fmt: skip
    progress = progress or Progress.fresh([m.name for m in bound], run.cells, n)
    rank, world = ranks or (0, 1)
    for number, group in enumerate(run.groups if world > 1 else []):
        if number % world != rank:  # another rank's cells: scored there, gathered below
            progress.done[group] = True
    planned = time.perf_counter()
    run.score(progress)
    values = _gathered(progress.values, run.groups, rank, world) if world > 1 else progress.values
    baselines = {"unmodified": run.base, **({"source": run.src_base} if src is not None else {}), **run.named}
    result = _result(parsed, grid_cells, bound, values, baselines, scale, ci, n_boot, seed, tokenizer, ids)
    if verify_top is not None:
        result.verify = verified(run, result, verify_top, grid_cells)
    result.seconds = {"plan": planned - started, "run": time.perf_counter() - planned}
    return result


def _row_values(model: nn.Module, data: Inputs) -> tuple[int, int]:
    """About how many values one row makes in a forward (its input's size × the model's widest dimension: an LM's
    logits), and their bytes each; read from shapes, nothing run."""
    first = (*data.args, *data.kwargs.values())[0]
    per_row = first[0].numel() if first.dim() else 1
    widest, itemsize = 1, 4
    for p in model.parameters():
        widest = max(widest, *p.shape) if p.dim() else widest
        itemsize = p.element_size() if p.is_floating_point() else itemsize
    return per_row * widest, itemsize


def _gathered(
    values: dict[str, torch.Tensor], groups: list[list[int]], rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Every rank's cells in every rank's values (each cell scored by exactly one rank: the others add 0)."""
    import torch.distributed as dist

    mine = torch.zeros(sum(len(g) for g in groups), dtype=torch.bool)
    for number, group in enumerate(groups):
        mine[group] = number % world == rank
    out = {}
    for name, v in values.items():
        share = torch.where(mine[:, None], v, torch.zeros_like(v))
        dist.all_reduce(share)
        out[name] = share
    return out


def _why_not_rowwise(spec: dict[str, Any], grid_cells: list[dict[str, Any]], sourced: bool) -> str | None:
    """Why the cells cannot share forwards by rows (``batch_cells``), or None."""
    return next((w for cell in grid_cells if (w := why_not_rowwise(fill(spec, cell), sourced)) is not None), None)


def _result(
    grid: dict[str, list], grid_cells: list[dict[str, Any]], bound: list[PerExample], values: dict[str, torch.Tensor],
    baselines: dict[str, dict[str, torch.Tensor]], scale: Normalization | None, ci: float | None,
    n_boot: int, seed: int, tokenizer: Any, ids: torch.Tensor | None,
) -> StudyResult:  # fmt: skip
    sizes = [len(v) for v in grid.values()]
    normalization = None
    if scale is not None:
        first = bound[0].name
        zero, one = baselines[label(scale.zero)][first], baselines[label(scale.one)][first]
        values[first], flat = normalized(values[first], zero, one, scale.over, first)
        normalization = {**scale.describe(), "metric": first, "zero_denominators": flat}
    shaped = {name: v.reshape(*sizes, v.shape[-1]) for name, v in values.items()}
    low, high = {}, {}
    if ci is not None:
        for name, v in shaped.items():
            low[name], high[name] = bootstrap(v, ci, n_boot, seed)
    tokens = _position_labels(tokenizer, ids)
    return StudyResult(
        grid=grid, cells=grid_cells, values=shaped, mean={k: mean(v) for k, v in shaped.items()}, ci_low=low,
        ci_high=high, ci=ci, normalized=bound[0].name if scale else None, baselines=baselines, tokens=tokens,
        normalization=normalization,
    )  # fmt: skip


def _position_labels(tokenizer: Any, ids: torch.Tensor | None) -> list[str] | None:
    """The first example's tokens as text, to label positions in plots."""
    if tokenizer is None or ids is None:
        return None
    return [str(tokenizer.decode([int(t)])) for t in ids[0]]
