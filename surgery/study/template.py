"""An estimated study's cells derived from its template: one plan per distinct selection, not one per cell.

A patching grid's cells usually differ in which module they change (``select: transformer.h.{layer}``)
and in which part of it (``index: "[:, {pos}]"``, ``value: "{coef}"``). Attribution reads only each
cell's edits, so the cells are grouped by everything except their ``index`` and ``value``: each group's
first cell is compiled with every check of ``compile_plan``, and the group's other cells take its plan
with their own index (parsed once per distinct text) and value (a number where the first cell's is one:
the schema's checks read either only for being given, and attribution edits only set, patch, add, mul
and zero). An index whose shape does not fit is reported by the attribution's own forward
(``estimates.checked_estimate``), naming the cell, instead of by a probe forward.

A grid where ``index`` or ``value`` is also rewritten by a site (``@heads`` with ``head:``) or is not a
plain text/number in some cell has that cell compiled on its own: the same edits, the slower way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from surgery.core.compiler import Plan, Shared, compile_plan
from surgery.errors import ConfigError
from surgery.expr.parsing import compile_index
from surgery.study.edits import Edit, Key, Site, edits_of, sites_of
from surgery.study.grid import fill, filler, naming, placeholders

FREE = ("index", "value")  # an action's fields a cell may change without a plan of its own


@dataclasses.dataclass
class Derived:
    """Every cell's edits and the sites they read, and each cell's full plan on demand (``plans``)."""

    sites: dict[Key, Site]
    edits: list[list[Edit]]
    plans: CellPlans
    modules: list[nn.Module]  # every module of the model, walked once


class CellPlans(Sequence[Plan]):
    """Each cell's plan, compiled when first read (``verify_top`` runs a few cells exactly)."""

    def __init__(self, model: nn.Module, spec: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
                 shared: Shared, known: dict[int, Plan]) -> None:  # fmt: skip
        self._model, self._spec, self._cells, self._options, self._shared = model, spec, cells, options, shared
        self._known = known

    def __len__(self) -> int:
        return len(self._cells)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i not in self._known:
            self._known[i] = compiled(self._model, self._spec, self._cells[i], self._options, self._shared)
        return self._known[i]

    def __iter__(self) -> Iterator[Plan]:
        return (self[i] for i in range(len(self)))


def compiled(model: nn.Module, spec: dict[str, Any], cell: dict[str, Any], options: dict[str, Any],
             shared: Shared) -> Plan:  # fmt: skip
    """One cell's plan (placeholders filled), a failure naming the cell."""
    with naming(cell):
        return compile_plan(model, fill(spec, cell), shared=shared, **options)


def derive(model: nn.Module, spec: dict[str, Any], cells: list[dict[str, Any]], seed: int, strict: bool,
           safe: bool) -> Derived:  # fmt: skip
    """Each cell's edits from one plan per group of cells that differ only in ``index`` and ``value``."""
    options = {"seed": seed, "strict": strict, "safe": safe}
    shared, known = Shared(), dict[int, Plan]()
    free, axes, free_axes = _free_fields(spec)
    groups: dict[tuple[Any, ...], list[Edit]] = {}  # the structural values of a group -> its first cell's edits
    changes: dict[tuple[Any, ...], Changes | None] = {}  # the free fields' values -> each action's new fields
    edits: list[list[Edit]] = []
    for i, cell in enumerate(cells):
        key = tuple(cell[a] for a in axes)
        first = groups.get(key)
        if first is not None:
            values = tuple(cell[a] for a in free_axes)
            if values not in changes:
                changes[values] = _changes(free, cell)
            changed = changes[values]
            if changed is not None:
                edits.append([e._replace(cell=cell, **changed.get(e.action, {})) for e in first])
                continue
        known[i] = compiled(model, spec, cell, options, shared)
        edits.append(edits_of(known[i], cell))
        if first is None and _free_kept(known[i], free, cell):
            groups[key] = edits[-1]
    sites = sites_of(list(known.values()))
    return Derived(sites, edits, CellPlans(model, spec, cells, options, shared, known), shared.index_of(model).modules)


Fillers = dict[str, dict[str, Callable[[dict[str, Any]], Any]]]  # per action, its free fields' fillers
Changes = dict[str, dict[str, Any]]  # per action, the Edit fields a cell's free values set


def _free_fields(spec: dict[str, Any]) -> tuple[Fillers, list[str], list[str]]:
    """Per action, its FREE fields holding placeholders (each with its filler); the variables anything else
    names (the groups'); and the variables the free fields name."""
    free: Fillers = {}
    axes: dict[str, None] = {}
    free_axes: dict[str, None] = {}
    for name, node in spec.items():
        if not isinstance(node, Mapping):
            axes.update(dict.fromkeys(placeholders(node)))
            continue
        for field, value in node.items():
            used = placeholders(value)
            if field in FREE and isinstance(value, str) and used:
                free.setdefault(str(name), {})[str(field)] = filler(value)
                free_axes.update(dict.fromkeys(used))
            else:
                axes.update(dict.fromkeys(used))
    return free, list(axes), list(free_axes)


