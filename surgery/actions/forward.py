"""Forward-path kinds: ``replace_forward`` (forward hook), ``modify_output`` (forward hook),
``modify_input`` (forward pre-hook)."""

from __future__ import annotations

import inspect
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
    KeyedError,
    Kind,
    ShapeCheck,
    Step,
    check_module_reads,
    hook_failed,
    hook_on,
    input_at,
    input_position,
    tensor_named,
)
from surgery.actions.functions import inside_step, modify_on, replace_on
from surgery.actions.ops import make_op
from surgery.actions.sharded import whole
from surgery.actions.sources import SourceContext, source_shape
from surgery.core.callables import resolve_callable
from surgery.core.ledger import Ledger
from surgery.core.schema import FORWARD_FNS, TENSOR_OPS, ModifyAction, ReplaceForwardAction
from surgery.core.select import Target
from surgery.core.structure import get_item, replace_item
from surgery.core.wrapped import forward_parameters
from surgery.errors import ConfigError
from surgery.expr.check import compile_expr
from surgery.expr.parsing import compile_index

Compute = Callable[..., Any]  # (module, inputs, output[, kwargs]) -> the new output


def _own_tensor(module: nn.Module, names: tuple[str, ...], ctx: BindContext) -> str | None:
    """The first of ``names`` the module has as a parameter or buffer (or will have)."""
    added = ctx.added.get(id(module), {})
    for name in names:
        if name in module._parameters or name in module._buffers or name in added:
            return name
    return None


def _linear(weight: str, bias: str | None) -> Compute:
    """x @ W.T + b for a matrix W; x * W + b for a scalar-like W (the seeds' Functions)."""

    def compute(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        w = whole(tensor_named(m, weight))  # FSDP2 reshards before later forward hooks: gather the whole weight
        b = whole(tensor_named(m, bias)) if bias is not None else None
        if w.dim() >= 2:
            return F.linear(args[0], w, b)
        y = args[0] * w
        return y if b is None else y + b

    return compute


def _takes_kwargs(fn: Callable[..., Any]) -> bool:
    """Whether a ``fn`` callable has a parameter named ``kwargs`` (it then gets the module's keyword inputs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "kwargs" in params and params["kwargs"].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                            inspect.Parameter.KEYWORD_ONLY)  # fmt: skip


def _computes(cfg: Any, targets: list[Target], ctx: BindContext) -> tuple[list[tuple[Target, Compute]], bool]:
    """One compute function per selected module, all checked now, and whether they take the keyword inputs."""
    if cfg.expr is not None:
        expr = compile_expr(cfg.expr, f"{ctx.where}.expr", names=("x", "inputs", "output", "module", "kwargs"))
        check_module_reads(expr.module_reads, targets, ctx, "expr")
        if "kwargs" in expr.names_used:  # keyword inputs: a with_kwargs hook, only when the expression reads them
            return [(t, expr.bind("module", "inputs", "output", "kwargs")) for t in targets], True
        compute = expr.bind("module", "inputs", "output")  # a plain function of the hook's arguments
        return [(t, compute) for t in targets], False
    return _fn_computes(cfg, targets, ctx)


def _fn_computes(cfg: Any, targets: list[Target], ctx: BindContext) -> tuple[list[tuple[Target, Compute]], bool]:
    if cfg.fn == "identity":
        return [(t, lambda m, args, out: args[0]) for t in targets], False
    if cfg.fn == "zero":
        return [(t, lambda m, args, out: torch.zeros_like(out)) for t in targets], False
    if cfg.fn != "linear":
        fn = resolve_callable(cfg.fn, f"{ctx.where}.fn", ctx.safe)
        if _takes_kwargs(fn):
            return [(t, lambda m, args, out, kwargs: fn(m, args, out, kwargs=kwargs)) for t in targets], True
        return [(t, fn) for t in targets], False
    computes = []
    for target in targets:
        weight = _own_tensor(target.module, ("weight", "W"), ctx)
        if weight is None:
            raise ConfigError(
                f"{ctx.where}.fn: 'linear' needs a weight (parameter 'weight' or 'W') on module"
                f" {target.name!r} ({type(target.module).__name__}); use expr instead"
            )
        computes.append((target, _linear(weight, _own_tensor(target.module, ("bias", "b"), ctx))))
    return computes, False


@KINDS.register()
class ReplaceForward(Kind):
    """The module's output becomes ``fn`` (identity, zero, linear, a callable) or ``expr`` of its inputs.

    The original forward still runs (hooks cannot skip it) and its output is discarded.
    For modules with ``inplace=True`` a pre-hook hands forward a copy of the inputs, so the
    replacement sees the inputs as they came in.
    """

    name = "replace_forward"
    choices = ("fn", FORWARD_FNS)
    schema = ReplaceForwardAction
    mechanism = FORWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Build one compute function per module; check ``linear`` finds a weight."""
        computes, with_kwargs = _computes(cfg, targets, ctx)
        action = ctx.name
        source = ("expr", cfg.expr) if cfg.expr is not None else ("fn", str(cfg.fn))
        if cfg.function is not None:
            by_module = {id(t.module): c for t, c in computes}
            return inside_step(self, cfg, targets, ctx, replace_on(by_module, with_kwargs))

        def apply(ledger: Ledger) -> None:
            for target, compute in ledger.each(action, computes, lambda tc: tc[0].name):
                _register(ledger, action, target, compute, source, cfg, with_kwargs)

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply)


