"""Parameter-level kinds on sharded (FSDP1, FSDP2) and data-parallel (DDP) models (SPEC §10).

FSDP2 (``fully_shard``) keeps each parameter as a sharded ``DTensor`` between forwards and computes with
an unsharded ``nn.Parameter`` it all-gathers into (the same object every step). So a tensor hook must sit
on that unsharded parameter, a seeded init draws the whole tensor once and keeps this rank's shard, and a
``fn: linear`` reads the whole weight. FSDP1 flattens parameters into a ``FlatParameter``: per-parameter
values and hooks cannot be honoured there, so those kinds are refused at plan time. DDP all-reduces only
the parameters it saw at wrapping, so changes to the parameter set after wrapping get a plan warning
(``DDP_ADVICE``, each kind's ``ddp_advice`` trait).
Everything here is imported lazily: a model with none of these wrappers never touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from surgery.errors import ConfigError

FSDP1_NAME = "FullyShardedDataParallel"


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole logical tensor of a sharded DTensor (an all-gather every rank takes part in); others as they are."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def fill_whole(tensor: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    """Fill a sharded DTensor as if unsharded: every rank draws the whole tensor and keeps its own shard.

    Every rank seeds the same generator and visits tensors in the same order, so the draw equals the
    unsharded one; ``src_data_rank=None`` takes the local copy's shard without any communication.
    """
    from torch.distributed.tensor import distribute_tensor

    local = tensor.to_local()  # type: ignore[attr-defined]
    full = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=local.device)
    fill(full)
    shard = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)  # type: ignore[attr-defined]
    local.copy_(shard.to_local())


def grad_tensor(root: nn.Module, param: torch.Tensor) -> torch.Tensor:
    """The tensor autograd accumulates ``param``'s gradient into: FSDP2's unsharded parameter, else ``param``.

    FSDP2 creates that parameter at the first all-gather and reuses it after; if none ran yet, one
    unshard/reshard (on every rank, as applying runs everywhere) creates it.
    """
    if not is_dtensor(param):
        return param
    for owner, fsdp_param in _fsdp2_params(root):
        if fsdp_param.sharded_param is param:
            if not hasattr(fsdp_param, "_unsharded_param"):
                owner.unshard()
                owner.reshard()
            return fsdp_param._unsharded_param  # type: ignore[no-any-return]
    return param


def _fsdp2_params(root: nn.Module) -> Iterable[tuple[Any, Any]]:
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    yield module, fsdp_param


def fsdp1_flattened(root: nn.Module) -> tuple[set[int], bool]:
    """Ids of the modules whose parameters FSDP1 manages, and whether any wrapper flattens without original params."""
    managed: set[int] = set()
    flat_only = False
    for module in root.modules():
        if type(module).__name__ == FSDP1_NAME:
            flat_only = flat_only or not getattr(module, "_use_orig_params", True)
            managed.update(id(m) for m in module.modules())
    return managed, flat_only


def refuse_on_fsdp1(targets: Iterable[Any], root: nn.Module, where: str, what: str) -> None:
    """Refuse, at plan time, a per-parameter change or hook on a module whose parameters FSDP1 flattened."""
    managed, _ = fsdp1_flattened(root)
    for target in targets:
        if id(target.module) in managed:
            raise ConfigError(
                f"{where}: {what} on {target.name!r} cannot be honoured under FSDP1 (FullyShardedDataParallel): it"
                " flattens parameters into one FlatParameter, so per-parameter values and gradient hooks are not"
                " the ones autograd and the optimizer use; shard with FSDP2 (torch.distributed.fsdp.fully_shard),"
                " or apply before wrapping"
            )


def fsdp1_hint(root: nn.Module) -> str:
    """A NoMatchError's hint when FSDP1 without ``use_orig_params`` hid every parameter name."""
    _, flat_only = fsdp1_flattened(root)
    if not flat_only:
        return ""
    return (
        " FSDP1 (FullyShardedDataParallel) with use_orig_params=False keeps parameters only as a flattened"
        " _flat_param; wrap with use_orig_params=True or FSDP2 fully_shard to reach them by name."
    )


DDP_ADVICE = {  # each kind names its own as its `ddp_advice` trait; the compiler warns with it
    "add_parameter": "DDP does not all-reduce a parameter added after wrapping, so its gradient differs across ranks;"
    " apply it before wrapping in DistributedDataParallel",
    "freeze": "DDP expects a gradient for every parameter it saw at wrapping, so the next step fails; apply it before"
    " wrapping in DistributedDataParallel, or wrap with find_unused_parameters=True",
    "replace_module": "DDP still reduces the replaced module's parameters, so the next step fails; apply it before"
    " wrapping in DistributedDataParallel",
}
