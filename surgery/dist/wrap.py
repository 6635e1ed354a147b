"""The process group from torchrun's variables, and the model wrapped as ``distributed.wrap`` asks."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from surgery.errors import ConfigError

WRAPS = ("none", "ddp", "fsdp")


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher setting its variables) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def wrap_of(cfg: Any) -> str:
    """``distributed.wrap`` of a composed config: none | ddp | fsdp."""
    node = cfg.get("distributed") or {}
    return str(node.get("wrap") or "none")


def start_group(device: str) -> torch.device:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); the device this rank computes on."""
    if not launched_by_torchrun():
        raise ConfigError(
            "distributed.wrap: needs processes started by torchrun, e.g."
            " torchrun --nproc_per_node=2 -m surgery ... distributed.wrap=ddp"
        )
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local)  # one GPU per local rank
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return local


def wrap_model(model: nn.Module, wrap: str, device: torch.device) -> nn.Module:
    """The model in DDP, or sharded by FSDP2 ``fully_shard``: each block ``fsdp_blocks`` finds, then the root."""
    if wrap == "none" or not dist.is_initialized():
        return model
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in fsdp_blocks(model):
        fully_shard(block, mesh=mesh)
    # The root too goes back to its shards after each forward (FSDP2 keeps a root unsharded by default, to save
    # an all-gather before backward): between calls every parameter is the sharded DTensor surgery planned on,
    # and what remove() checks it restored (embeddings and heads no block holds live in the root).
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """What FSDP2 shards one by one before the root (the way torchtitan and accelerate's transformer-layer policy do).

    A Hugging Face model names its blocks in ``_no_split_modules`` (GPT-2: ``GPT2Block``, so ``transformer.h.*``).
    Otherwise the repeated blocks: each child of a ``ModuleList`` (``fully_shard`` refuses the list itself, which
    has no ``forward``), or of a ``Sequential`` whose children all have one class. A model with neither shards
    each direct child that has parameters. Blocks inside a block are left to it; what no block holds (embeddings,
    a head) is sharded with the root.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names and _has_params(m)]
    if found:
        return _outermost(model, found)
    repeated = [
        child
        for m in model.modules()
        if isinstance(m, nn.ModuleList) or (isinstance(m, nn.Sequential) and _repeats(m))
        for child in m.children()
        if _has_params(child)
    ]
    if repeated:
        return _outermost(model, repeated)
    return [c for c in model.children() if _has_params(c) and not isinstance(c, (nn.ModuleList, nn.ModuleDict))]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _repeats(sequential: nn.Sequential) -> bool:
    """A Sequential of two or more blocks of one class (``Sequential(Block, Block, ...)``), not of mixed layers."""
    classes = {type(c) for c in sequential.children()}
    return len(sequential) > 1 and len(classes) == 1


def _outermost(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """``blocks`` in module order without those inside another of them."""
    chosen = {id(b) for b in blocks}
    kept: list[nn.Module] = []
    prefixes: list[str] = []
    for name, module in model.named_modules():
        if id(module) not in chosen or any(name.startswith(p) for p in prefixes):
            continue
        kept.append(module)
        prefixes.append(f"{name}.")
    return kept
