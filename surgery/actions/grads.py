"""Backward-path kinds: ``capture_grad`` and ``modify_grad``.

On a module they use a full backward hook (``grad_input``, ``grad_output``), or with
``what: grad_output`` a full backward pre-hook (it runs before the module's own backward, so a
change reaches the module's parameter gradients and its grad_input); with ``param`` they use
``Tensor.register_hook`` on each matched parameter. ``calls`` counts backward calls per module
in the order autograd runs them (the reverse of the forward order for a module called twice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.actions.base import (
    FULL_BACKWARD_HOOK,
    FULL_BACKWARD_PRE_HOOK,
    KINDS,
    TENSOR_HOOK,
    BindContext,
    Kind,
    Step,
    TensorSpec,
    check_grad_hooks,
    full_name,
    hook_failed,
    hook_on,
    modules_of,
    tensor_named,
    tensors_named,
    tensors_of,
)
from surgery.actions.ops import make_op
from surgery.actions.sharded import grad_tensor
from surgery.core.ledger import Ledger
from surgery.core.records import Call
from surgery.core.schema import GRAD_OPS, CaptureGradAction, ModifyGradAction
from surgery.core.select import Target
from surgery.errors import ConfigError

Grads = tuple[torch.Tensor | None, ...]


def _changed(grads: Grads, op: Callable[..., torch.Tensor], module: nn.Module, item: int | None) -> Grads:
    """``grads`` with ``op`` applied to each gradient (only ``item`` when set); None stays None."""
    return tuple(g if g is None or (item is not None and i != item) else op(g, module) for i, g in enumerate(grads))


def _own_copies(grads: Grads) -> Grads:
    """Copies a record owns: autograd may hand the same memory on (a leaf's ``.grad`` accumulates into it in place,
    DDP all-reduces a parameter's into its average), so a bare ``detach()`` would show later values, not these."""
    return tuple(None if g is None else g.detach().clone() for g in grads)


def _each_param(
    ledger: Ledger,
    action: str,
    found: list[tuple[Target, str, TensorSpec]],
    make_hook: Callable[[str, nn.Module], Callable],
    cfg: Any,
    root: nn.Module,
) -> None:
    """Register one tensor hook per matched parameter, looked up at apply time (FSDP2: on its unsharded parameter)."""
    for target, pname, _ in ledger.each(action, found, lambda f: full_name(f[0], f[1])):
        key = full_name(target, pname)
        tensor = grad_tensor(root, tensor_named(target.module, pname))  # what autograd uses (surgery/actions/sharded)
        hook_on(ledger, tensor.register_hook, make_hook(key, target.module), cfg)


def _no_prepend(cfg: Any, where: str) -> None:
    """A tensor hook has no prepend in PyTorch (``Tensor.register_hook`` appends); refuse rather than ignore it."""
    if cfg.prepend:
        raise ConfigError(f"{where}.prepend: a parameter's tensor hooks always run in the order registered; drop"
                          " prepend when param is set")  # fmt: skip


@KINDS.register()
class CaptureGrad(Kind):
    """Record grad_input/grad_output per module, or ``.grad`` per parameter keyed by full name."""

    name = "capture_grad"
    observes = True
    schema = CaptureGradAction
    mechanism = FULL_BACKWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Resolve parameters when ``param`` is set; otherwise any module can be hooked."""
        action = ctx.name
        if cfg.param is not None:
            _no_prepend(cfg, ctx.where)
            found = tensors_of(targets, cfg.param, ctx, allow_empty=cfg.allow_empty)
            check_grad_hooks(found, ctx)
            root = ctx.root

            def apply_params(ledger: Ledger) -> None:
                if cfg.plot:
                    ledger.plotted.add(action)

                def make_hook(key: str, module: nn.Module) -> Callable:
                    calls = ledger.record(action, key).calls
                    return lambda grad: calls.append(Call(grad=grad.detach().clone()))  # own copy: see _own_copies

                _each_param(ledger, action, found, make_hook, cfg, root)

            return Step(ctx.name, self.name, TENSOR_HOOK, cfg, modules_of(found), apply_params, tensors_named(found))
        what = cfg.what

        def apply(ledger: Ledger) -> None:
            if cfg.plot:
                ledger.plotted.add(action)
            for target in ledger.each(action, targets, lambda t: t.name):
                calls = ledger.record(action, target.name).calls
                if what == "grad_output":  # a pre-hook: it sees grad_output before the module's backward runs

                    def pre_hook(m: nn.Module, grad_output: Grads, calls: list[Call] = calls) -> None:
                        calls.append(Call(grad_output=_own_copies(grad_output)))

                    hook_on(ledger, target.module.register_full_backward_pre_hook, pre_hook, cfg)
                    continue

                def hook(m: nn.Module, grad_input: Grads, grad_output: Grads, calls: list[Call] = calls) -> None:
                    calls.append(
                        Call(
                            grad_input=_own_copies(grad_input),
                            grad_output=None if what == "grad_input" else _own_copies(grad_output),
                        )
                    )

                hook_on(ledger, target.module.register_full_backward_hook, hook, cfg)

        mechanism = FULL_BACKWARD_PRE_HOOK if what == "grad_output" else self.mechanism
        return Step(ctx.name, self.name, mechanism, cfg, targets, apply)


@KINDS.register()
class ModifyGrad(Kind):
    """An op on each grad_input tensor (or only ``item``), or on a parameter's gradient."""

    name = "modify_grad"
    choices = ("op", GRAD_OPS)
    schema = ModifyGradAction
    mechanism = FULL_BACKWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check the op (an ``expr`` sees the gradient as ``grad``); resolve parameters if set."""
        build = make_op(cfg, ctx.where, ctx.seed, ctx.name, "grad", ctx.safe)
        action, where = ctx.name, ctx.where
        if cfg.param is not None:
            if cfg.item is not None:
                raise ConfigError(f"{where}.item: a parameter's gradient is one tensor; drop item when param is set")
            _no_prepend(cfg, where)
            found = tensors_of(targets, cfg.param, ctx, allow_empty=cfg.allow_empty)
            check_grad_hooks(found, ctx)
            root = ctx.root

            def apply_params(ledger: Ledger) -> None:
                op = build()

                def make_hook(key: str, module: nn.Module) -> Callable:
                    def hook(grad: torch.Tensor) -> torch.Tensor:
                        try:
                            return op(grad, module)
                        except Exception as e:
                            raise hook_failed(action, key, e, on="parameter") from e

                    return hook

                _each_param(ledger, action, found, make_hook, cfg, root)

            return Step(ctx.name, self.name, TENSOR_HOOK, cfg, modules_of(found), apply_params, tensors_named(found))
        item = cfg.item
        if cfg.what == "grad_output":
            return Step(
                ctx.name, self.name, FULL_BACKWARD_PRE_HOOK, cfg, targets, _pre_hooks(build, action, item, cfg, targets)
            )

        def apply(ledger: Ledger) -> None:
            op = build()
            for target in ledger.each(action, targets, lambda t: t.name):
                name = target.name

                def hook(m: nn.Module, grad_input: Grads, grad_output: Grads, name: str = name) -> Grads:
                    try:
                        return _changed(grad_input, op, m, item)
                    except Exception as e:
                        raise hook_failed(action, name, e) from e

                hook_on(ledger, target.module.register_full_backward_hook, hook, cfg)

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply)


def _pre_hooks(
    build: Callable[[], Callable], action: str, item: int | None, cfg: Any, targets: list[Target]
) -> Callable[[Ledger], None]:
    """modify_grad on grad_output: a full backward pre-hook, so the module's own backward (its parameter gradients
    and grad_input) starts from the changed gradient, as PyTorch's ``register_full_backward_pre_hook`` allows."""

    def apply(ledger: Ledger) -> None:
        op = build()
        for target in ledger.each(action, targets, lambda t: t.name):
            name = target.name

            def pre_hook(m: nn.Module, grad_output: Grads, name: str = name) -> Grads:
                try:
                    return _changed(grad_output, op, m, item)
                except Exception as e:
                    raise hook_failed(action, name, e) from e

            hook_on(ledger, target.module.register_full_backward_pre_hook, pre_hook, cfg)

    return apply
