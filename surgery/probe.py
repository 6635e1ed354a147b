"""A probe forward pass: check, before applying, the shapes some actions need (e.g. a patch's)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.actions.base import Step
from surgery.errors import ConfigError
from surgery.structure import get_item


def check_shapes(model: nn.Module, steps: list[Step], example_inputs: tuple[Any, ...]) -> None:
    """Run the model once on ``example_inputs`` with probe hooks and check every ShapeCheck."""
    checks = [(t, c) for s in steps if s.enabled for t, c in s.shape_checks]
    if not checks:
        return
    seen: dict[tuple[int, str], Any] = {}
    handles = []
    for target, check in checks:
        module = target.module
        if check.what == "output":
            hook = partial(_remember, seen, id(module), "output")
            handles.append(module.register_forward_hook(lambda m, a, o, hook=hook: hook(o)))
        else:
            hook = partial(_remember, seen, id(module), "input")
            pre = module.register_forward_pre_hook(lambda m, a, k, hook=hook: hook((a, k)), with_kwargs=True)
            handles.append(pre)
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    for target, check in checks:
        value = seen.get((id(target.module), check.what))
        if value is None:
            continue  # not called on this input: checked again at run time
        if check.what == "input":
            args, kwargs = value
            picked = (
                kwargs[check.item]
                if isinstance(check.item, str) and check.item in kwargs
                else get_item(args, check.item)
            )
        else:
            picked = get_item(value, check.item)
        shape = tuple(picked[check.index].shape if check.index is not None else picked.shape)
        if shape != check.shape:
            raise ConfigError(
                f"{check.where}: {check.source} has shape {list(check.shape)}, but the {check.what} of"
                f" {target.name!r} is {list(shape)} on this input"
            )


def _remember(seen: dict[tuple[int, str], Any], key: int, what: str, value: Any) -> None:
    seen.setdefault((key, what), value)