def _not_a_tensor(source: tuple[str, str], result: Any) -> KeyedError:
    """A replacement that is not a tensor where the module returned one (it would fail later)."""
    key, text = source
    return KeyedError(key, f"{text!r} gave a {type(result).__name__}, not a tensor as the module returns")


def _register(
    ledger: Ledger, action: str, target: Target, compute: Compute, source: tuple[str, str], cfg: Any, with_kwargs: bool
) -> None:
    module, name = target.module, target.name
    if with_kwargs:  # the expression or fn reads the keyword inputs: PyTorch hands them to a with_kwargs hook
        _register_with_kwargs(ledger, action, target, compute, source, cfg)
        return
    if not getattr(module, "inplace", False):

        def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            try:  # one frame around compute: this runs on every call of every selected module
                result = compute(m, args, output)
                if not isinstance(result, torch.Tensor) and isinstance(output, torch.Tensor):
                    raise _not_a_tensor(source, result)
                return result
            except Exception as e:
                raise hook_failed(action, name, e) from e

        hook_on(ledger, module.register_forward_hook, hook, cfg)
        return
    pending: list[tuple[Any, ...]] = []

    def keep_inputs(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        pending.append(args)
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    def replace(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        try:
            result = compute(m, pending.pop(), output)
            if not isinstance(result, torch.Tensor) and isinstance(output, torch.Tensor):
                raise _not_a_tensor(source, result)
            return result
        except Exception as e:
            raise hook_failed(action, name, e) from e

    hook_on(ledger, module.register_forward_pre_hook, keep_inputs, cfg)
    hook_on(ledger, module.register_forward_hook, replace, cfg)


def _register_with_kwargs(
    ledger: Ledger, action: str, target: Target, compute: Callable[..., Any], source: tuple[str, str], cfg: Any
) -> None:
    """replace_forward whose compute reads the keyword inputs: ``compute(module, args, output, kwargs)``."""
    module, name = target.module, target.name
    inplace = getattr(module, "inplace", False)
    pending: list[tuple[Any, ...]] = []

    def keep_inputs(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        pending.append(args)
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        try:
            result = compute(m, pending.pop() if inplace else args, output, kwargs)
            if not isinstance(result, torch.Tensor) and isinstance(output, torch.Tensor):
                raise _not_a_tensor(source, result)
            return result
        except Exception as e:
            raise hook_failed(action, name, e) from e

    if inplace:
        hook_on(ledger, module.register_forward_pre_hook, keep_inputs, cfg)
    hook_on(ledger, module.register_forward_hook, hook, cfg, with_kwargs=True)


def _shape_checks(cfg: Any, targets: list[Target], where: str, what: str) -> list[tuple[Target, ShapeCheck]]:
    """Probe-forward checks: ``index`` fits, and a file or tensor source broadcasts onto what it writes."""
    found = source_shape(cfg, where)
    if found is None and cfg.index is None and cfg.heads is None:
        return []
    index = compile_index(cfg.index, f"{where}.index") if cfg.index is not None else None
    shape, source = found if found is not None else (None, "")
    check = ShapeCheck(where, what, cfg.item, index, cfg.index, shape, source, cfg.heads)
    return [(t, check) for t in targets]


def _make_op(cfg: Any, targets: list[Target], ctx: BindContext, var: str) -> Callable[..., Any]:
    """The op of a modify kind, its sources checked against the steps before it."""
    if cfg.function is not None and isinstance(cfg.from_, dict) and "capture" in cfg.from_:
        raise ConfigError(f"{ctx.where}.from: a capture source is read on module calls, not with function:")
    build = make_op(cfg, ctx.where, ctx.seed, ctx.name, var, ctx.safe, SourceContext(ctx.earlier, targets, ctx.root))
    return build if cfg.heads is None else _viewed(build, int(cfg.heads))


def _viewed(build: Callable[..., Any], heads: int) -> Callable[..., Any]:
    """``build`` whose op sees the tensor as ``[..., heads, d_head]`` (the @heads site) and returns it flat again."""

    def build_viewed(ledger: Any = None) -> Callable[..., Any]:
        op = build(ledger)

        def viewed(t: torch.Tensor, m: nn.Module) -> torch.Tensor:
            return op(t.unflatten(-1, (heads, -1)), m).flatten(-2)

        return viewed

    return build_viewed


@KINDS.register()
class ModifyOutput(Kind):
    """An op on the output (or one ``item`` of it, or an ``index`` slice of that)."""

    name = "modify_output"
    choices = ("op", TENSOR_OPS)
    schema = ModifyAction
    mechanism = FORWARD_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check the op (an ``expr`` sees the tensor as ``output``) and the item."""
        if not isinstance(cfg.item, (int, str)) or isinstance(cfg.item, bool):
            raise ConfigError(f"{ctx.where}.item: must be an int position or a str key, got {cfg.item!r}")
        build = _make_op(cfg, targets, ctx, "output")
        action, item = ctx.name, cfg.item
        if cfg.function is not None:
            return inside_step(self, cfg, targets, ctx, modify_on(build, item))

        def apply(ledger: Ledger) -> None:
            ledger.action = action  # a capture source's hook on the model, registered by build, is this action's
            op = build(ledger)
            for target in ledger.each(action, targets, lambda t: t.name):
                name = target.name

                def hook(m: nn.Module, args: tuple[Any, ...], output: Any, name: str = name) -> Any:
                    try:
                        if type(output) is torch.Tensor:  # the common case: no container to pick from
                            return op(output, m)
                        return replace_item(output, item, op(get_item(output, item), m))
                    except Exception as e:
                        raise hook_failed(action, name, e) from e

                hook_on(ledger, target.module.register_forward_hook, hook, cfg)

        checks = _shape_checks(cfg, targets, ctx.where, "output")
        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, shape_checks=checks)


@KINDS.register()
class ModifyInput(Kind):
    """An op on input ``item`` before forward sees it: a position, or a keyword argument's name."""

    name = "modify_input"
    choices = ("op", TENSOR_OPS)
    schema = ModifyAction
    mechanism = FORWARD_PRE_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check the op (an ``expr`` sees the tensor as ``x``); map a named item to its position."""
        item = cfg.item
        if cfg.function is not None:
            raise ConfigError(
                f"{ctx.where}.function: modify_input acts before the forward runs; function: works on capture,"
                " modify_output and replace_forward"
            )
        if not isinstance(item, (int, str)) or isinstance(item, bool):
            raise ConfigError(f"{ctx.where}.item: an input is picked by position or argument name, got {item!r}")
        if isinstance(item, int) and item < 0:
            raise ConfigError(f"{ctx.where}.item: {item}: {_positions_text(targets[0]) if targets else ''}")
        if cfg.prepend and isinstance(cfg.from_, dict) and "capture" in cfg.from_:
            raise ConfigError(
                f"{ctx.where}.prepend: a modify_input reading from: {{capture}} runs after the pre-hook that numbers"
                " each call, so it cannot go first; drop prepend"
            )
        build = _make_op(cfg, targets, ctx, "x")
        positions: dict[int, int | None] = {}
        if isinstance(item, str):
            for target in targets:
                positions[id(target.module)] = input_position(target, item, ctx.where)
        action = ctx.name

        def apply(ledger: Ledger) -> None:
            ledger.action = action  # a capture source's hook on the model, registered by build, is this action's
            op = build(ledger)
            for target in ledger.each(action, targets, lambda t: t.name):
                hook = _input_hook(op, action, target.name, item, positions.get(id(target.module)))
                hook_on(ledger, target.module.register_forward_pre_hook, hook, cfg, with_kwargs=True)

        checks = _shape_checks(cfg, targets, ctx.where, "input")
        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, shape_checks=checks)


def _positions_text(target: Target) -> str:
    """Why a negative input position is refused, with how many positional inputs the module's forward takes."""
    head = "an input is picked by its position from 0, or by argument name"
    params = forward_parameters(target.module)
    if params is None:
        return head
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    more = " (and any number more)" if any(p.kind == p.VAR_POSITIONAL for p in params) else ""
    return (
        f"{head}; {type(target.module).__name__}.forward of {target.name!r} takes {len(names)} positional"
        f" input(s){more}: {', '.join(names) or 'none'}"
    )


def _input_hook(op: Callable, action: str, name: str, item: int | str, position: int | None) -> Callable:
    """A with_kwargs pre-hook changing positional ``item``, or keyword ``item`` wherever it was passed."""

    def pre_hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        try:
            came, at = input_at(args, kwargs, item, position)
            if came is kwargs:
                return args, {**kwargs, item: op(kwargs[item], m)}
            return replace_item(args, at, op(args[at], m)), kwargs
        except Exception as e:
            raise hook_failed(action, name, e) from e

    return pre_hook
