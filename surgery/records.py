"""What captures hold: one ``Record`` per (action, module or parameter), one ``Call`` per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from surgery.errors import SurgeryError


@dataclass
class Call:
    """One forward or backward call as seen by a hook; fields not captured stay None."""

    input: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    output: Any = None
    grad_input: tuple[torch.Tensor | None, ...] | None = None
    grad_output: tuple[torch.Tensor | None, ...] | None = None
    grad: torch.Tensor | None = None


class Record:
    """Every call recorded for one module (or parameter) by one action; attributes read the last."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.calls: list[Call] = []

    def _last(self) -> Call:
        if not self.calls:
            raise SurgeryError(f"{self.key}: no call was recorded (did the model run through it?)")
        return self.calls[-1]

    @property
    def input(self) -> tuple[Any, ...] | None:
        """Positional inputs of the last call."""
        return self._last().input

    @property
    def kwargs(self) -> dict[str, Any] | None:
        """Keyword inputs of the last call (captured with ``what: input``)."""
        return self._last().kwargs

    @property
    def output(self) -> Any:
        """Output of the last call."""
        return self._last().output

    @property
    def grad_input(self) -> tuple[torch.Tensor | None, ...] | None:
        """Gradients w.r.t. the module's inputs in the last backward call."""
        return self._last().grad_input

    @property
    def grad_output(self) -> tuple[torch.Tensor | None, ...] | None:
        """Gradients w.r.t. the module's outputs in the last backward call."""
        return self._last().grad_output

    @property
    def grad(self) -> torch.Tensor | None:
        """The parameter's gradient in the last backward call (``capture_grad`` with ``param``)."""
        return self._last().grad

    def __repr__(self) -> str:
        return f"Record({self.key!r}, calls={len(self.calls)})"


def detached(value: Any) -> Any:
    """Detach tensors inside tuples/lists/dicts so records hold no autograd graph."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(detached(v) for v in value)
    if isinstance(value, list):
        return [detached(v) for v in value]
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    return value
