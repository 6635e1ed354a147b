"""What each cell of an estimated study changes: its edits (an op on a module's input or output item, cut by
an index) and the sites they read, taken from a compiled plan; anything an attribution cannot estimate refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from surgery.actions.base import input_position
from surgery.core.compiler import Plan
from surgery.errors import ConfigError
from surgery.expr.parsing import compile_index
from surgery.study.grid import cell_text

EDITS = ("set", "patch", "add", "mul", "zero")
Key = tuple[int, str, Any]  # (id(module), "input" | "output", item)


class Edit(NamedTuple):
    """One cell's change at one site: the op, its value, where its source is recorded, and the index."""

    site: Key
    source: Key | None  # where a from: {capture} source is recorded (the same module)
    op: str
    value: float | None
    cut: tuple[Any, ...] | None  # the index, parsed
    heads: int | None = None  # the index is on the site viewed as [..., heads, d_head] (an @heads site)
    cell: Mapping[str, Any] | str = ""  # the grid cell making it (or a text naming it), for messages
    index_text: str | None = None
    action: str = ""
    passes: str = "both"  # both: it also acts in the source pass (unless it reads a capture); main: not there

    @property
    def where(self) -> str:
        """``study cell {layer: 0, pos: 3}: actions.patch``, for a shape that does not fit."""
        return f"{_named(self.cell)}: actions.{self.action}"


@dataclass
class Site:
    """A module's input or output item, as the hooks read and replace it."""

    module: nn.Module
    what: str
    item: Any
    position: int | None
    where: str = ""  # the first action reading it: "actions.patch"


def _named(cell: Mapping[str, Any] | str) -> str:
    """``study cell {layer: 0, pos: 3}`` for a grid cell; a text as it is."""
    return cell if isinstance(cell, str) else f"study cell {cell_text(cell)}"


def edits_of(plan: Plan, cell: Mapping[str, Any] | str) -> list[Edit]:
    """The changes one cell makes, each a site an attribution can read; anything else is refused."""
    named = _named(cell)
    edits = []
    for step in plan.steps:
        if not step.enabled or step.traits.observes:
            continue
        cfg, where = step.config, f"{named}: actions.{step.name}"
        if step.kind not in ("modify_input", "modify_output") or cfg.op not in EDITS or cfg.function is not None:
            what = step.kind + (f" op {cfg.op}" if getattr(cfg, "op", None) else "")
            raise ConfigError(
                f"study.method: attribution estimates {', '.join(EDITS)} ops of modify_input/modify_output;"
                f" {where} is {what}; use method: patch"
            )
        if isinstance(cfg.value, torch.Tensor) or cfg.scale is not None:  # a steering vector: surgery/vectors
            raise ConfigError(f"study.method: {where} adds a tensor or a scaled value; attribution estimates number"
                              " values and capture sources only; use method: patch")  # fmt: skip
        source = cfg.from_
        if source is not None and not (isinstance(source, dict) and "capture" in source):
            raise ConfigError(f"study.method: {where}.from: attribution reads sources from a capture only")
        if cfg.calls is not None:
            raise ConfigError(f"study.method: {where}.calls: attribution reads every call as one; drop calls")
        index = compile_index(cfg.index, f"{where}.index") if cfg.index is not None else None
        if index and index[0] != slice(None) and index[0] is not Ellipsis:
            raise ConfigError(f"study.method: {where}.index: its first subscript must keep every example (':')")
        what = "input" if step.kind == "modify_input" else "output"
        for target in step.targets:
            site = (id(target.module), what, cfg.item)
            src = (id(target.module), str(source.get("what", "output")), cfg.item) if source else None
            heads = getattr(cfg, "heads", None)
            passes = getattr(cfg, "passes", "both")
            edits.append(Edit(site, src, cfg.op, cfg.value, index, heads, cell, cfg.index, step.name, passes))
    if not edits:
        raise ConfigError(f"study.method: {named} changes nothing an attribution can estimate")
    return edits


def sites_of(plans: list[Plan]) -> dict[Key, Site]:
    """Every module input/output an edit of any cell acts on or reads its source from."""
    modules = {id(t.module): t for p in plans for s in p.steps if s.enabled for t in s.targets}
    found: dict[Key, Site] = {}
    for plan in plans:
        for step in plan.steps:
            if not step.enabled or step.kind not in ("modify_input", "modify_output"):
                continue
            keys = [(id(t.module), "input" if step.kind == "modify_input" else "output", step.config.item)
                    for t in step.targets]  # fmt: skip
            source = step.config.from_
            if isinstance(source, dict) and "capture" in source:
                keys += [(k[0], str(source.get("what", "output")), k[2]) for k in keys]
            for key in keys:
                target = modules[key[0]]
                named = isinstance(key[2], str) and key[1] == "input"
                position = input_position(target, key[2], "study") if named else None
                found.setdefault(key, Site(target.module, key[1], key[2], position, f"actions.{step.name}"))
    return found
