"""Run a study: every cell planned and checked first, then per input batch one unmodified forward, one
shared source pass, and one forward per cell with its plan (compiled once) applied.

The source pass is shared by all cells when it does not depend on the cell: every action that
could change it is an observer, reads ``from: {capture}`` (a no-op in a source pass) or has
``passes: main``. Then one surgery holding every cell's captures records the source once, and each
cell's patch reads its module's frozen calls from there. Otherwise each cell runs its own source pass.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import Plan, compile_plan, load_actions
from surgery.core.engine import Surgery, apply_plan
from surgery.core.probe import check_before_apply
from surgery.errors import ConfigError, SurgeryError
from surgery.lm.text import IGNORE
from surgery.study.grid import cells, check_uses, fill, parse_grid
from surgery.study.metrics import PerExample, parse_metrics
from surgery.study.result import StudyResult
from surgery.study.resume import Progress
from surgery.study.rows import cells_per_forward, interleave, restricted, why_not_rowwise
from surgery.study.stats import N_BOOT, bootstrap, mean, normalized

_GLOB_CHARACTERS = set("*?[]")


@dataclass
class Inputs:
    """A study's inputs: positional tensors or keyword tensors, all with examples along dim 0."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]

    @classmethod
    def of(cls, given: Any, where: str) -> Inputs:
        """A tensor (token ids or any input) or a dict of keyword tensors."""
        if isinstance(given, torch.Tensor):
            return cls((given,), {})
        if isinstance(given, Mapping) and given and all(isinstance(v, torch.Tensor) for v in given.values()):
            return cls((), {str(k): v for k, v in given.items()})
        raise ConfigError(f"{where}: a tensor (e.g. token ids [examples, positions]) or a dict of tensors")

    @property
    def examples(self) -> int:
        """How many examples (the size of dim 0)."""
        first = (*self.args, *self.kwargs.values())[0]
        return int(first.shape[0]) if first.dim() else 1

    def rows(self, start: int, stop: int) -> Inputs:
        """Examples ``start:stop``; a one-example input serves every row range."""
        if self.examples == 1:
            return self
        return Inputs(tuple(t[start:stop] for t in self.args), {k: v[start:stop] for k, v in self.kwargs.items()})

    def repeated(self, n: int) -> Inputs:
        """A one-example input as ``n`` copies of it."""
        return Inputs(tuple(t.expand(n, *t.shape[1:]) for t in self.args),
                      {k: v.expand(n, *v.shape[1:]) for k, v in self.kwargs.items()})  # fmt: skip

    def interleaved(self, k: int) -> Inputs:
        """Each example repeated ``k`` times in a row: cell ``j`` of a shared forward owns rows ``j::k``."""
        return Inputs(interleave(self.args, k), dict(zip(self.kwargs, interleave(tuple(self.kwargs.values()), k),
                                                         strict=True)))  # fmt: skip

    def run(self, model: nn.Module) -> Any:
        """The model's output on these inputs."""
        return model(*self.args, **self.kwargs)

    def token_ids(self) -> torch.Tensor | None:
        """The token ids, when these inputs are token ids (an integer tensor ``[examples, positions]``)."""
        ids = self.kwargs.get("input_ids", self.args[0] if self.args else None)
        if ids is None or ids.dim() != 2 or ids.is_floating_point():
            return None
        return ids

    def text_labels(self) -> torch.Tensor | None:
        """Token ids with -100 at padding (``attention_mask`` 0): what text metrics score against."""
        ids = self.token_ids()
        if ids is None:
            return None
        mask = self.kwargs.get("attention_mask")
        return ids if mask is None else ids.masked_fill(mask == 0, IGNORE)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: the tensor itself, ``.logits``, or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, Mapping):
        found = output.get("logits")
    if found is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        found = output[0]
    if not isinstance(found, torch.Tensor):
        raise ConfigError(f"study: the model's output ({type(output).__name__}) holds no logits tensor to score")
    return found


METHODS = ("patch",)


def check_method(method: str, steps: int | None, verify_top: int | None) -> None:
    """Only exact patching is built so far; the attribution methods of SPEC §14 are refused, not approximated."""
    if method != "patch":
        raise ConfigError(f"study.method: {method!r} is not available yet (attribution is issue 27); use method: patch")
    if steps is not None or verify_top is not None:
        key = "steps" if steps is not None else "verify_top"
        raise ConfigError(f"study.{key}: only for method: attribution or integrated_gradients; drop it for patch")


def _cell_text(cell: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in cell.items()) + "}"


def plan_cells(
    model: nn.Module,
    actions: dict[str, Any],
    grid_cells: list[dict[str, Any]],
    seed: int,
    strict: bool,
    safe: bool,
    k: int = 1,
) -> tuple[list[dict[str, Any]], list[Plan]]:
    """Every cell's actions (placeholders filled; with ``k`` cells a forward, cut to its rows) and plan, compiled once.

    A cell that fails is named.
    """
    filled, plans = [], []
    for i, cell in enumerate(grid_cells):
        node = fill(actions, cell)
        node = node if k == 1 else restricted(node, i % k, k)
        try:
            plans.append(compile_plan(model, node, seed=seed, strict=strict, safe=safe))
        except SurgeryError as e:
            raise type(e)(f"study cell {_cell_text(cell)}: {e}") from None
        filled.append(node)
    return filled, plans


