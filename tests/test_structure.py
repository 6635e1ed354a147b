"""Items of module outputs: torch's named result tuples keep their type; an item that does not fit is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ConfigError


class MaxOverLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.return_types.max:
        return torch.max(x, -1)


def test_modify_output_item_of_torch_max_keeps_values_and_indices() -> None:
    model = nn.Sequential()
    model.add_module("pick", MaxOverLast())
    x = torch.tensor([[1.0, 5.0, 2.0], [-3.0, -1.0, -2.0]])
    config = {"double": {"kind": "modify_output", "select": "pick", "item": 0, "op": "mul", "value": 2.0}}
    with surgery.apply(model, config):
        out = model.pick(x)
    assert type(out) is torch.return_types.max
    assert torch.equal(out.values, torch.tensor([10.0, -2.0])) and torch.equal(out.indices, torch.tensor([1, 1]))
    plain = model.pick(x)
    assert type(plain) is torch.return_types.max and torch.equal(plain.values, torch.tensor([5.0, -1.0]))


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x - 1


def test_an_item_that_does_not_fit_the_example_output_is_a_config_error_at_plan_time() -> None:
    model = nn.Sequential()
    model.add_module("pair", Pair())
    x = torch.zeros(2, 3)
    for item, why in [(5, "tuple index out of range"), ("k", "a tuple is indexed by position, got item 'k'")]:
        config = {"c": {"kind": "capture", "select": "pair", "item": item}}
        with pytest.raises(ConfigError) as info:
            surgery.plan(model, config, example_inputs=(x,))
        assert str(info.value) == f"actions.c.item: {item!r} does not fit the output of 'pair' on this input: {why}"
