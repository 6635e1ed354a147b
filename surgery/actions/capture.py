"""Looking without changing: ``capture`` (records calls) and ``log`` (prints them); forward hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.actions.base import (
    FORWARD_HOOK,
    KINDS,
    BindContext,
    Kind,
    ShapeCheck,
    Step,
    hook_failed,
    hook_on,
    input_position,
)
from surgery.actions.capture_hooks import (
    input_hook,
    item_of,
    output_hook,
    register_calls,
    stop_at_root,
    stop_hook,
)
from surgery.actions.functions import capture_on, inside_step
from surgery.core.callables import resolve_callable
from surgery.core.ledger import Ledger
from surgery.core.output import say
from surgery.core.records import Record, detached
from surgery.core.schema import CaptureAction, LogAction
from surgery.core.select import Target
from surgery.errors import ConfigError
from surgery.expr.parsing import compile_index


@KINDS.register()
class Capture(Kind):
    """Record ``what`` (input, output) of every call into ``captures[ACTION][MODULE]``.

    ``input`` records the positional inputs as ``.input`` and keyword inputs as ``.kwargs``.
    """

    name = "capture"
    observes = True
    sized = True
    schema = CaptureAction
    mechanism = FORWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Nothing to check beyond the schema: any module can be captured."""
        action = ctx.name
        want_input, want_output = "input" in cfg.what, "output" in cfg.what
        if cfg.function is not None:
            return inside_step(self, cfg, targets, ctx, capture_on(cfg, action, tensors_in))
        transform = resolve_callable(cfg.fn, f"{ctx.where}.fn", ctx.safe) if cfg.fn is not None else None
        index = compile_index(cfg.index, f"{ctx.where}.index") if cfg.index is not None else None
        if cfg.stop and targets and targets[-1].module is ctx.root:
            raise ConfigError(f"{ctx.where}.stop: stop ends the root's forward early; select a module inside it")
        named = want_input and isinstance(cfg.item, str)  # a named input: where forward takes it by position
        positions = {id(t.module): input_position(t, cfg.item, ctx.where) for t in targets} if named else {}
        checks = [(t, ShapeCheck(ctx.where, w, item_of(cfg, w), index, cfg.index, None, "", cfg.heads)) for t in targets
                  for w in cfg.what if cfg.item is not None or index is not None or cfg.heads is not None]  # fmt: skip

        plain_inputs = (want_input and not want_output and cfg.item is None and index is None and cfg.detach
                        and cfg.heads is None and not (cfg.clone or cfg.always))  # fmt: skip

        def apply(ledger: Ledger) -> None:
            if cfg.to == "disk":
                ledger.streamed.add(action)
            if cfg.plot:
                ledger.plotted.add(action)
            for target in ledger.each(action, targets, lambda t: t.name):
                record = ledger.record(action, target.name, cfg.reduce)
                if cfg.reduce != "none":
                    hook = _reducing_hook(record, want_input, want_output, action, target.name)
                    hook_on(ledger, target.module.register_forward_hook, hook, cfg, with_kwargs=True)
                    continue
                if transform is not None:
                    hook = _transformed_hook(record, transform, cfg.detach, cfg.keep == "last", action, target.name)
                    hook_on(ledger, target.module.register_forward_hook, hook, cfg)
                elif not want_input and cfg.item is None and index is None and not cfg.clone and cfg.heads is None:
                    hook = output_hook(record, cfg.detach, cfg.keep == "last")  # as cheap as a hand-written hook
                    hook_on(ledger, target.module.register_forward_hook, hook, cfg)
                elif plain_inputs:
                    hook = input_hook(record, cfg.keep == "last")
                    hook_on(ledger, target.module.register_forward_hook, hook, cfg, with_kwargs=True)
                else:
                    register_calls(ledger, record, cfg, target, index, positions.get(id(target.module)))
                if cfg.stop and target is targets[-1]:
                    hook_on(ledger, target.module.register_forward_hook, stop_hook, cfg)
            if cfg.stop:
                stop_at_root(ledger, ctx.root)

        streams = cfg.to == "disk"
        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, streams=streams, shape_checks=checks)


def tensors_in(value: Any, what: str) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) for a tensor or the tensor elements of a tuple/list/dict: ``what``, ``what.i``."""
    if isinstance(value, torch.Tensor):
        return [(what, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (tuple, list)) else ()
    return [(f"{what}.{k}", v) for k, v in items if isinstance(v, torch.Tensor)]


def _transformed_hook(
    record: Record, fn: Callable[..., Any], detach: bool, last: bool, action: str, name: str
) -> Callable[..., None]:
    """A forward hook recording ``fn(module, inputs, output)`` as the call's output (a logit lens, a projection)."""
    outputs, latest = record.outputs, record.latest

    def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        try:
            value = fn(m, args, output)
        except Exception as e:
            raise hook_failed(action, name, e) from e
        value = detached(value) if detach else value
        if last:
            latest[0] = (value, None)
        else:
            outputs.append((value, None))

    return hook


def _reducing_hook(record: Record, want_input: bool, want_output: bool, action: str, name: str) -> Callable:
    """A forward hook folding each call into ``record.running`` instead of keeping it."""
    running_for = record.running_for  # thread-safe: each WHAT's statistics are made once and merged under a lock

    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        try:
            found = (tensors_in(args, "input") + tensors_in(kwargs, "input") if want_input else []) + (
                tensors_in(output, "output") if want_output else []
            )
            for key, tensor in found:
                running_for(key).add(tensor)
        except Exception as e:
            raise hook_failed(action, name, e) from e

    return hook


def describe(value: Any, stats: bool) -> str:
    """Shape (and mean/std/min/max) of a tensor, or of each tensor in a container."""
    if isinstance(value, torch.Tensor):
        text = f"{tuple(value.shape)}"
        if stats and value.numel() and value.is_floating_point():
            v = value.detach().float()
            std = v.std().item() if v.numel() > 1 else 0.0
            text += f" mean={v.mean().item():.4g} std={std:.4g} min={v.min().item():.4g} max={v.max().item():.4g}"
        return text
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v, stats) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v, stats)}" for k, v in value.items()) + "}"
    return type(value).__name__


@KINDS.register()
class Log(Kind):
    """Print module name, input and output shapes (and stats) on every call."""

    name = "log"
    observes = True
    schema = LogAction
    mechanism = FORWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Nothing to check beyond the schema."""
        action, stats = ctx.name, cfg.stats

        def apply(ledger: Ledger) -> None:
            for target in ledger.each(action, targets, lambda t: t.name):
                name = target.name

                def hook(m: nn.Module, args: tuple[Any, ...], output: Any, name: str = name) -> None:
                    try:
                        shapes = f"in {describe(args, stats)} -> out {describe(output, stats)}"
                        say(f"[{action}] {name} ({type(m).__name__}): {shapes}")
                    except Exception as e:
                        raise hook_failed(action, name, e) from e

                hook_on(ledger, target.module.register_forward_hook, hook, cfg)

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply)
