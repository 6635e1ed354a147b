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


class FailsSecondTime(torch.nn.Module):
    """A model whose second forward fails: the surgered run after the original one, an internal failure."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise ZeroDivisionError("a bug that is not the user's")
        return self.lin(x)
