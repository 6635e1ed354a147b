"""How a harvest feeds the model token ids, and finds each site's per-token tensor in what a capture recorded."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from surgery.core.engine import Surgery
from surgery.errors import ConfigError


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """How every harvest forward passes the token ids: ``input_ids=`` where forward takes it (then no key/value
    cache where there is one), else positionally; ``{"_positional": True}`` marks the latter."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    if "input_ids" not in parameters:
        return {"_positional": True}
    return {"use_cache": False} if "use_cache" in parameters else {}


def run_forward(model: nn.Module, ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """``model`` on a batch of token ids, as :func:`forward_kwargs` says, without autograd."""
    with torch.no_grad():
        if kwargs.get("_positional"):
            model(ids)
        else:
            model(input_ids=ids, **kwargs)


def example_of(ids: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs.get("_positional"):
        return {"example_inputs": (ids,)}
    return {"example_kwargs": {"input_ids": ids, **kwargs}}


def site_tensor(surgery: Surgery, action: str, name: str, rows: int, context: int) -> torch.Tensor:
    """The one call's tensor capture ``action`` recorded on module ``name`` this forward, then forgotten."""
    record = surgery.captures[action][name]
    calls = list(record.calls)
    record.calls.clear()
    if len(calls) != 1:
        raise ConfigError(
            f"harvest.sites: {name} ran {len(calls)} times in one forward; harvest modules that run once per forward"
        )
    call = calls[0]
    for value in (call.output, call.input, call.kwargs):
        found = _per_token(value, rows, context)
        if found is not None:
            return found
    raise ConfigError(
        f"harvest.sites: {name} gives no tensor shaped [rows, context, ...] ({rows}, {context}); harvest modules"
        " whose output has one vector per token"
    )


def _per_token(value: Any, rows: int, context: int) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.dim() >= 2 and tuple(value.shape[:2]) == (rows, context) else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _per_token(item, rows, context)
        if found is not None:
            return found
    return None
