"""Models wrapped by other tools: the torch module tree surgery works on, and the forward signature it reads.

nnsight's ``NNsight(model)`` is no ``nn.Module``: it holds the model as ``_module`` and replaces every
module's ``forward`` with a controller taking ``(*args, **kwargs)``. Surgery works on the inner tree and
reads each module's inputs by its class's ``forward`` signature, so a recipe gives the same numbers on a
wrapped model as on the bare one (docs/behaviour.md).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from surgery.errors import ConfigError


def inner_module(model: Any) -> nn.Module:
    """``model`` itself, or the ``nn.Module`` a wrapper holds (nnsight's envoy tree); refused in one line otherwise."""
    if isinstance(model, nn.Module):
        return model
    inner = vars(model).get("_module") if hasattr(model, "__dict__") else None
    if isinstance(inner, nn.Module):
        return inner
    raise ConfigError(f"model: expected a torch.nn.Module, got {type(model).__name__}; pass the torch module it wraps")


def forward_parameters(module: nn.Module) -> list[inspect.Parameter] | None:
    """The parameters of ``module``'s forward (None: none to read). Where the instance's ``forward`` was replaced
    (nnsight's controller, accelerate's hooks), its class's ``forward`` says what the inputs are."""
    replaced = "forward" in vars(module)
    forward = type(module).forward if replaced else module.forward
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:] if replaced else params  # the class's function still lists self
