"""An estimated study's cells derived from its template: one plan per distinct selection, not one per cell.

A patching grid's cells usually differ in which module they change (``select: transformer.h.{layer}``)
and in which part of it (``index: "[:, {pos}]"``, ``value: "{coef}"``). Attribution reads only each
cell's edits, so the cells are grouped by everything except their ``index`` and ``value``: each group's
first cell is compiled with every check of ``compile_plan``, and the group's other cells take its plan
with their own index (parsed once per distinct text) and value (a number where the first cell's is one:
the schema's checks read either only for being given, and attribution edits only set, patch, add, mul
and zero). An index whose shape does not fit is reported by the attribution's own forward
(``attribution.checked_estimate``), naming the cell, instead of by a probe forward.

A grid where ``index`` or ``value`` is also rewritten by a site (``@heads`` with ``head:``) or is not a
plain text/number in some cell has that cell compiled on its own: the same edits, the slower way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from surgery.core.compiler import Plan, Shared, compile_plan
from surgery.errors import ConfigError, SurgeryError
from surgery.expr.parsing import compile_index
from surgery.study.attribution import Edit, Key, Site, edits_of, sites_of
from surgery.study.grid import fill, filler, placeholders

FREE = ("index", "value")  # an action's fields a cell may change without a plan of its own


@dataclasses.dataclass
class Derived:
    """Every cell's edits and the sites they read, and each cell's full plan on demand (``plans``)."""

    sites: dict[Key, Site]
    edits: list[list[Edit]]
    plans: CellPlans


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
    try:
        return compile_plan(model, fill(spec, cell), shared=shared, **options)
    except SurgeryError as e:
        raise type(e)(f"study cell {cell_text(cell)}: {e}") from None


def cell_text(cell: Mapping[str, Any]) -> str:
    """A cell as its errors and reports name it: ``{layer: 0, pos: 3}``."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in cell.items()) + "}"


def derive(model: nn.Module, spec: dict[str, Any], cells: list[dict[str, Any]], seed: int, strict: bool,
           safe: bool) -> Derived:  # fmt: skip
    """Each cell's edits from one plan per group of cells that differ only in ``index`` and ``value``."""
    options = {"seed": seed, "strict": strict, "safe": safe}
    shared, known = Shared(), dict[int, Plan]()
    free, axes = _free_fields(spec)
    groups: dict[tuple[Any, ...], list[Edit]] = {}  # the structural values of a group -> its first cell's edits
    edits: list[list[Edit]] = []
    for i, cell in enumerate(cells):
        key, where = tuple(cell[a] for a in axes), f"study cell {cell_text(cell)}"
        first = groups.get(key)
        if first is not None:
            derived = _derived(first, free, cell, where)
            if derived is not None:
                edits.append(derived)
                continue
        known[i] = compiled(model, spec, cell, options, shared)
        edits.append(edits_of(known[i], where))
        if first is None and _free_kept(known[i], free, cell):
            groups[key] = edits[-1]
    sites = sites_of(list(known.values()))
    return Derived(sites, edits, CellPlans(model, spec, cells, options, shared, known))


def _free_fields(spec: dict[str, Any]) -> tuple[dict[str, dict[str, Callable[[dict[str, Any]], Any]]], list[str]]:
    """Per action, its FREE fields holding placeholders (each with its filler); and the variables anything else
    names (the groups')."""
    free: dict[str, dict[str, Callable[[dict[str, Any]], Any]]] = {}
    axes: dict[str, None] = {}
    for name, node in spec.items():
        if not isinstance(node, Mapping):
            axes.update(dict.fromkeys(placeholders(node)))
            continue
        for field, value in node.items():
            used = placeholders(value)
            if field in FREE and isinstance(value, str) and used:
                free.setdefault(str(name), {})[str(field)] = filler(value)
            else:
                axes.update(dict.fromkeys(used))
    return free, list(axes)


def _free_kept(
    plan: Plan, free: dict[str, dict[str, Callable[[dict[str, Any]], Any]]], cell: dict[str, Any]
) -> bool:  # fmt: skip
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


def _derived(
    first: list[Edit], free: dict[str, dict[str, Callable[[dict[str, Any]], Any]]], cell: dict[str, Any], where: str
) -> list[Edit] | None:  # fmt: skip
    """The group's first cell's edits with this cell's index and value; None: compile the cell on its own.

    The schema's checks read index and value only for being given, and this cell gives them as the first
    did (a text, a number); the index is parsed (once per text) and must keep every example, as edits_of asks.
    """
    changes: dict[str, dict[str, Any]] = {}
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
    return [e._replace(where=f"{where}: actions.{e.action}", **changes.get(e.action, {})) for e in first]
