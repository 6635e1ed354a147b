"""Tiny models and helpers shared by the tests: build fast, check restores exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from surgery.core.engine import hooks_on
from surgery.models.functions import Functions


class TinyNet(nn.Module):
    """conv → norm → relu(inplace) → pool → fc: every common layer kind in a few hundred weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.act(self.norm(self.conv(x)))).flatten(1))


class PairOut(nn.Module):
    """Returns a tuple, like many third-party blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y * 2


@dataclass
class Snapshot:
    """Everything remove() must give back: tensors bit for bit, flags, names, hook count."""

    state: dict[str, torch.Tensor]
    requires_grad: dict[str, bool]
    hooks: int

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        """Take a deep snapshot of the model."""
        return cls(
            {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
            {k: p.requires_grad for k, p in model.named_parameters()},
            hooks_on(model),
        )

    def assert_same(self, model: nn.Module) -> None:
        """The model is bit-identical to the snapshot and carries no extra hook."""
        now = Snapshot.of(model)
        assert list(now.state) == list(self.state)
        for key, value in self.state.items():
            assert now.state[key].dtype == value.dtype, key
            assert torch.equal(now.state[key], value), key
        assert now.requires_grad == self.requires_grad
        assert now.hooks == self.hooks


@pytest.fixture
def tiny() -> TinyNet:
    """A seeded TinyNet in eval mode."""
    torch.manual_seed(0)
    return TinyNet().eval()


@pytest.fixture
def functions() -> Functions:
    """The seeds' exercise model with its default weights."""
    return Functions()


@pytest.fixture
def x_img() -> torch.Tensor:
    """A batch of two 1×6×6 images."""
    return torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def x12() -> tuple[torch.Tensor, torch.Tensor]:
    """The two inputs of the functions model: x1 = [1, 2], x2 = [3, 4] as columns."""
    return torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])


def run_both(model: nn.Module, *inputs: Any) -> Any:
    """Forward then backward of the output sum, with inputs that require grad."""
    inputs = tuple(x.detach().requires_grad_(True) for x in inputs)
    out = model(*inputs)
    first = out[0] if isinstance(out, tuple) else out
    first.sum().backward()
    return out
