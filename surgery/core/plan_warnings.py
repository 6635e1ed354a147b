"""A plan's warnings: what it will do that is legal but maybe not meant (shown with the plan, never refused).

Hooks sharing a module (they run in plan order), a selector matching most but not all of a repeated structure
(11 of 12 blocks), and parameter changes on a model already wrapped in DDP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from surgery.core.select import ModuleIndex
from surgery.core.steps import Step

DDP_NAMES = frozenset({"DistributedDataParallel"})


def ddp_warnings(root: nn.Module, steps: list[Step]) -> list[str]:
    """Plan warnings for changes to the parameter set of a model already wrapped in DDP (each kind's ``ddp_advice``)."""
    if not any(type(m).__name__ in DDP_NAMES for m in (root, *root.children())):
        return []
    return [
        f"actions.{s.name} ({s.kind}) on a DDP-wrapped model: {s.traits.ddp_advice}"
        for s in steps
        if s.enabled and s.traits.ddp_advice
    ]


def overlap_warnings(steps: list[Step]) -> list[str]:
    """Modules where a changing hook shares the module with other hooks: they run in plan order.

    A capture that a later action on the same module reads (``from: {capture: NAME}``, a patch) is left out:
    it must record before the change, and the plan already refuses it listed after its reader.
    """
    by_module: dict[str, list[Step]] = {}
    for step in steps:
        if step.enabled and step.mechanism not in ("apply pass", "state-dict hook"):  # hooks that run in a call
            for target in step.targets:
                by_module.setdefault(target.name, []).append(step)
    shared = {}
    for name, found in by_module.items():
        sources = {read for s in found for read in _reads(s)}
        found = [s for s in found if s.name not in sources]  # order fixed by what reads them
        if len(found) > 1 and any(not s.traits.observes for s in found):  # observers alone cannot disagree
            shared[name] = [s.name for s in by_module[name]]
    lines = [f"{name}: {' → '.join(actions)} (hooks run in this order)" for name, actions in list(shared.items())[:5]]
    if len(shared) > 5:
        lines.append(f"… and {len(shared) - 5} more modules with several actions")
    return lines


def _reads(step: Step) -> tuple[str, ...]:
    """The earlier actions whose records ``step`` reads as its source (``from: {capture: NAME}``)."""
    source = getattr(step.config, "from_", None)
    return (str(source["capture"]),) if isinstance(source, Mapping) and "capture" in source else ()


_NUMBER_SEGMENT = re.compile(r"(?<![^.\n])\d+(?![^.\n])")  # a whole dot-separated segment of digits


def _shapes_of_names(names: list[str]) -> list[str]:
    """Names with their number segments as ``*`` (``blocks.3.mlp`` → ``blocks.*.mlp``), in one C-level pass."""
    joined = "\n".join(names)
    if joined.count("\n") != len(names) - 1:  # a name with a newline in it: one substitution per name
        return [_NUMBER_SEGMENT.sub("*", name) for name in names]
    return _NUMBER_SEGMENT.sub("*", joined).split("\n") if names else []


def partial_structure_warnings(steps: list[Step], index: ModuleIndex) -> list[str]:
    """Flag a selector that matches most, but not all, of a repeated structure (11 of 12 blocks)."""
    family: dict[tuple[str, type], list[str]] = {}
    shape_of: dict[str, str] = {}
    for name, cls, shape in zip(index.names, index.classes, _shapes_of_names(index.names)):
        if shape != name:
            family.setdefault((shape, cls), []).append(name)
            shape_of[name] = shape
    lines = []
    for step in steps:
        matched: dict[tuple[str, type], set[str]] = {}
        for target in step.targets:
            target_shape = shape_of.get(target.name)
            if target_shape is not None:
                key = (target_shape, type(target.module))
                if key in family:
                    matched.setdefault(key, set()).add(target.name)
        for key, names in matched.items():
            everyone = family[key]
            if len(everyone) >= 3 and len(everyone) / 2 <= len(names) < len(everyone):
                missing = [n for n in everyone if n not in names]
                lines.append(
                    f"actions.{step.name}: matches {len(names)} of the {len(everyone)} modules like {key[0]!r};"
                    f" not {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}. Intended?"
                )
    return lines
