"""A plain multi-layer perceptron: ``layers.0..N-1`` of Linear + activation, then ``head``."""

from __future__ import annotations

import torch
from torch import nn

from surgery.models.cnn import ACTIVATIONS


class MLP(nn.Module):
    """``depth`` hidden blocks (``layers.i.fc``, ``layers.i.act``) then a Linear ``head``."""

    def __init__(
        self,
        in_features: int = 16,
        hidden: int = 32,
        depth: int = 3,
        out_features: int = 4,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        widths = [in_features] + [hidden] * depth
        self.layers = nn.ModuleList()
        for w_in, w_out in zip(widths[:-1], widths[1:]):
            block = nn.Sequential()
            block.add_module("fc", nn.Linear(w_in, w_out))
            block.add_module("act", ACTIVATIONS[activation]())
            self.layers.append(block)
        self.head = nn.Linear(widths[-1], out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
