"""Whether an SAE's widths fit the module it is spliced into, checked before the model is touched.

From the module itself where its class says its widths (Linear, GPT-2's Conv1D, norms, Embedding's output), from the
model's config for a repeated block (its input and output are the residual stream, ``hidden_size`` wide), and, with
example inputs, from the probe forward (the real tensors, whatever the module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.core.select import Target
from surgery.core.steps import BindContext, Watch
from surgery.core.structure import get_item
from surgery.errors import ConfigError
from surgery.splice.formats import SpliceWeights

CONFIG_WIDTHS = ("hidden_size", "n_embd", "d_model")


def module_widths(target: Target, root: nn.Module) -> tuple[int | None, int | None, str]:
    """(input width, output width, how they are known) from the module's class or the model's config."""
    module = target.module
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, "nn.Linear"
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1]), "Conv1D weight [in, out]"
    if isinstance(module, nn.Embedding):
        return None, module.embedding_dim, "nn.Embedding"
    if type(module).__name__.endswith("Norm") and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0]), int(weight.shape[0]), f"{type(module).__name__} weight"
    width = _config_width(root)
    if width is not None and _is_repeated_block(target, root):
        return width, width, "the model's config (a repeated block: the residual stream)"
    return None, None, ""


def _config_width(root: nn.Module) -> int | None:
    config = getattr(root, "config", None)
    for key in CONFIG_WIDTHS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _is_repeated_block(target: Target, root: nn.Module) -> bool:
    """A module inside a ModuleList of modules of its own class (transformer.h.3)."""
    if "." not in target.real_name:
        return False
    try:
        parent = root.get_submodule(target.real_name.rsplit(".", 1)[0])
    except AttributeError:
        return False
    return isinstance(parent, nn.ModuleList) and len(parent) > 1 and all(type(m) is type(target.module) for m in parent)


def check_widths(weights: SpliceWeights, target: Target, cfg: Any, ctx: BindContext) -> None:
    """Refuse an SAE whose d_in (d_out) is not the width of what it reads (writes), where the module says it."""
    width_in, width_out, known = module_widths(target, ctx.root)
    sides = {"input": width_in, "output": width_out}
    _compare(weights, target, cfg, ctx.where, sides[cfg.reads], sides[cfg.at], known)


def _compare(
    weights: SpliceWeights, target: Target, cfg: Any, where: str, read: int | None, written: int | None, known: str
) -> None:
    if read is not None and read != weights.d_in:
        raise ConfigError(
            f"{where}.module.path: W_enc in {weights.source!r} is {list(weights.W_enc.shape)} (d_in"
            f" {weights.d_in}), but the {cfg.reads} of {target.name!r} is {read} wide ({known})"
        )
    if written is not None and written != weights.d_out:
        raise ConfigError(
            f"{where}.module.path: W_dec in {weights.source!r} is {list(weights.W_dec.shape)} (d_out"
            f" {weights.d_out}), but the {cfg.at} of {target.name!r} is {written} wide ({known})"
        )


def width_watch(by_module: dict[int, SpliceWeights], cfg: Any, where: str) -> Watch:
    """The probe forward's check: the tensors the splice reads and replaces have the SAE's widths."""

    def watch(target: Target) -> tuple[list[Any], Callable[[], None]]:
        seen: dict[str, Any] = {}

        def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            at = (cfg.item or 0) if cfg.at == "input" else 0
            seen.setdefault("input", args[at] if len(args) > at else None)  # by keyword: checked when the hook runs
            seen.setdefault("output", output)

        handle = target.module.register_forward_hook(hook)

        def check() -> None:
            weights = by_module.get(id(target.module))
            if weights is None or not seen:
                return  # not called on this input: the hook checks it when it runs
            widths: dict[str, int | None] = {}
            for side in {cfg.reads, cfg.at}:
                value = seen.get(side)
                if side == "output" and not isinstance(value, torch.Tensor) and cfg.item is not None:
                    try:
                        value = get_item(value, cfg.item)
                    except (IndexError, KeyError, TypeError) as e:
                        raise ConfigError(
                            f"{where}.item: {cfg.item!r} does not fit the output of {target.name!r}: {e}"
                        ) from None
                if side == "output" and not isinstance(value, torch.Tensor):
                    raise ConfigError(
                        f"{where}.item: the output of {target.name!r} is a {type(value).__name__}; pick its tensor with"
                        " item (e.g. item: 0)"
                    )
                widths[side] = int(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() else None
            _compare(weights, target, cfg, where, widths.get(cfg.reads), widths.get(cfg.at), "on this input")

        return [handle], check

    return watch
