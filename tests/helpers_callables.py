"""Importable callables for the custom-callable tests (``fn: tests.helpers_callables:NAME``)."""

from __future__ import annotations

from typing import Any

import torch


def double_plus_one(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """A replace_forward fn: 2 * x + 1."""
    return 2 * inputs[0] + 1


def negate(tensor: torch.Tensor) -> torch.Tensor:
    """An op fn."""
    return -tensor


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """An op fn with an argument, for a _target_ node with _partial_: true."""
    return tensor * factor


class BrokenZeroGrad(torch.nn.Module):
    """A model whose zero_grad fails: the runner calls it between runs, so this stands for an internal failure."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise ZeroDivisionError("a bug that is not the user's")