def probe_cells(model: nn.Module, plans: list[Plan], grid_cells: list[dict[str, Any]], inputs: Inputs) -> None:
    """Check every cell's shapes in one probe forward of the unmodified model; on failure, name the cell."""
    try:
        check_before_apply(model, [s for p in plans for s in p.steps], inputs.args, 1, inputs.kwargs)
    except SurgeryError:
        for plan, cell in zip(plans, grid_cells, strict=True):
            try:
                check_before_apply(model, plan.steps, inputs.args, 1, inputs.kwargs)
            except SurgeryError as e:
                raise type(e)(f"study cell {_cell_text(cell)}: {e}") from None
        raise


def _changes_source(plan: Plan) -> bool:
    """Whether a step of ``plan`` could change the source pass's forward (then it cannot be shared)."""
    for step in plan.steps:
        if not step.enabled or step.traits.observes or getattr(step.config, "passes", "both") == "main":
            continue
        source = getattr(step.config, "from_", None)
        if isinstance(source, Mapping) and "capture" in source:
            continue  # a patch reading a capture changes nothing in a source pass
        return True
    return False


def shared_captures(
    filled: list[dict[str, Any]], plans: list[Plan]
) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
    """One actions dict capturing, for every cell, what its captures record; and each cell's name → union name.

    None when the source pass cannot be shared (a step changes it, or a module name is not a plain glob).
    """
    if any(_changes_source(p) for p in plans):
        return None
    union: dict[str, Any] = {}
    groups: dict[tuple[str, str], str] = {}
    names: list[dict[str, str]] = []
    for actions, plan in zip(filled, plans, strict=True):
        mapping = {}
        for step in plan.steps:
            if not step.enabled or step.kind != "capture":
                continue
            modules = [t.name for t in step.targets]
            if any(set(m) & _GLOB_CHARACTERS for m in modules):
                return None
            node = {k: v for k, v in actions[step.name].items() if k not in ("select", "type", "exclude")}
            key = (step.name, json.dumps(node, sort_keys=True, default=str))
            if key not in groups:
                groups[key] = step.name if step.name not in union else f"{step.name}~{len(groups)}"
                union[groups[key]] = {**node, "select": [], "allow_empty": False}
            chosen = union[groups[key]]["select"]
            chosen.extend(m for m in modules if m not in chosen)
            mapping[step.name] = groups[key]
        names.append(mapping)
    return union, names


def _inject(surgery: Surgery, source: Surgery, mapping: dict[str, str]) -> None:
    """Give each capture record of ``surgery`` the calls the shared source pass froze for its module."""
    for name, union_name in mapping.items():
        for module, record in surgery.captures.get(name, {}).items():
            record.sources = list(source.captures[union_name][module].sources or [])


def run_study(
    model: nn.Module,
    actions: Any,
    grid: Mapping[str, Any],
    inputs: Any,
    metrics: Any,
    *,
    source: Any = None,
    labels: torch.Tensor | None = None,
    normalize: bool = False,
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
) -> StudyResult:
    """Every cell of ``grid`` applied to ``model`` and scored per example by ``metrics`` (see :func:`surgery.study`)."""
    data = Inputs.of(inputs, "inputs")
    src = Inputs.of(source, "source") if source is not None else None
    if src is not None and src.examples not in (1, data.examples):
        raise ConfigError(f"source: {src.examples} examples; give one, or as many as inputs ({data.examples})")
    ids = data.token_ids()
    spec = load_actions(actions)
    parsed = parse_grid(grid, positions=int(ids.shape[1]) if ids is not None else None)
    check_uses(parsed, spec)
    bound = parse_metrics(metrics, tokenizer)
    if normalize and src is None:
        raise ConfigError("study.normalize: compares each cell with the source run; give a source input")
    if labels is None:
        labels = data.text_labels()
    grid_cells = cells(parsed)
    n = data.examples
    step = batch_size or n
    if src is not None and src.examples != n:
        src = src.repeated(n)  # one source example serves every row: the same rows as the inputs
    k = _cells_per_forward(spec, grid_cells, batch_cells, step, src is not None)
    filled, plans = plan_cells(model, spec, grid_cells, seed, strict, safe, k)
    first = data.rows(0, 1)
    probe_cells(model, plans, grid_cells, first if k == 1 else first.interleaved(k))
    sharing = shared_captures(filled, plans) if src is not None else None
    progress = progress or Progress.fresh([m.name for m in bound], len(plans), n)
    values = progress.values
    base = {m.name: torch.full((n,), torch.nan, dtype=torch.float64) for m in bound}
    src_base = {m.name: torch.full((n,), torch.nan, dtype=torch.float64) for m in bound}
    groups = [list(range(g, min(g + k, len(plans)))) for g in range(0, len(plans), k)]
    rank, world = ranks or (0, 1)
    for number, group in enumerate(groups):
        if number % world != rank:  # another rank's cells: scored there, gathered below
            progress.done[group] = True
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        batch, y = data.rows(rows.start, rows.stop), None if labels is None else labels[rows]
        clean = src.rows(rows.start, rows.stop) if src is not None else None
        with torch.no_grad():
            reference = logits_of(batch.run(model))
            _score(bound, base, rows, reference, y, reference)
            if clean is not None:
                _score(bound, src_base, rows, logits_of(clean.run(model)), y, reference)
            replicated = batch if k == 1 else batch.interleaved(k)
            shared = None
            if sharing is not None and clean is not None:
                shared = _shared_source(model, sharing, clean if k == 1 else clean.interleaved(k))
            try:
                for group in groups:
                    if not progress.pending(group, rows):  # scored before an interruption (resume)
                        continue
                    logits = _run_group(model, [plans[i] for i in group], replicated, shared,
                                        [sharing[1][i] for i in group] if sharing else None, clean)  # fmt: skip
                    for j, i in enumerate(group):
                        for metric in bound:
                            values[metric.name][i, rows] = metric(logits[j::k], y, reference)
                    progress.finished(group, rows)
            except BaseException:  # Ctrl-C or a failure: keep what finished for a rerun to resume from
                if progress.done.any():
                    progress.save()
                raise
            finally:
                if shared is not None:
                    shared.remove()
    if world > 1:
        values = _gathered(values, groups, rank, world)
    return _result(parsed, grid_cells, bound, values, base, src_base if src is not None else None, normalize, ci,
                   n_boot, seed, tokenizer, ids)  # fmt: skip


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


