"""A probe forward pass: check, before applying, the shapes some actions need (e.g. a patch's)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.actions.base import Step
from surgery.errors import ConfigError
from surgery.structure import get_item


def check_capture_sizes(model: nn.Module, steps: list[Step], example_inputs: tuple[Any, ...], batches: int) -> None:
    """Refuse, before running, a capture whose records would outgrow its ``max_bytes``."""
    sized = [s for s in steps if s.enabled and s.kind == "capture" and s.config.max_bytes is not None]
    if not sized or all(s.config.reduce != "none" for s in sized):
        return
    per_batch: dict[str, int] = {s.name: 0 for s in sized}
    handles = []
    for step in sized:
        want = step.config.what
        for target in step.targets:
            hook = partial(_count_bytes, per_batch, step.name, "input" in want, "output" in want)
            handles.append(target.module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    for step in sized:
        held = per_batch[step.name] * (batches if step.config.to == "memory" else 1)
        if step.config.reduce == "none" and held > step.config.max_bytes:
            scope = f"{batches} batch(es)" if step.config.to == "memory" else "one batch"
            raise ConfigError(
                f"actions.{step.name}.max_bytes: the capture would hold about {_size(held)} over {scope}"
                f" ({_size(per_batch[step.name])} a batch), more than max_bytes={step.config.max_bytes};"
                " use to: disk, reduce: mean|stats, or select fewer modules"
            )


def _count_bytes(
    totals: dict[str, int], name: str, inputs: bool, outputs: bool, m: Any, args: Any, kwargs: Any, output: Any
) -> None:
    found = (list(args) + list(kwargs.values()) if inputs else []) + ([output] if outputs else [])
    totals[name] += sum(t.nbytes for value in found for t in _tensors(value))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in _tensors(v)]


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


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
