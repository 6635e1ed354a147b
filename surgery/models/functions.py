"""The seeds' exercise model: four one-weight functions in two layers.

``Function_A..D`` compute ``x + W``, ``x - W``, ``x * W``, ``x / W`` with a 1-element
Parameter ``W``. ``Layer_AB`` takes two inputs, ``a(x1) + b(x2)``; ``Layer_CD`` is
``d(c(x))``. With the default weights the model computes ``((x1 + 2) + (x2 - 1)) * 3 / 2``,
so every number is easy to check by hand.
"""

from __future__ import annotations

import torch
from torch import nn


class _Function(nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.tensor([float(w)]))


class Function_A(_Function):  # noqa: N801 - the seeds' names are part of the exercise
    """x + W."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.W


class Function_B(_Function):  # noqa: N801
    """x - W."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.W


class Function_C(_Function):  # noqa: N801
    """x * W."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.W


class Function_D(_Function):  # noqa: N801
    """x / W."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.W


class Layer_AB(nn.Module):  # noqa: N801
    """A module of two inputs: a(x1) + b(x2)."""

    def __init__(self, w_a: float, w_b: float) -> None:
        super().__init__()
        self.a = Function_A(w_a)
        self.b = Function_B(w_b)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.a(x1) + self.b(x2)


class Layer_CD(nn.Module):  # noqa: N801
    """d(c(x))."""

    def __init__(self, w_c: float, w_d: float) -> None:
        super().__init__()
        self.c = Function_C(w_c)
        self.d = Function_D(w_d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(x))


class Functions(nn.Module):
    """``cd(ab(x1, x2))``: the whole exercise model."""

    def __init__(self, w_a: float = 2.0, w_b: float = 1.0, w_c: float = 3.0, w_d: float = 2.0) -> None:
        super().__init__()
        self.ab = Layer_AB(w_a, w_b)
        self.cd = Layer_CD(w_c, w_d)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.cd(self.ab(x1, x2))
