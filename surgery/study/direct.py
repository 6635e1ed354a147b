"""A patching study's cells run as edits: one hook per site serving every cell of a forward, no plan applied per cell.

Where every cell's changes are ``set``/``patch``/``zero``/``add``/``mul`` ops of ``modify_input`` or
``modify_output`` (a number, or ``from: {capture}`` of the shared source pass) and its other actions are plain
captures feeding them, the cells need not be applied through the engine one by one: each forward registers one
hook per site it edits, which writes every cell's part of the tensor at once (cell ``j`` owns rows ``j::k``):
one gather from the source run and one scatter, by flat indices. The values written are those the engine's ops
write (a copy is a copy; ``add``/``mul`` compute in the tensor's own op precision), so the results are the same
bits as applying each cell's plan. Cells are templated (surgery/study/template.py): a few plans are compiled,
and each cell's edits are worked out when its forward runs, so memory stays flat in the number of cells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from surgery.actions.base import KeyedError, input_at, with_input
from surgery.actions.sources import onto
from surgery.core.compiler import Plan
from surgery.core.structure import get_item, replace_item
from surgery.errors import ConfigError
from surgery.expr.parsing import compile_index
from surgery.study.edits import Edit, Key, Site, sites_of
from surgery.study.grid import cell_text
from surgery.study.template import Template

OPS = ("set", "patch", "zero", "add", "mul")
_HALF = (torch.float16, torch.bfloat16)  # their ops compute in float32, as the engine's scalar ops do
ROW = 1 << 20  # values in one row at most for the vectorised write (its positions are an arange of one row)
Sources = dict[Key, list[torch.Tensor]]  # each source site's tensor per call of the source pass


def why_not_direct(plan: Plan, sourced: bool) -> str | None:
    """Why a cell's plan cannot run as edits at sites (then each cell applies its plan), or None when it can."""
    changes = 0
    for step in plan.steps:
        if not step.enabled:
            continue
        cfg, where = step.config, f"actions.{step.name}"
        if step.kind == "capture":
            plain = (cfg.reduce == "none" and cfg.function is None and cfg.fn is None and cfg.index is None
                     and cfg.item is None and cfg.heads is None and not cfg.stop and cfg.calls is None
                     and cfg.keep == "all" and not cfg.always and not cfg.clone)  # fmt: skip
            if not plain:
                return f"{where}: a capture that does more than record each call"
            continue
        if step.kind not in ("modify_input", "modify_output"):
            return f"{where} is a {step.kind}"
        source = cfg.from_
        by_capture = isinstance(source, Mapping) and "capture" in source
        if cfg.op not in OPS or cfg.function is not None or cfg.scale is not None or cfg.heads is not None:
            return f"{where}: op {cfg.op} (or its scale, heads or function)"
        if isinstance(cfg.value, torch.Tensor) or (source is not None and not by_capture):
            return f"{where}: a tensor or file source"
        if by_capture and (source.get("reduce", "none") != "none" or not sourced):
            return f"{where}.from: a reduced capture, or no source pass"
        if cfg.calls is not None or cfg.prepend or not isinstance(cfg.item, (int, str)):
            return f"{where}: calls, prepend or item"
        if not by_capture and getattr(cfg, "passes", "both") != "main" and sourced and _read_there(plan, step):
            return f"{where} changes an output a capture of the source pass records (the order of hooks decides)"
        index = compile_index(cfg.index, f"{where}.index") if cfg.index is not None else None
        if index and index[0] != slice(None) and index[0] is not Ellipsis:
            return f"{where}.index: its first subscript picks rows"
        changes += 1
    return None if changes else "no cell changes anything"


def _read_there(plan: Plan, changing: Any) -> bool:
    """Whether a capture that some patch reads records the output of a module ``changing`` (a step) changes."""
    read = {str(s.config.from_["capture"]) for s in plan.steps if isinstance(getattr(s.config, "from_", None), Mapping)
            and "capture" in s.config.from_}  # fmt: skip
    changed = {id(t.module) for t in changing.targets} if changing.kind == "modify_output" else set()
    return any(s.name in read and id(t.module) in changed for s in plan.steps for t in s.targets)


