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
