"""``init``: set parameters by an ``nn.init`` method in one ``Module.apply`` pass under no_grad."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.actions.base import (
    APPLY_PASS,
    KINDS,
    BindContext,
    Kind,
    Step,
    full_name,
    generator_for,
    modules_of,
    tensor_named,
    tensors_named,
    tensors_of,
)
from surgery.actions.from_file import FileSource, copier
from surgery.actions.sharded import fill_whole, is_dtensor, refuse_on_fsdp1
from surgery.core.ledger import Ledger
from surgery.core.schema import INIT_METHODS, InitAction, InitSpec
from surgery.core.select import Target
from surgery.errors import ConfigError

NEEDS_2D = ("xavier_uniform", "xavier_normal", "kaiming_uniform", "kaiming_normal", "orthogonal")


def check_fits(spec: InitSpec, shape: tuple[int, ...], dtype: torch.dtype, where: str) -> None:
    """Refuse a method that cannot fill a tensor of this shape or dtype, before touching it."""
    if not dtype.is_floating_point:
        raise ConfigError(f"{where}: method {spec.method!r} needs a floating-point tensor, this one is {dtype}")
    dims = len(shape)
    if spec.method in NEEDS_2D and dims < 2:
        raise ConfigError(
            f"{where}: method {spec.method!r} needs a tensor of 2 or more dims, this one has shape {list(shape)};"
            " use normal, uniform, constant, zeros or ones"
        )
    if spec.method == "eye" and dims != 2:
        raise ConfigError(f"{where}: method 'eye' needs a 2-D tensor, this one has shape {list(shape)}")
    if spec.method == "dirac" and not 3 <= dims <= 5:
        raise ConfigError(f"{where}: method 'dirac' needs a 3-, 4- or 5-D tensor, this one has shape {list(shape)}")


def fill_(tensor: torch.Tensor, spec: InitSpec, gen: torch.Generator) -> None:
    """Fill ``tensor`` in place by ``spec`` (caller holds no_grad)."""
    m = spec.method
    init = nn.init
    if m == "constant":
        init.constant_(tensor, float(spec.value))  # type: ignore[arg-type]
    elif m == "zeros":
        init.zeros_(tensor)
    elif m == "ones":
        init.ones_(tensor)
    elif m == "normal":
        init.normal_(tensor, _or(spec.mean, 0.0), _or(spec.std, 1.0), generator=gen)
    elif m == "uniform":
        init.uniform_(tensor, _or(spec.a, 0.0), _or(spec.b, 1.0), generator=gen)
    elif m == "trunc_normal":
        mean, std = _or(spec.mean, 0.0), _or(spec.std, 1.0)
        init.trunc_normal_(tensor, mean, std, _or(spec.a, -2.0), _or(spec.b, 2.0), generator=gen)
    elif m in ("xavier_uniform", "xavier_normal"):
        getattr(init, m + "_")(tensor, _or(spec.gain, 1.0), generator=gen)
    elif m in ("kaiming_uniform", "kaiming_normal"):
        mode, nonlinearity = spec.mode or "fan_in", spec.nonlinearity or "leaky_relu"
        getattr(init, m + "_")(tensor, _or(spec.a, 0.0), mode, nonlinearity, generator=gen)
    elif m == "orthogonal":
        init.orthogonal_(tensor, _or(spec.gain, 1.0), generator=gen)
    elif m == "eye":
        init.eye_(tensor)
    elif m == "dirac":
        init.dirac_(tensor)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


@KINDS.register()
class Init(Kind):
    """Set ``param`` of every selected module by ``method``; the old values are kept for undo."""

    name = "init"
    choices = ("method", INIT_METHODS)
    schema = InitAction
    mechanism = APPLY_PASS

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Resolve the parameters and check the method fits each one."""
        found = tensors_of(targets, cfg.param, ctx, allow_empty=cfg.allow_empty)
        refuse_on_fsdp1(modules_of(found), ctx.root, f"{ctx.where}.param", "init")
        source = FileSource(cfg.from_, f"{ctx.where}.from") if cfg.from_ is not None else None
        fills: dict[tuple[int, str], Any] = {}
        for target, pname, spec in found:
            name = full_name(target, pname)
            if source is not None:
                tensor = source.tensor(name, target.name)
                source.check(tensor, f"the key for {name}", spec.shape, spec.dtype)
                fills[(id(target.module), pname)] = copier(tensor)
            else:
                check_fits(cfg, spec.shape, spec.dtype, f"{ctx.where}.method ({name})")
        by_module: dict[int, list[str]] = {}
        for target, pname, _ in found:
            by_module.setdefault(id(target.module), []).append(pname)
        names = {id(t.module): t.name for t, _, _ in found}
        root, action, seed = ctx.root, ctx.name, ctx.seed

        def apply(ledger: Ledger) -> None:
            generators: dict[torch.device, torch.Generator] = {}
            ledger.action = action

            def visit(module: nn.Module) -> None:
                for pname in by_module.get(id(module), ()):
                    ledger.where = f"{names[id(module)]}.{pname}"
                    tensor = tensor_named(module, pname)
                    if tensor.device not in generators:
                        generators[tensor.device] = generator_for(seed, action, tensor.device)
                    fill = fills.get((id(module), pname)) or partial(fill_, spec=cfg, gen=generators[tensor.device])
                    ledger.overwrite(tensor, partial(fill_whole, fill=fill) if is_dtensor(tensor) else fill)

            with torch.no_grad():
                root.apply(visit)

        return Step(ctx.name, self.name, self.mechanism, cfg, modules_of(found), apply, tensors_named(found))