class Direct:
    """The cells of a templated study, run as edits; ``run`` scores one forward of a group of cells."""

    def __init__(self, template: Template, actions: list[str]) -> None:
        self.template = template
        self.order = {name: i for i, name in enumerate(actions)}
        self.sites: dict[Key, Site] = sites_of(template.every_plan())
        self.names = {id(t.module): t.name for p in template.every_plan() for s in p.steps for t in s.targets}
        self.source_keys = sorted({e.source for edits in template.first_edits() for e in edits if e.source is not None},
                                  key=str)  # fmt: skip
        self.checked = False
        changing = [e for edits in template.first_edits() for e in edits if e.source is None and e.passes != "main"]
        self.why_not_shared = (
            f"actions.{changing[0].action} changes the source pass too, so each cell runs its own (passes: main"
            " keeps it out)"
            if changing
            else None
        )  # with a source, each cell's own source pass then runs with its changes (run_source)

    @property
    def cells(self) -> int:
        """How many cells."""
        return len(self.template.cells)

    def record(self, model: nn.Module, run: Callable[[], Any], keys: list[Key]) -> tuple[Any, Sources]:
        """``run()``'s output and each site of ``keys`` as every call of it left the module (after its forward)."""
        found: Sources = {key: [] for key in keys}
        handles = []
        for key in keys:
            site = self.sites[key]

            def after(m: nn.Module, args: Any, kwargs: Any, output: Any, key: Key = key, site: Site = site) -> None:
                found[key].append(_value(site, args, kwargs, output))

            handles.append(site.module.register_forward_hook(after, with_kwargs=True))
        try:
            return run(), found
        finally:
            for handle in handles:
                handle.remove()

    def check(self, model: nn.Module, run: Callable[[], Any]) -> Any:
        """``run()``'s output, every cell's edits checked against the shapes its sites have in it (once)."""
        if self.checked:
            return run()
        output, seen = self.record(model, run, list(self.sites))
        self.checked = True
        fits: set[tuple[Key, str | None]] = set()  # an index text checked at a site fits it for every cell
        for i in range(self.cells):
            for edit in self.template.edits(i):
                calls = seen[edit.site]
                if calls and (edit.site, edit.index_text) not in fits:
                    _check_cut(edit, calls[0], self.names.get(edit.site[0], "the module"))
                    fits.add((edit.site, edit.index_text))
        return output

    def run(self, model: nn.Module, cells: list[int], k: int, run: Callable[[], Any], sources: Sources) -> Any:
        """One forward of ``run()`` with every cell of ``cells`` applied to its rows ``j::k``."""
        handles = self._hooks(cells, k, sources, in_source=False)
        try:
            return run()
        finally:
            for handle in handles:
                handle.remove()

    def run_source(self, model: nn.Module, cell: int, run: Callable[[], Any]) -> Sources:
        """Cell ``cell``'s own source pass (its edits that act there applied), every source site recorded."""
        handles = self._hooks([cell], 1, {}, in_source=True)
        try:
            return self.record(model, run, self.source_keys)[1]
        finally:
            for handle in handles:
                handle.remove()

    def _hooks(self, cells: list[int], k: int, sources: Sources, in_source: bool) -> list[Any]:
        """One hook per site the cells edit (in a source pass: only edits acting there); the handles."""
        rounds: dict[Key, dict[int, list[tuple[int, Edit]]]] = {}  # site -> action number -> (row, edit)
        for j, i in enumerate(cells):
            for edit in self.template.edits(i):
                if in_source and (edit.source is not None or edit.passes == "main"):
                    continue  # a patch changes nothing in a source pass; passes: main stays out of it
                rounds.setdefault(edit.site, {}).setdefault(self.order[edit.action], []).append((j, edit))
        calls: dict[Key, int] = {}
        handles = []
        for key, by_action in rounds.items():
            change = _changer([by_action[a] for a in sorted(by_action)], k, sources, calls, key)
            handles.append(_hook(self.sites[key], change))
        return handles


def _value(site: Site, args: Any, kwargs: Any, output: Any) -> torch.Tensor:
    """The site's tensor in one call: its input item, or its output item."""
    try:
        if site.what == "output":
            return output if type(output) is torch.Tensor else get_item(output, site.item)
        holder, at = input_at(args, kwargs, site.item, site.position)
        return holder[at]
    except (IndexError, KeyError, TypeError, KeyedError) as e:
        why = str(e) if isinstance(e, KeyedError) else e
        raise ConfigError(
            f"{site.where}.item: {site.item!r} does not fit the {site.what} of the module on this input: {why}"
        ) from None


def _check_cut(edit: Edit, value: Any, module: str) -> None:
    """The cell's index fits the site's tensor (a cell's rows of it): else a ConfigError naming the cell."""
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"study cell {_named(edit)}: actions.{edit.action}.index: the site holds a"
                          f" {type(value).__name__}, not a tensor")  # fmt: skip
    if edit.cut is None:
        return
    try:
        torch.zeros((), dtype=torch.uint8).expand(value.shape)[edit.cut]  # bounds checked, nothing the size allocated
    except (IndexError, TypeError, RuntimeError) as e:
        raise ConfigError(
            f"study cell {_named(edit)}: actions.{edit.action}.index: {edit.index_text} does not fit the"
            f" {edit.site[1]} of {module!r}, shape {list(value.shape)}: {e}"
        ) from None


def _named(edit: Edit) -> str:
    return edit.cell if isinstance(edit.cell, str) else cell_text(edit.cell)


