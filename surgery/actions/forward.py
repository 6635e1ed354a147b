"""Forward-path kinds: ``replace_forward`` (forward hook), ``modify_output`` (forward hook),
``modify_input`` (forward pre-hook)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from surgery.actions.base import (
    FORWARD_HOOK,
    FORWARD_PRE_HOOK,
    KINDS,
    BindContext,
    Kind,
    Step,
    hook_failed,
    tensor_named,
)
from surgery.actions.ops import make_op
from surgery.errors import ConfigError
from surgery.expr import compile_expr
from surgery.ledger import Ledger
from surgery.schema import ModifyAction, ReplaceForwardAction
from surgery.select import Target
from surgery.structure import get_item, replace_item

Compute = Callable[[nn.Module, tuple[Any, ...], Any], Any]


def _own_tensor(module: nn.Module, names: tuple[str, ...], ctx: BindContext) -> str | None:
    """The first of ``names`` the module has as a parameter or buffer (or will have)."""
    added = ctx.added.get(id(module), {})
    for name in names:
        if name in module._parameters or name in module._buffers or name in added:
            return name
    return None


def _linear(module: nn.Module, weight: str, bias: str | None) -> Compute:
    """x @ W.T + b for a matrix W; x * W + b for a scalar-like W (the seeds' Functions)."""

    def compute(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        w = tensor_named(m, weight)
        b = tensor_named(m, bias) if bias is not None else None
        if w.dim() >= 2:
            return F.linear(args[0], w, b)
        y = args[0] * w
        return y if b is None else y + b

    return compute


@KINDS.register("replace_forward")
class ReplaceForward(Kind):
    """The module's output becomes ``fn`` (identity, zero, linear) or ``expr`` of its inputs.

    The original forward still runs (hooks cannot skip it) and its output is discarded.
    For modules with ``inplace=True`` a pre-hook hands forward a copy of the inputs, so the
    replacement sees the inputs as they came in.
    """

    name = "replace_forward"
    schema = ReplaceForwardAction
    mechanism = FORWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Build one compute function per module; check ``linear`` finds a weight."""
        computes: list[tuple[Target, Compute]] = []
        if cfg.expr is not None:
            expr = compile_expr(cfg.expr, f"{ctx.where}.expr", names=("x", "inputs", "output", "module"))
            compute: Compute = lambda m, args, out: expr(x=args[0], inputs=args, output=out, module=m)  # noqa: E731
            computes = [(t, compute) for t in targets]
        elif cfg.fn == "identity":
            computes = [(t, lambda m, args, out: args[0]) for t in targets]
        elif cfg.fn == "zero":
            computes = [(t, lambda m, args, out: torch.zeros_like(out)) for t in targets]
        else:
            for target in targets:
                weight = _own_tensor(target.module, ("weight", "W"), ctx)
                if weight is None:
                    raise ConfigError(
                        f"{ctx.where}.fn: 'linear' needs a weight (parameter 'weight' or 'W') on module"
                        f" {target.name!r} ({type(target.module).__name__}); use expr instead"
                    )
                computes.append(
                    (target, _linear(target.module, weight, _own_tensor(target.module, ("bias", "b"), ctx)))
                )
        action = ctx.name

        def apply(ledger: Ledger) -> None:
            for target, compute in ledger.each(action, computes, lambda tc: tc[0].name):
                _register(ledger, action, target, compute)

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply)


def _register(ledger: Ledger, action: str, target: Target, compute: Compute) -> None:
    module, name = target.module, target.name
    if not getattr(module, "inplace", False):

        def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            try:
                return compute(m, args, output)
            except Exception as e:
                raise hook_failed(action, name, e) from e

        ledger.add_handle(module.register_forward_hook(hook))
        return
    pending: list[tuple[Any, ...]] = []

    def keep_inputs(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        pending.append(args)
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    def replace(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        try:
            return compute(m, pending.pop(), output)
        except Exception as e:
            raise hook_failed(action, name, e) from e

    ledger.add_handle(module.register_forward_pre_hook(keep_inputs))
    ledger.add_handle(module.register_forward_hook(replace))


def _check_item(cfg: Any, where: str) -> None:
    if not isinstance(cfg.item, (int, str)) or isinstance(cfg.item, bool):
        raise ConfigError(f"{where}.item: must be an int position or a str key, got {cfg.item!r}")


@KINDS.register("modify_output")
class ModifyOutput(Kind):
    """An op on the output (or one ``item`` of it, or an ``index`` slice of that)."""

    name = "modify_output"
    schema = ModifyAction
    mechanism = FORWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check the op (an ``expr`` sees the tensor as ``output``) and the item."""
        _check_item(cfg, ctx.where)
        make_op(cfg, ctx.where, ctx.seed, ctx.name, "output")
        action, seed, item = ctx.name, ctx.seed, cfg.item

        def apply(ledger: Ledger) -> None:
            op = make_op(cfg, f"actions.{action}", seed, action, "output")
            for target in ledger.each(action, targets, lambda t: t.name):
                name = target.name

                def hook(m: nn.Module, args: tuple[Any, ...], output: Any, name: str = name) -> Any:
                    try:
                        return replace_item(output, item, op(get_item(output, item), m))
                    except Exception as e:
                        raise hook_failed(action, name, e) from e

                ledger.add_handle(target.module.register_forward_hook(hook))

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply)


@KINDS.register("modify_input")
class ModifyInput(Kind):
    """An op on positional input ``item`` (default 0) before forward sees it."""

    name = "modify_input"
    schema = ModifyAction
    mechanism = FORWARD_PRE_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check the op (an ``expr`` sees the tensor as ``x``) and that item is a position."""
        if not isinstance(cfg.item, int) or isinstance(cfg.item, bool):
            raise ConfigError(f"{ctx.where}.item: positional inputs are picked by an int, got {cfg.item!r}")
        make_op(cfg, ctx.where, ctx.seed, ctx.name, "x")
        action, seed, item = ctx.name, ctx.seed, cfg.item

        def apply(ledger: Ledger) -> None:
            op = make_op(cfg, f"actions.{action}", seed, action, "x")
            for target in ledger.each(action, targets, lambda t: t.name):
                name = target.name

                def pre_hook(m: nn.Module, args: tuple[Any, ...], name: str = name) -> tuple[Any, ...]:
                    try:
                        if item >= len(args):
                            raise IndexError(f"the module got {len(args)} positional input(s); item {item} is not one")
                        return replace_item(args, item, op(get_item(args, item), m))
                    except Exception as e:
                        raise hook_failed(action, name, e) from e

                ledger.add_handle(target.module.register_forward_pre_hook(pre_hook))

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply)
