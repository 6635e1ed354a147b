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
    """The model in DDP, or sharded by FSDP2 ``fully_shard`` (each direct child with parameters, then the root)."""
    if wrap == "none" or not dist.is_initialized():
        return model
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