def _cells_per_forward(
    spec: dict[str, Any], grid_cells: list[dict[str, Any]], wanted: Any, rows: int, sourced: bool
) -> int:
    """How many cells share one forward (``batch_cells``): more than one only where every cell acts per row."""
    why = next((w for cell in grid_cells if (w := why_not_rowwise(fill(spec, cell), sourced)) is not None), None)
    return cells_per_forward(wanted, len(grid_cells), rows, why)


def _run_group(
    model: nn.Module, plans: list[Plan], batch: Inputs, shared: Surgery | None, names: list[dict[str, str]] | None,
    source: Inputs | None,
) -> torch.Tensor:  # fmt: skip
    """One forward with every plan of the group applied (each cut to its own rows when there are several)."""
    applied: list[Surgery] = []
    try:
        for j, plan in enumerate(plans):
            surgery = apply_plan(model, plan)
            applied.append(surgery)
            if shared is not None and names is not None:
                _inject(surgery, shared, names[j])
            elif source is not None:  # the source pass depends on the cell: this cell runs its own
                with surgery.source_pass():
                    source.run(model)
        return logits_of(batch.run(model))
    finally:
        for surgery in reversed(applied):
            surgery.remove()


def _shared_source(model: nn.Module, sharing: tuple[dict[str, Any], Any], source: Inputs) -> Surgery | None:
    """The one source pass every cell reads: a surgery holding every cell's captures, run on ``source``."""
    union = sharing[0]
    if not union:
        return None
    surgery = apply_plan(model, union)
    try:
        with surgery.source_pass():
            source.run(model)
    except BaseException:
        surgery.remove()
        raise
    return surgery


def _score(
    bound: list[PerExample], into: dict[str, torch.Tensor], rows: slice, logits: torch.Tensor,
    labels: torch.Tensor | None, reference: torch.Tensor,
) -> None:  # fmt: skip
    for metric in bound:
        into[metric.name][rows] = metric(logits, labels, reference)


def _result(
    grid: dict[str, list], grid_cells: list[dict[str, Any]], bound: list[PerExample], values: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor], src_base: dict[str, torch.Tensor] | None, normalize: bool, ci: float | None,
    n_boot: int, seed: int, tokenizer: Any, ids: torch.Tensor | None,
) -> StudyResult:  # fmt: skip
    sizes = [len(v) for v in grid.values()]
    if normalize and src_base is not None:
        first = bound[0].name
        values[first] = normalized(values[first], base[first], src_base[first])
    shaped = {name: v.reshape(*sizes, v.shape[-1]) for name, v in values.items()}
    low, high = {}, {}
    if ci is not None:
        for name, v in shaped.items():
            low[name], high[name] = bootstrap(v, ci, n_boot, seed)
    baselines = {"unmodified": base, **({"source": src_base} if src_base is not None else {})}
    tokens = _position_labels(tokenizer, ids)
    return StudyResult(
        grid=grid, cells=grid_cells, values=shaped, mean={k: mean(v) for k, v in shaped.items()}, ci_low=low,
        ci_high=high, ci=ci, normalized=bound[0].name if normalize else None, baselines=baselines, tokens=tokens,
    )  # fmt: skip


def _position_labels(tokenizer: Any, ids: torch.Tensor | None) -> list[str] | None:
    """The first example's tokens as text, to label positions in plots."""
    if tokenizer is None or ids is None:
        return None
    return [str(tokenizer.decode([int(t)])) for t in ids[0]]
