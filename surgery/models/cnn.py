"""A small MNIST-sized convolutional net: three conv/norm/activation blocks and a classifier."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WEIGHTS = Path(__file__).resolve().parent / "weights" / "cnn_digits.safetensors"  # scripts/train_cnn.py writes it
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


def conv_block(c_in: int, c_out: int, activation: str) -> nn.Sequential:
    """conv 3×3 → batch norm → activation → 2×2 max pool, named conv, norm, act, pool."""
    block = nn.Sequential()
    block.add_module("conv", nn.Conv2d(c_in, c_out, kernel_size=3, padding=1))
    block.add_module("norm", nn.BatchNorm2d(c_out))
    block.add_module("act", ACTIVATIONS[activation]())
    block.add_module("pool", nn.MaxPool2d(2))
    return block


class CNN(nn.Module):
    """1×28×28 images → class logits through ``block1``..``block3`` and a ``classifier``."""

    def __init__(
        self,
        in_channels: int = 1,
        channels: tuple[int, ...] = (8, 16, 32),
        num_classes: int = 10,
        image_size: int = 28,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        c_in = in_channels
        for i, c_out in enumerate(channels, start=1):
            self.add_module(f"block{i}", conv_block(c_in, c_out, activation))
            c_in = c_out
        side = image_size // 2 ** len(channels)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c_in * side * side, num_classes))
        self.n_blocks = len(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(1, self.n_blocks + 1):
            x = getattr(self, f"block{i}")(x)
        return self.classifier(x)


def digits_cnn(activation: str = "relu", trained: bool = True) -> CNN:
    """The CNN with the shipped weights trained on the digits train split (scripts/train_cnn.py).

    >>> model = digits_cnn().eval()   # about 97 % on the digits test split

    ``trained=False`` gives the same architecture with fresh random weights.
    """
    model = CNN(activation=activation)
    if trained:
        from surgery.files.tensors import read_tensors

        model.load_state_dict(read_tensors(WEIGHTS, "model.trained"))
    return model
