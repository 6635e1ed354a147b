"""On a model sharded by FSDP2, what cannot be honoured is refused at plan time (one process, a gloo group of 1)."""

from __future__ import annotations

import pytest
from torch import nn

import surgery
from surgery.errors import ConfigError
from tests.conftest import fully_shard_one_rank


@pytest.fixture
def sharded(gloo_group: None) -> nn.Module:
    """A two-layer MLP under ``fully_shard`` on a CPU mesh of one rank."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return fully_shard_one_rank(model, (model[0], model[2]))


def test_an_expression_reading_a_sharded_weight_is_refused(sharded: nn.Module) -> None:
    recipe = {"r": {"kind": "replace_forward", "select": "0", "expr": "x @ module.weight.T"}}
    with pytest.raises(ConfigError) as info:
        surgery.plan(sharded, recipe)
    assert str(info.value) == (
        "actions.r.expr: module.weight of '0' is sharded by FSDP2 (a DTensor): an expression would compute with this"
        " rank's shard only; apply the surgery before fully_shard, or use replace_forward fn: linear, which reads the"
        " whole weight"
    )


def test_add_parameter_on_a_sharded_model_is_refused_a_buffer_is_not(sharded: nn.Module) -> None:
    with pytest.raises(ConfigError, match=r"^actions.b: '2' is in a model sharded by FSDP2"):
        surgery.plan(sharded, {"b": {"kind": "add_parameter", "select": "2", "name": "extra", "shape": [2]}})
    surgery.plan(sharded, {"b": {"kind": "add_buffer", "select": "2", "name": "extra", "shape": [2]}})  # rank-local
