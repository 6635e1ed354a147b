"""What every action kind shares beyond ``surgery.core.steps`` (re-exported here): hooks, tensor lookups, seeds.

A kind validates its config against the modules it matched (``bind``, at plan time,
touching nothing) and returns the function that performs it (``apply``, given the
``Ledger`` that owns every change). Kinds never import the engine or the CLI.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.actions.sharded import fsdp1_hint, is_dtensor, refuse_on_fsdp1
from surgery.core.calls import CallCounter, gated, parse_calls
from surgery.core.globs import compile_globs
from surgery.core.ledger import Ledger
from surgery.core.select import Target, closest_names, select_params
from surgery.core.steps import (  # noqa: F401 - re-exported: every kind file takes these from here
    APPLY_PASS,
    FORWARD_HOOK,
    FORWARD_PRE_HOOK,
    FULL_BACKWARD_HOOK,
    FULL_BACKWARD_PRE_HOOK,
    KINDS,
    STATE_DICT_HOOK,
    TENSOR_HOOK,
    BindContext,
    Kind,
    ShapeCheck,
    Step,
    TensorSpec,
)
from surgery.core.wrapped import forward_parameters
from surgery.errors import ActionError, ConfigError, NoMatchError, SurgeryError, did_you_mean


def hook_on(ledger: Ledger, register: Callable[..., Any], hook: Callable, cfg: Any, **options: Any) -> Any:
    """``ledger.hook(register, hook, **options)`` with the action's ``calls`` and ``prepend`` applied.

    ``calls`` wraps the hook so it acts only on the selected calls of this module (its own counter, reset by
    ``Surgery.reset_calls``); ``prepend`` is PyTorch's own ``prepend=True``. Every hook kind registers through here.
    """
    wanted = parse_calls(cfg.calls)  # every kind that hooks has calls and prepend (schema: Hooked)
    if wanted is not None:
        counter = CallCounter()
        ledger.counters.append(counter)
        hook = gated(hook, wanted, counter)
    if cfg.prepend:
        options["prepend"] = True
    return ledger.hook(register, hook, **options)


def full_name(target: Target, tensor_name: str) -> str:
    """The dotted name of a module's tensor as in ``named_parameters()`` (canonical)."""
    return tensor_name if target.name == "<root>" else f"{target.name}.{tensor_name}"


def tensors_of(
    targets: list[Target], pattern: str, ctx: BindContext, allow_empty: bool
) -> list[tuple[Target, str, TensorSpec]]:
    """(module, parameter name, spec) for each own parameter matching ``pattern``, added ones included.

    Modules with no matching parameter drop out; matching nothing anywhere is a NoMatchError
    under ``strict`` that lists the parameter names the selected modules do have.
    """
    if "." in pattern:
        raise ConfigError(
            f"{ctx.where}.param: {pattern!r}: a tensor name has no '.'; pick the submodule with select"
            f" (e.g. select: ...{pattern.rsplit('.', 1)[0]}, param: {pattern.rsplit('.', 1)[1]})"
        )
    found: list[tuple[Target, str, TensorSpec]] = []
    seen_names: list[str] = []
    matches = compile_globs([pattern], f"{ctx.where}.param")
    for target in targets:
        own = {n: TensorSpec(tuple(t.shape), t.dtype, "parameters") for n, t in select_params(target, "*", ctx.where)}
        own.update({n: s for n, s in ctx.added.get(id(target.module), {}).items() if s.kind == "parameters"})
        seen_names.extend(own)
        found.extend((target, n, spec) for n, spec in own.items() if matches(n))
    if not found and ctx.strict and not allow_empty:
        names = sorted(set(seen_names))
        hint = f" Closest parameter names: {', '.join(closest_names(pattern, names))}." if names else ""
        raise NoMatchError(
            f"{ctx.where}.param: {pattern!r} matched no parameter of the {len(targets)} selected module(s).{hint}"
            f"{fsdp1_hint(ctx.root)} Set allow_empty: true if that is expected."
        )
    return found


def check_grad_hooks(found: list[tuple[Target, str, TensorSpec]], ctx: BindContext) -> None:
    """A tensor hook needs a parameter that requires grad when the hook is registered; refuse it now."""
    refuse_on_fsdp1(modules_of(found), ctx.root, f"{ctx.where}.param", "a gradient hook")
    for target, name, _ in found:
        tensor = find_tensor(target.module, name)
        if tensor is None:
            continue  # added by an earlier action: a new parameter requires grad unless configured otherwise
        if not ctx.requires_grad.get(id(tensor), tensor.requires_grad):
            raise ConfigError(
                f"{ctx.where}.param: {full_name(target, name)} does not have requires_grad (frozen by the model or an"
                " earlier action), so no gradient hook can be registered on it; unfreeze it first or leave it out"
            )


