"""One probe forward pass before applying: the shapes some actions need (a patch's), the
size of captures with ``max_bytes``, and that a ``function:`` action's function is called.
Its hooks are removed again whatever happens."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.core.select import Target
from surgery.core.steps import ShapeCheck, Step, fits
from surgery.core.structure import get_item, not_a_tensor_to_cut
from surgery.errors import ConfigError


def check_before_apply(
    model: nn.Module, steps: list[Step], example_inputs: tuple[Any, ...], batches: int,
    example_kwargs: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Run the model once on ``example_inputs`` and ``example_kwargs`` (no_grad); check shapes and capture sizes."""
    checks = [(t, c) for s in steps if s.enabled for t, c in s.shape_checks]
    captures = [s for s in steps if s.enabled and s.traits.sized]
    sized = [s for s in captures if s.config.max_bytes is not None and s.config.reduce == "none"]
    watched = [(s.watch, t) for s in steps if s.enabled and s.watch is not None for t in s.targets]
    if not checks and not sized and not watched:
        return
    seen: dict[tuple[int, str], Any] = {}
    per_batch = {s.name: 0 for s in sized}
    handles = []
    for target, check in checks:
        remember = partial(_remember, seen, id(target.module), check.what)
        if check.what == "output":
            handles.append(target.module.register_forward_hook(lambda m, a, o, r=remember: r(o)))
        else:
            hook = target.module.register_forward_pre_hook(lambda m, a, k, r=remember: r((a, k)), with_kwargs=True)
            handles.append(hook)
    for step in sized:
        want = step.config.what
        for target in step.targets:
            count = partial(_count_bytes, per_batch, step.name, "input" in want, "output" in want)
            handles.append(target.module.register_forward_hook(count, with_kwargs=True))
    after = []
    for watch, target in watched:  # e.g. does the forward call the function a `function:` action names?
        hooks, check_after = watch(target)
        handles.extend(hooks)
        after.append(check_after)
    try:
        with torch.no_grad():
            model(*example_inputs, **(example_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - the unmodified model cannot take this input
        if any(t.is_meta for t in example_inputs if isinstance(t, torch.Tensor)):
            return  # a forward that reads values (.item()) cannot run on meta: a plan without weights skips the probe
        raise ConfigError(f"input: the model fails on this input before any surgery: {type(e).__name__}: {e}") from e
    finally:
        for handle in handles:
            handle.remove()
    for target, check in checks:
        _check_shape(target, check, seen.get((id(target.module), check.what)))
    for step in sized:
        _check_size(step, per_batch[step.name], batches)
    for check_after in after:
        check_after()


def _check_shape(target: Target, check: ShapeCheck, value: Any) -> None:
    if value is None:
        return  # not called on this input: checked again at run time
    if check.what == "input":
        args, kwargs = value
        if isinstance(check.item, str):
            if check.item not in kwargs:
                return  # passed by position: checked at run time
            picked = kwargs[check.item]
        else:
            picked = _item(target, check, args)
    else:
        picked = _item(target, check, value)
    if not isinstance(picked, torch.Tensor):
        return  # not a tensor here: the hook reports it
    if check.heads is not None:
        picked = _heads_view(target, check, picked)
    full = tuple(picked.shape)
    if check.index is not None:
        try:
            picked = picked[check.index]
        except IndexError as e:
            raise ConfigError(
                f"{check.where}.index: {check.index_text} does not fit the {check.what} of {target.name!r},"
                f" shape {list(picked.shape)}: {e}"
            ) from None
    if check.shape is not None and not fits(check.shape, full, tuple(picked.shape), check.index is not None):
        key = "value" if check.source.endswith("as value") else "from"
        whole = f" (nor onto the whole {check.what}, shape {list(full)})" if check.index is not None else ""
        raise ConfigError(
            f"{check.where}.{key}: {check.source} has shape {list(check.shape)}, but the {check.what} of"
            f" {target.name!r} is {list(picked.shape)} on this input: it does not broadcast onto it{whole}"
        )


def _heads_view(target: Target, check: ShapeCheck, picked: torch.Tensor) -> torch.Tensor:
    """``picked`` as ``[..., heads, d_head]``, or a ConfigError when its last dim does not split so."""
    width = picked.shape[-1] if picked.dim() else 0
    if not width or width % int(check.heads or 1):
        raise ConfigError(
            f"{check.where}.heads: the {check.what} of {target.name!r} has shape {list(picked.shape)}, whose last"
            f" dim does not split into {check.heads} heads"
        )
    return picked.unflatten(-1, (int(check.heads or 1), -1))


def _item(target: Target, check: ShapeCheck, value: Any) -> Any:
    """``check.item`` of ``value``, or a ConfigError naming the action's ``item`` when it does not fit."""
    if check.item is None:  # the whole input/output: index needs it to be a tensor
        if check.index is not None and not isinstance(value, torch.Tensor):
            cut = not_a_tensor_to_cut(f"{check.what} of {target.name!r} on this input", value)
            raise ConfigError(f"{check.where}.index: {cut}")
        return value
    try:
        return get_item(value, check.item)
    except (IndexError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{check.where}.item: {check.item!r} does not fit the {check.what} of {target.name!r} on this input: {e}"
        ) from None


def _check_size(step: Step, per_batch: int, batches: int) -> None:
    held = per_batch * (batches if step.config.to == "memory" else 1)
    if held > step.config.max_bytes:
        scope = f"{batches} batch(es)" if step.config.to == "memory" else "one batch"
        raise ConfigError(
            f"actions.{step.name}.max_bytes: the capture would hold about {_size(held)} over {scope}"
            f" ({_size(per_batch)} a batch), more than max_bytes={step.config.max_bytes};"
            " use to: disk, reduce: mean|stats, or select fewer modules"
        )


def _remember(seen: dict[tuple[int, str], Any], key: int, what: str, value: Any) -> None:
    seen.setdefault((key, what), value)


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
