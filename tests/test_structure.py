"""Outputs that are torch's named result tuples keep their type when one item is modified."""

from __future__ import annotations

import torch
from torch import nn

import surgery


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