def _hook(site: Site, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """One hook on the site's module putting ``change`` of its tensor in its place."""
    if site.what == "output":

        def after(m: nn.Module, args: Any, output: Any) -> Any:
            if type(output) is torch.Tensor:
                return change(output)
            return replace_item(output, site.item, change(get_item(output, site.item)))

        return site.module.register_forward_hook(after)

    def before(m: nn.Module, args: Any, kwargs: Any) -> Any:
        holder, at = input_at(args, kwargs, site.item, site.position)
        new = change(holder[at])
        return with_input(args, kwargs, at, new)

    return site.module.register_forward_pre_hook(before, with_kwargs=True)


def _changer(
    rounds: list[list[tuple[int, Edit]]], k: int, sources: Sources, calls: dict[Key, int], key: Key
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The change of a site's tensor in one call: each action's edits, in plan order, over every cell's rows."""

    def change(t: torch.Tensor) -> torch.Tensor:
        number = calls[key] = calls.get(key, 0) + 1  # this call's number in this forward, from 1
        out = t.clone()
        for edits in rounds:
            source_key = edits[0][1].source
            src = None
            if source_key is not None:
                found = sources.get(source_key) or []
                if not found:
                    raise ConfigError(f"actions.{edits[0][1].action}.from: the source pass made no call of the module")
                src = found[min(number, len(found)) - 1]
            by_op: dict[str, list[tuple[int, Edit]]] = {}  # cells of one forward may differ in op (a grid over ops)
            for pair in edits:
                by_op.setdefault(pair[1].op, []).append(pair)
            for same in by_op.values():  # each cell owns its rows: the order between ops changes nothing
                _write(out, same, k, src)
        return out

    return change


def _write(out: torch.Tensor, edits: list[tuple[int, Edit]], k: int, src: torch.Tensor | None) -> None:
    """One action's edits of every cell written into ``out`` (in place): one gather and one scatter.

    Cell ``j``'s part is its rows ``j::k`` cut by its index; its flat positions are worked out from one row's
    (an ``arange`` over one row, never the whole tensor), and the source's from the same, in its own rows.
    """
    op = edits[0][1].op
    rows = out.shape[0] // k if out.dim() else 0
    per_row = out[0].numel() if out.dim() else 0
    aligned = src is None or (src.dim() == out.dim() and src.shape[0] == rows and src.shape[1:] == out.shape[1:])
    simple = out.dim() and out.is_floating_point() and aligned and rows * k == out.shape[0] and 0 < per_row <= ROW
    if len(edits) == 1 or not simple:
        for j, edit in edits:  # the engine's op, one cell at a time: one cell, or other shapes and dtypes
            _one(out, j, k, edit, src)
        return
    one_row = torch.arange(per_row, device=out.device).view(out.shape[1:])
    starts = torch.arange(rows, device=out.device)[:, None] * per_row  # each example's first position
    parts = [_region(one_row, e.cut) for _, e in edits]
    dst = torch.cat([(starts * k + j * per_row + part).reshape(-1) for (j, _), part in zip(edits, parts)])
    if src is not None:
        at = torch.cat([(starts + part).reshape(-1) for part in parts])
        vals = src.reshape(-1)[at].to(out.dtype)
    elif op == "zero":
        vals = torch.zeros((), dtype=out.dtype, device=out.device)
    else:
        numbers = torch.tensor([float(e.value) for _, e in edits], dtype=torch.float64)  # type: ignore[arg-type]
        vals = numbers.repeat_interleave(torch.tensor([rows * part.numel() for part in parts])).to(out.device)
    if op in ("add", "mul"):
        math = torch.float32 if out.dtype in _HALF else out.dtype
        part = _gather(out, dst).to(math)
        vals = part + vals.to(math) if op == "add" else part * vals.to(math)
    _scatter(out, dst, vals.to(out.dtype))


def _region(one_row: torch.Tensor, cut: tuple[Any, ...] | None) -> torch.Tensor:
    """The positions within one row that ``cut`` (whose first subscript keeps every row) picks, as a row vector."""
    if cut is None:
        return one_row.reshape(1, -1)
    rest = cut if cut and cut[0] is Ellipsis else cut[1:]
    return one_row[rest].reshape(1, -1)


def _gather(out: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    return out.view(-1)[dst] if out.is_contiguous() else out[torch.unravel_index(dst, out.shape)]


def _scatter(out: torch.Tensor, dst: torch.Tensor, vals: torch.Tensor) -> None:
    if out.is_contiguous():
        out.view(-1)[dst] = vals
    else:
        out[torch.unravel_index(dst, out.shape)] = vals


def _one(out: torch.Tensor, j: int, k: int, edit: Edit, src: torch.Tensor | None) -> None:
    """Cell ``j``'s edit on its rows of ``out``, as the engine's op computes it (surgery/actions/ops.py, sources.py)."""
    rows = out if k == 1 else out[j::k]
    part = rows if edit.cut is None else rows[edit.cut]
    if src is not None:
        same = src.shape == rows.shape  # the usual case, where onto() cuts the source like the part
        value = (src if edit.cut is None else src[edit.cut]) if same else onto(src, rows, part, edit.cut, "from")
        value = value if value.dtype == part.dtype else value.to(dtype=part.dtype)
        new = part + value if edit.op == "add" else part * value if edit.op == "mul" else value
    elif edit.op == "zero":
        new = torch.zeros_like(part)
    elif edit.op == "set":
        new = torch.full_like(part, float(edit.value))  # type: ignore[arg-type]
    else:
        number = float(edit.value)  # type: ignore[arg-type]
        new = part + number if edit.op == "add" else part * number
    if edit.cut is None:
        rows.copy_(new)
    else:
        rows[edit.cut] = new
