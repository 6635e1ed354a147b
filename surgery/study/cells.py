"""Scoring a study's cells batch by batch: the baselines once per batch, then every cell (or its estimate).

Per input batch: the unmodified run (and the source run) once, scored per example; the shared
source pass once; then each group of cells that shares a forward, each cell's plan applied
(compiled once, cut to its rows when several share), the output scored per example. With an
attribution method the cells are estimated instead, from one forward and backward per metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import Plan
from surgery.core.engine import Surgery, apply_plan
from surgery.core.records import Call
from surgery.study.attribution import attribute_batch
from surgery.study.direct import Direct
from surgery.study.edits import Key, Site
from surgery.study.estimates import EditedCells
from surgery.study.inputs import Inputs, logits_of
from surgery.study.metrics import PerExample
from surgery.study.resume import Progress
from surgery.study.sources import inject, shared_source_pass


@dataclass
class Attribution:
    """What an attribution method needs: the sites, each cell's edits, and the steps of integrated gradients."""

    sites: dict[Key, Site]
    cells: EditedCells
    steps: int | None


@dataclass
class Run:
    """One study's cells over its inputs; ``score`` fills a Progress and the baselines."""

    model: nn.Module
    plans: Sequence[Plan]  # a study by attribution compiles a cell's plan only when it runs exactly (verify_top)
    bound: list[PerExample]
    data: Inputs
    source: Inputs | None
    labels: torch.Tensor | None
    batch_size: int
    k: int  # cells per forward
    sharing: tuple[dict[str, Any], list[dict[str, str]]] | None
    attribution: Attribution | None = None
    direct: Direct | None = None  # the cells run as edits at sites (no plan per cell): surgery/study/direct.py
    base: dict[str, torch.Tensor] = field(default_factory=dict)
    src_base: dict[str, torch.Tensor] = field(default_factory=dict)
    baseline_plans: dict[str, Plan] = field(default_factory=dict)  # study.normalize's action lists, each alone
    named: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # their metric values per example

    @property
    def cells(self) -> int:
        """How many cells."""
        return len(self.plans) if self.direct is None else self.direct.cells

    @cached_property
    def groups(self) -> list[list[int]]:
        """The cells of each forward, in order."""
        n = self.cells
        return [list(range(g, min(g + self.k, n))) for g in range(0, n, self.k)]

    def score(self, progress: Progress) -> None:
        """Score every pending cell on every batch; on Ctrl-C or a failure, save what finished first."""
        n = self.data.examples
        for name in (m.name for m in self.bound):
            self.base.setdefault(name, torch.full((n,), torch.nan, dtype=torch.float64))
            self.src_base.setdefault(name, torch.full((n,), torch.nan, dtype=torch.float64))
            for label in self.baseline_plans:
                self.named.setdefault(label, {}).setdefault(name, torch.full((n,), torch.nan, dtype=torch.float64))
        try:
            for start in range(0, n, self.batch_size):
                self._batch(progress, slice(start, min(start + self.batch_size, n)))
        except BaseException:
            if progress.done.any():
                progress.save()
            raise

    def _batch(self, progress: Progress, rows: slice) -> None:
        batch, y = self.data.rows(rows.start, rows.stop), None if self.labels is None else self.labels[rows]
        clean = self.source.rows(rows.start, rows.stop) if self.source is not None else None
        pending = progress.pending_groups(self.groups, rows)  # resume: only what is left
        if self.baseline_plans:
            self._named_baselines(rows, batch, clean, y)
        if self.attribution is not None and pending:  # its own passes give the baselines too
            self._estimate(progress, rows, batch, clean, y, pending)
            return
        if self.direct is not None:
            self._direct(progress, rows, batch, clean, y, pending)
            return
        k = self.k
        with torch.no_grad():
            reference = logits_of(batch.run(self.model))
            _score(self.bound, self.base, rows, reference, y, reference)
            shared = None
            if self.sharing is not None and clean is not None and pending and self.attribution is None:
                shared = shared_source_pass(self.model, self.sharing, clean, k)
            if clean is not None:  # the shared pass's output is the clean run's: captures change nothing
                output = shared[1] if shared is not None else clean.run(self.model)
                _score(self.bound, self.src_base, rows, logits_of(output), y, reference)
        if not pending:
            return
        with torch.no_grad():
            replicated = batch if k == 1 else batch.interleaved(k)
            for group in pending:
                names = [self.sharing[1][i] for i in group] if self.sharing else None
                frozen = shared[0] if shared is not None else None
                logits = _run_group(self.model, [self.plans[i] for i in group], replicated, frozen, names, clean)
                for j, i in enumerate(group):
                    for metric in self.bound:
                        progress.values[metric.name][i, rows] = metric(logits[j::k], y, reference)
                progress.finished(group, rows)

    def _direct(
        self, progress: Progress, rows: slice, batch: Inputs, clean: Inputs | None, y: torch.Tensor | None,
        pending: list[list[int]],
    ) -> None:  # fmt: skip
        """The batch's baselines, then each group of cells as one forward with one hook per site edited."""
        assert self.direct is not None
        direct, k = self.direct, self.k
        with torch.no_grad():
            reference = logits_of(direct.check(self.model, partial(batch.run, self.model)))  # every cell checked
            _score(self.bound, self.base, rows, reference, y, reference)
            sources: dict[Key, list[torch.Tensor]] = {}
            own = clean is not None and direct.why_not_shared is not None  # each cell's source pass is its own
            if clean is not None:
                if own:
                    output = clean.run(self.model)
                else:
                    output, sources = direct.record(self.model, partial(clean.run, self.model), direct.source_keys)
                _score(self.bound, self.src_base, rows, logits_of(output), y, reference)
            replicated = partial((batch if k == 1 else batch.interleaved(k)).run, self.model)
            y_k = y if y is None or k == 1 else y.repeat_interleave(k, dim=0)  # each row's own, as its cell sees it
            reference_k = reference if k == 1 else reference.repeat_interleave(k, dim=0)
            for group in pending:
                if own:  # k is 1 then
                    assert clean is not None
                    sources = direct.run_source(self.model, group[0], partial(clean.run, self.model))
                logits = logits_of(direct.run(self.model, group, k, replicated, sources))
                cut = slice(group[0], group[-1] + 1)  # a group is a run of cells
                for metric in self.bound:  # one call per forward: every cell's rows at once, row r is cell r % k
                    values = metric(logits, y_k, reference_k).view(-1, k)[:, : len(group)]
                    progress.values[metric.name][cut, rows] = values.T
                progress.finished(group, rows)

    def _named_baselines(self, rows: slice, batch: Inputs, clean: Inputs | None, y: torch.Tensor | None) -> None:
        """Each baseline of study.normalize that is a list of actions: those actions alone, scored per example."""
        with torch.no_grad():
            reference = logits_of(batch.run(self.model))
            for label, plan in self.baseline_plans.items():
                logits = _run_group(self.model, [plan], batch, None, None, clean)  # a source pass as the cells get
                _score(self.bound, self.named[label], rows, logits, y, reference)

    def _estimate(
        self, progress: Progress, rows: slice, batch: Inputs, clean: Inputs | None, y: torch.Tensor | None,
        pending: list[list[int]],
    ) -> None:  # fmt: skip
        """Every cell's estimate on this batch: the unmodified value plus its attribution, per metric.

        The attribution's own forward of the unmodified model and of the source give both baselines, so
        the batch runs no separate baseline passes.
        """
        assert self.attribution is not None
        run_source = partial(clean.run, self.model) if clean is not None else None
        for n, metric in enumerate(self.bound):
            held: dict[str, Any] = {}
            estimates = attribute_batch(
                self.attribution.sites, self.attribution.cells, partial(batch.run, self.model), run_source,
                partial(_scored, metric, y, held), self.attribution.steps, held,
            )  # fmt: skip
            if n == 0:  # the metric differentiated is the pass's own value; the others scored on its output
                reference = held["reference"]
                for other in self.bound:
                    value = held["value"] if other is metric else other(reference, y, reference)
                    self.base[other.name][rows] = value
                if clean is not None:
                    _score(self.bound, self.src_base, rows, logits_of(held["source"]).detach(), y, reference)
            base = self.base[metric.name][rows]  # float64 on the host, whatever device the model is on
            progress.values[metric.name][:, rows] = base + estimates.detach().to(base.device, base.dtype)
        progress.finished([i for group in pending for i in group], rows)