def check_module_reads(reads: frozenset[str], targets: list[Target], ctx: BindContext, key: str) -> None:
    """Every ``module.NAME`` an expression reads must exist on each selected module (or be added before)."""
    for target in targets:
        module = target.module
        added = ctx.added.get(id(module), {})
        for name in sorted(reads):
            if is_dtensor(module._parameters.get(name)):  # what the expression would see is this rank's shard
                raise ConfigError(
                    f"{ctx.where}.{key}: module.{name} of {target.name!r} is sharded by FSDP2 (a DTensor): an"
                    " expression would compute with this rank's shard only; apply the surgery before fully_shard,"
                    " or use replace_forward fn: linear, which reads the whole weight"
                )
            if name in module._parameters or name in module._buffers or name in module._modules or name in added:
                continue
            if isinstance(module.__dict__.get(name), (int, float, bool, tuple)):
                continue
            readable = list(module._parameters) + list(module._buffers) + list(added)
            raise ConfigError(
                f"{ctx.where}.{key}: module.{name}: {target.name!r} ({type(module).__name__}) has no parameter, buffer"
                f" or number {name!r}.{did_you_mean(name, readable)} Its tensors: {', '.join(readable) or 'none'}"
            )


def modules_of(found: list[tuple[Target, str, TensorSpec]]) -> list[Target]:
    """The distinct modules of (module, tensor, spec) triples, in order."""
    return list(dict.fromkeys(t for t, _, _ in found))


def tensors_named(found: list[tuple[Target, str, TensorSpec]]) -> list[str]:
    """Full dotted names of (module, tensor, spec) triples, for the plan table."""
    return [full_name(t, n) for t, n, _ in found]


def seed_for(seed: int, action: str) -> int:
    """The action's own 63-bit seed, from the run seed and the action name (sha256, so stable everywhere)."""
    digest = hashlib.sha256(f"{seed}/{action}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator_for(seed: int, action: str, device: torch.device) -> torch.Generator:
    """A generator seeded from the run seed and the action name, so runs are reproducible."""
    # meta has no generator, and nothing is drawn there: torch's init functions accept a cpu one for meta tensors
    gen = torch.Generator(device="cpu" if device.type == "meta" else device)
    gen.manual_seed(seed_for(seed, action))
    return gen


def find_tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The module's own parameter or buffer ``name``, or None."""
    tensor: torch.Tensor | None = module._parameters.get(name)
    return module._buffers.get(name) if tensor is None else tensor


def tensor_named(module: nn.Module, name: str) -> torch.Tensor:
    """The module's own parameter or buffer ``name`` (looked up at apply time)."""
    tensor = find_tensor(module, name)
    if tensor is None:
        raise KeyError(f"module has no parameter or buffer {name!r}")
    return tensor


class KeyedError(Exception):
    """A hook failure that one config key explains (``item``, ``dim``, ``index``, ``expr``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def hook_failed(action: str, name: str, error: Exception, on: str = "module") -> ActionError:
    """The error a hook raises when its body fails: one line naming the action (and key) and the module."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, KeyedError):
        return ActionError(f"actions.{action}.{error.key} on {on} {name!r}: {text}")
    if isinstance(error, SurgeryError) and text.startswith(f"actions.{action}") and ": " in text:
        where, rest = text.split(": ", 1)  # already says which key failed: add the module
        return ActionError(f"{where} on {on} {name!r}: {rest}")
    if isinstance(error, SurgeryError):
        return ActionError(f"actions.{action} on {on} {name!r}: {text}")
    return ActionError(f"actions.{action} on {on} {name!r}: {type(error).__name__}: {text}")


def input_position(target: Target, name: str, where: str) -> int | None:
    """Where input ``name`` sits among the positional inputs of ``forward`` (None: keyword only).

    A name ``forward`` does not take (and no ``**kwargs`` to take it) is a ConfigError.
    """
    params = forward_parameters(target.module)
    if params is None:  # no signature to read: trust the config
        return None
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if name not in names and not any(p.kind == p.VAR_KEYWORD for p in params):
        raise ConfigError(
            f"{where}.item: {type(target.module).__name__}.forward of {target.name!r} has no input {name!r};"
            f" its inputs: {', '.join(names) or 'none'}"
        )
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None


def input_at(args: tuple[Any, ...], kwargs: dict[str, Any], item: int | str, position: int | None) -> tuple[Any, Any]:
    """Where input ``item`` came in: ``(kwargs, item)`` by keyword, else ``(args, i)`` (``position`` for a name).

    An input that was not passed is a KeyedError on ``item`` saying what the module got.
    """
    if isinstance(item, str) and item in kwargs:
        return kwargs, item
    at = item if isinstance(item, int) else position
    if at is None or not 0 <= at < len(args):
        got = f"{len(args)} positional input(s) and keywords {sorted(kwargs)}"
        raise KeyedError("item", f"input {item!r} was not passed; the module got {got}")
    return args, at


def with_input(args: tuple[Any, ...], kwargs: dict[str, Any], at: int | str, new: Any) -> tuple[Any, Any]:
    """A forward pre-hook's ``(args, kwargs)`` with the input :func:`input_at` found at ``at`` replaced by ``new``."""
    if isinstance(at, str):
        return args, {**kwargs, at: new}
    return (*args[:at], new, *args[at + 1 :]), kwargs
