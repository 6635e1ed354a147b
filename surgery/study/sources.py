"""The source pass a study's cells share: one surgery holding every cell's captures, run once per batch.

It is shared when it does not depend on the cell: every action that could change it is an observer,
reads ``from: {capture}`` (a no-op in a source pass) or has ``passes: main``. Then each cell's capture
records get the calls this pass froze for their module. Otherwise each cell runs its own source pass.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import Plan
from surgery.core.engine import Surgery, apply_plan
from surgery.core.records import Call
from surgery.core.structure import map_tensors
from surgery.study.inputs import Inputs

_GLOB_CHARACTERS = set("*?[]")


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
            spec = (plan.specs or actions)[step.name]  # as compiled: a site's what/item chosen (surgery.arch)
            node = {k: v for k, v in spec.items() if k not in ("select", "type", "exclude")}
            key = (step.name, json.dumps(node, sort_keys=True, default=str))
            if key not in groups:
                groups[key] = step.name if step.name not in union else f"{step.name}~{len(groups)}"
                union[groups[key]] = {**node, "select": [], "allow_empty": False}
            chosen = union[groups[key]]["select"]
            chosen.extend(m for m in modules if m not in chosen)
            mapping[step.name] = groups[key]
        names.append(mapping)
    return union, names


def inject(surgery: Surgery, frozen: dict[tuple[str, str], list[Call]], mapping: dict[str, str]) -> None:
    """Give each capture record of ``surgery`` the calls the shared source pass froze for its module."""
    for name, union_name in mapping.items():
        for module, record in surgery.captures.get(name, {}).items():
            record.sources = list(frozen[(union_name, module)])


def shared_source_pass(
    model: nn.Module, sharing: tuple[dict[str, Any], Any], source: Inputs, k: int = 1
) -> tuple[dict[tuple[str, str], list[Call]], Any] | None:
    """The one source pass every cell reads, run on ``source``: each (capture, module)'s frozen calls, and the output.

    With ``k`` cells sharing a forward, each recorded example is repeated ``k`` times in a row, as the
    main rows are, instead of running the source pass on ``k`` copies. None when no cell captures.
    """
    union = sharing[0]
    if not union:
        return None
    with apply_plan(model, union) as surgery:
        with surgery.source_pass():
            output = source.run(model)
        frozen = {(name, module): list(record.sources or [])
                  for name, records in surgery.captures.items() for module, record in records.items()}  # fmt: skip
    if k > 1:
        rows = source.examples
        frozen = {key: [_interleaved(call, k, rows) for call in calls] for key, calls in frozen.items()}
    return frozen, output


def _interleaved(call: Call, k: int, rows: int) -> Call:
    """``call`` with every tensor that holds the ``rows`` examples along dim 0 repeated ``k`` times in a row."""

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(k, dim=0) if t.dim() and t.shape[0] == rows else t

    return Call(input=map_tensors(call.input, repeat), kwargs=map_tensors(call.kwargs, repeat),
                output=map_tensors(call.output, repeat))  # fmt: skip