def _scored(metric: PerExample, labels: torch.Tensor | None, held: dict[str, Any], output: Any) -> torch.Tensor:
    """The metric of ``output``; the first output scored is the unmodified run's, kept as the reference (and its
    value, the baseline)."""
    logits = logits_of(output)
    first = "reference" not in held
    if first:
        held["reference"] = logits.detach()
    value = metric(logits, labels, held["reference"])
    if first:
        held["value"] = value.detach()
    return value


def _run_group(
    model: nn.Module, plans: list[Plan], batch: Inputs, frozen: dict[tuple[str, str], list[Call]] | None,
    names: list[dict[str, str]] | None, source: Inputs | None,
) -> torch.Tensor:  # fmt: skip
    """One forward with every plan of the group applied (each cut to its own rows when there are several)."""
    applied: list[Surgery] = []
    try:
        for j, plan in enumerate(plans):
            surgery = apply_plan(model, plan)
            applied.append(surgery)
            if frozen is not None and names is not None:
                inject(surgery, frozen, names[j])
            elif source is not None:  # the source pass depends on the cell: this cell runs its own
                with surgery.source_pass():
                    source.run(model)
        return logits_of(batch.run(model))
    finally:
        for surgery in reversed(applied):
            surgery.remove()


def _score(
    bound: list[PerExample], into: dict[str, torch.Tensor], rows: slice, logits: torch.Tensor,
    labels: torch.Tensor | None, reference: torch.Tensor,
) -> None:  # fmt: skip
    for metric in bound:
        into[metric.name][rows] = metric(logits, labels, reference)