def _free_kept(plan: Plan, free: Fillers, cell: dict[str, Any]) -> bool:
    """Whether the plan's actions hold each free field as the cell gave it (no site rewrote it), so others may too."""
    specs = plan.specs or {}
    steps = {s.name: s for s in plan.steps}
    for name, fields in free.items():
        node = specs.get(name)
        step = steps.get(name)
        if not isinstance(node, Mapping) or step is None or not step.enabled:
            return False
        for field, fills in fields.items():
            given = fills(cell)
            if node.get(field) != given or not _plain(field, given):
                return False
    return True


def _plain(field: str, value: Any) -> bool:
    """An index as text, a value as a number: what a cell may change without being compiled itself."""
    if field == "index":
        return isinstance(value, str)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _changes(free: Fillers, cell: dict[str, Any]) -> Changes | None:
    """Each action's Edit fields for this cell's index and value (shared by the cells giving the same free values);
    None: compile the cell on its own.

    The schema's checks read index and value only for being given, and this cell gives them as its group's first
    did (a text, a number); the index is parsed and must keep every example, as edits_of asks.
    """
    changes: Changes = {}
    for name, fields in free.items():
        given = {field: fills(cell) for field, fills in fields.items()}
        if not all(_plain(f, v) for f, v in given.items()):
            return None
        if "value" in given:
            given["value"] = float(given["value"])
        if "index" in given:
            text = given["index_text"] = given.pop("index")
            try:
                given["cut"] = cut = compile_index(text, "index")
            except ConfigError:
                return None  # compiled on its own: its message names the cell and the key
            if cut and cut[0] != slice(None) and cut[0] is not Ellipsis:
                return None
        changes[name] = given
    return changes


class Template:
    """A patching study's cells as edits of a few compiled plans, derived when asked: memory flat in the cells.

    Every cell is checked when this is built (as ``derive`` does: the first cell of each group compiled, each
    other cell's index parsed) and nothing is kept per cell but what :meth:`edits` works out again; a cell that
    must be compiled on its own (its group's first cell had a free field rewritten) keeps its plan.
    """

    def __init__(self, model: nn.Module, spec: dict[str, Any], cells: list[dict[str, Any]], seed: int, strict: bool,
                 safe: bool, shared: Shared, allowed: Callable[[Plan], str | None]) -> None:  # fmt: skip
        self.cells = cells
        self.why_not: str | None = None  # why these cells cannot run as edits (``allowed`` said so of a plan)
        self._options = {"seed": seed, "strict": strict, "safe": safe}
        self._model, self._spec, self._shared = model, spec, shared
        self._free, self._axes, self._free_axes = _free_fields(spec)
        self.plans: dict[tuple[Any, ...], Plan] = {}  # each group's first cell's plan
        self._firsts: dict[tuple[Any, ...], list[Edit]] = {}  # its edits, for the group's other cells
        self.own: dict[int, Plan] = {}  # cells compiled on their own
        for i, cell in enumerate(cells):
            key = tuple(cell[a] for a in self._axes)
            if key in self._firsts and _changes(self._free, cell) is not None:
                continue  # derived from its group's first cell: nothing kept
            plan = compiled(model, spec, cell, self._options, shared)
            self.why_not = allowed(plan)
            if self.why_not is not None:
                return
            if key not in self.plans and _free_kept(plan, self._free, cell):
                self.plans[key], self._firsts[key] = plan, edits_of(plan, cell)
            else:
                self.own[i] = plan

    def edits(self, i: int) -> list[Edit]:
        """Cell ``i``'s edits (worked out again each time: only a group's first cell's are kept)."""
        cell = self.cells[i]
        if i in self.own:
            return edits_of(self.own[i], cell)
        first = self._firsts[tuple(cell[a] for a in self._axes)]
        changed = _changes(self._free, cell)
        assert changed is not None  # checked when built
        return [e._replace(cell=cell, **changed.get(e.action, {})) for e in first]

    def first_edits(self) -> list[list[Edit]]:
        """The edits kept: each group's first cell's, and each cell compiled on its own's."""
        return [*self._firsts.values(), *(edits_of(plan, self.cells[i]) for i, plan in self.own.items())]

    def every_plan(self) -> list[Plan]:
        """The plans kept: each group's first cell's and the cells compiled on their own."""
        return [*self.plans.values(), *self.own.values()]
