"""Parameter-level apply passes: ``add_parameter``, ``add_buffer``, ``freeze``, ``unfreeze``."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from surgery.actions.base import (
    APPLY_PASS,
    KINDS,
    BindContext,
    Kind,
    Step,
    TensorSpec,
    find_tensor,
    full_name,
    generator_for,
    modules_of,
    tensor_named,
    tensors_named,
    tensors_of,
)
from surgery.actions.from_file import FileSource, copier
from surgery.actions.init import check_fits, fill_
from surgery.actions.sharded import DDP_ADVICE, is_dtensor
from surgery.core.ledger import Ledger
from surgery.core.limits import check_memory
from surgery.core.schema import INIT_METHODS, AddBufferAction, AddParameterAction, FreezeAction
from surgery.core.select import Target
from surgery.errors import ConfigError


def _home(module: nn.Module, root: nn.Module) -> tuple[torch.dtype, torch.device]:
    """dtype and device for a new tensor: the module's own first tensor, else the model's."""
    for source in (module, root):
        for tensor in list(source.parameters()) + list(source.buffers()):
            if tensor.is_floating_point():
                return tensor.dtype, tensor.device
    return torch.get_default_dtype(), torch.device("cpu")


def _memory_of(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes (None when it cannot be told)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError, AssertionError):
        pass
    return None


def _check_size(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, ctx: BindContext) -> None:
    """Refuse now a tensor larger than its device's memory: the allocator would fail at apply, naming no key."""
    limit = _memory_of(device)
    size = math.prod(shape) * dtype.itemsize
    if limit is not None and size > limit:
        raise ConfigError(
            f"{ctx.where}.shape: {list(shape)} is {math.prod(shape):,} elements of {str(dtype).removeprefix('torch.')}"
            f" ({_bytes(size)}), more than all the memory of {device.type} ({_bytes(limit)}); check the sizes"
        )


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class AddTensor(Kind):
    """Register a new tensor ``name`` on every selected module; removed again on undo."""

    mechanism = APPLY_PASS
    tensor_kind = "parameters"
    adds = True

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check the name is free and the shape and init fit, for every module."""
        plans: dict[int, tuple[Target, tuple[int, ...], torch.dtype, torch.device]] = {}
        source = FileSource(cfg.init.from_, f"{ctx.where}.init.from") if cfg.init.from_ is not None else None
        fills: dict[int, Any] = {}
        for target in targets:
            module = target.module
            taken = ctx.added.get(id(module), {})
            if cfg.name in taken or hasattr(module, cfg.name):
                raise ConfigError(
                    f"{ctx.where}.name: module {target.name!r} ({type(module).__name__}) already has an"
                    f" attribute {cfg.name!r}; choose another name"
                )
            if self.tensor_kind == "parameters" and any(is_dtensor(t) for t in ctx.root.parameters()):
                raise ConfigError(
                    f"{ctx.where}: {target.name!r} is in a model sharded by FSDP2: a parameter added now is not one"
                    " FSDP shards, gathers or reduces, so ranks would train it apart; add it before fully_shard"
                )
            dtype, device = _home(module, ctx.root)
            loaded = source.tensor(full_name(target, cfg.name), target.name) if source is not None else None
            if cfg.like is not None:
                like = _like(module, cfg.like, taken, target, ctx)
                shape, dtype = like.shape, like.dtype
            elif cfg.shape is None and loaded is not None:
                shape = tuple(loaded.shape)
            else:
                shape = tuple(cfg.shape)
                size = math.prod(shape) * dtype.itemsize * len(targets)  # one per selected module, before any exists
                check_memory(size, f"{ctx.where}.shape", f"{len(targets):,} × {list(shape)} {str(dtype)[6:]}")
                _check_size(shape, dtype, device, ctx)
            if source is not None and loaded is not None:
                source.check(loaded, f"the key for {full_name(target, cfg.name)}", shape, dtype)
                fills[id(module)] = copier(loaded)
            else:
                check_fits(cfg.init, shape, dtype, f"{ctx.where}.init.method ({full_name(target, cfg.name)})")
            plans[id(module)] = (target, shape, dtype, device)
            ctx.added.setdefault(id(module), {})[cfg.name] = TensorSpec(shape, dtype, self.tensor_kind)
        if cfg.like is not None:
            copied = sum(math.prod(shape) * dtype.itemsize for _target, shape, dtype, _device in plans.values())
            check_memory(copied, f"{ctx.where}.like", f"{len(plans):,} copies of the shape of {cfg.like}")
        root, action, seed = ctx.root, ctx.name, ctx.seed
        register = self.register

        def apply(ledger: Ledger) -> None:
            generators: dict[torch.device, torch.Generator] = {}
            ledger.action = action

            def visit(module: nn.Module) -> None:
                if id(module) not in plans:
                    return
                target, shape, dtype, device = plans[id(module)]
                ledger.where = target.name
                if device not in generators:
                    generators[device] = generator_for(seed, action, device)
                tensor = torch.empty(shape, dtype=dtype, device=device)
                if id(module) in fills:
                    fills[id(module)](tensor)
                else:
                    fill_(tensor, cfg.init, generators[device])
                register(ledger, module, cfg, tensor)

            with torch.no_grad():
                root.apply(visit)

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, [full_name(t, cfg.name) for t in targets])

    def register(self, ledger: Ledger, module: nn.Module, cfg: Any, tensor: torch.Tensor) -> None:
        """Attach the new tensor to the module through the ledger."""
        raise NotImplementedError


def _like(module: nn.Module, name: str, taken: dict[str, TensorSpec], target: Target, ctx: BindContext) -> TensorSpec:
    if name in taken:
        return taken[name]
    tensor = find_tensor(module, name)
    if tensor is None:
        own = list(module._parameters) + list(module._buffers)
        raise ConfigError(
            f"{ctx.where}.like: module {target.name!r} has no parameter or buffer {name!r};"
            f" it has: {', '.join(own) or 'none'}"
        )
    return TensorSpec(tuple(tensor.shape), tensor.dtype, "parameters")


@KINDS.register()
class AddParameter(AddTensor):
    """An ``nn.Parameter`` of ``shape`` (or ``like``) filled by ``init``."""

    name = "add_parameter"
    choices = ("init.method", INIT_METHODS)
    schema = AddParameterAction
    ddp_advice = DDP_ADVICE["add_parameter"]

    def register(self, ledger: Ledger, module: nn.Module, cfg: Any, tensor: torch.Tensor) -> None:
        """Register as a Parameter with the configured requires_grad."""
        ledger.add_tensor(module, cfg.name, nn.Parameter(tensor, requires_grad=cfg.requires_grad), "parameters")


@KINDS.register()
class AddBuffer(AddTensor):
    """A buffer of ``shape`` (or ``like``) filled by ``init``; ``persistent`` or not."""

    name = "add_buffer"
    choices = ("init.method", INIT_METHODS)
    schema = AddBufferAction
    tensor_kind = "buffers"

    def register(self, ledger: Ledger, module: nn.Module, cfg: Any, tensor: torch.Tensor) -> None:
        """Register as a buffer."""
        ledger.add_tensor(module, cfg.name, tensor, "buffers", persistent=cfg.persistent)


class SetRequiresGrad(Kind):
    """Set ``requires_grad`` on the selected parameters; the old flags are kept for undo."""

    schema = FreezeAction
    mechanism = APPLY_PASS
    flag = False

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Resolve the parameters now; flip their flags at apply time."""
        found = tensors_of(targets, cfg.param, ctx, allow_empty=cfg.allow_empty)
        by_module: dict[int, list[str]] = {}
        for target, pname, _ in found:
            by_module.setdefault(id(target.module), []).append(pname)
            tensor = find_tensor(target.module, pname)
            if tensor is not None:
                ctx.requires_grad[id(tensor)] = self.flag
        root, action, flag = ctx.root, ctx.name, self.flag

        def apply(ledger: Ledger) -> None:
            ledger.action = action

            def visit(module: nn.Module) -> None:
                for pname in by_module.get(id(module), ()):
                    ledger.set_attr(tensor_named(module, pname), "requires_grad", flag)

            root.apply(visit)

        return Step(ctx.name, self.name, self.mechanism, cfg, modules_of(found), apply, tensors_named(found))


@KINDS.register()
class Freeze(SetRequiresGrad):
    """Set requires_grad = False on the selected parameters; undo restores each flag."""

    name = "freeze"
    flag = False
    ddp_advice = DDP_ADVICE["freeze"]


@KINDS.register()
class Unfreeze(SetRequiresGrad):
    """Set requires_grad = True on the selected parameters; undo restores each flag."""

    name = "unfreeze"
    flag = True
