"""On a model sharded by FSDP2, what cannot be honoured is refused at plan time (one process, a gloo group of 1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import nn

import surgery
from surgery.errors import ConfigError


@pytest.fixture
def sharded() -> Iterator[nn.Module]:
    """A two-layer MLP under ``fully_shard`` on a CPU mesh of one rank; the group is torn down afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def test_an_expression_reading_a_sharded_weight_is_refused(sharded: nn.Module) -> None:
    recipe = {"r": {"kind": "replace_forward", "select": "0", "expr": "x @ module.weight.T"}}
    with pytest.raises(ConfigError, match=r"^actions.r.expr: module.weight of '0' is sharded by FSDP2"):
        surgery.plan(sharded, recipe)


def test_add_parameter_on_a_sharded_model_is_refused_a_buffer_is_not(sharded: nn.Module) -> None:
    with pytest.raises(ConfigError, match=r"^actions.b: '2' is in a model sharded by FSDP2"):
        surgery.plan(sharded, {"b": {"kind": "add_parameter", "select": "2", "name": "extra", "shape": [2]}})
    surgery.plan(sharded, {"b": {"kind": "add_buffer", "select": "2", "name": "extra", "shape": [2]}})  # rank-local
