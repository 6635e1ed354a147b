"""The ops the modify kinds share, built once at plan time into ``tensor -> tensor`` functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from surgery.actions.base import generator_for
from surgery.expr import compile_expr, compile_index
from surgery.schema import OpArgs

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def make_op(cfg: OpArgs, where: str, seed: int, action: str, var: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """Build ``op(tensor, module) -> tensor``; ``var`` is the name the tensor has in an ``expr``."""
    fn = _elementwise(cfg, where, seed, action, var)
    if cfg.index is None:
        return fn
    index = compile_index(cfg.index, f"{where}.index")

    def sliced(t: torch.Tensor, module: Any) -> torch.Tensor:
        out = t.clone()
        out[index] = fn(t[index], module)
        return out

    return sliced


def _elementwise(
    cfg: OpArgs, where: str, seed: int, action: str, var: str
) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    op = cfg.op
    if op == "add":
        value = float(cfg.value)  # type: ignore[arg-type]
        return lambda t, m: t + value
    if op == "mul":
        value = float(cfg.value)  # type: ignore[arg-type]
        return lambda t, m: t * value
    if op == "set":
        value = float(cfg.value)  # type: ignore[arg-type]
        return lambda t, m: torch.full_like(t, value)
    if op == "zero":
        return lambda t, m: torch.zeros_like(t)
    if op == "clamp":
        low, high = cfg.min, cfg.max
        return lambda t, m: t.clamp(low, high)
    if op == "clip_value":
        bound = abs(float(cfg.value))  # type: ignore[arg-type]
        return lambda t, m: t.clamp(-bound, bound)
    if op == "clip_norm":
        max_norm = float(cfg.max_norm)  # type: ignore[arg-type]
        return lambda t, m: t * (max_norm / (torch.linalg.vector_norm(t) + 1e-6)).clamp(max=1.0)
    if op == "mean_ablate":
        dims = tuple(cfg.dim) if isinstance(cfg.dim, (list, tuple)) else (int(cfg.dim),)
        return lambda t, m: t.mean(dim=dims, keepdim=True).expand_as(t)
    if op == "noise":
        return _noise(float(cfg.std), seed, action)  # type: ignore[arg-type]
    if op == "expr":
        expr = compile_expr(str(cfg.expr), f"{where}.expr", names=(var, "module"))
        return lambda t, m: expr(**{var: t, "module": m})
    raise AssertionError(f"op {op!r} passed validation but has no implementation")


def _noise(std: float, seed: int, action: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """Gaussian noise from the action's own generator, so runs repeat exactly."""
    generators: dict[torch.device, torch.Generator] = {}

    def add_noise(t: torch.Tensor, m: Any) -> torch.Tensor:
        gen = generators.get(t.device)
        if gen is None:
            gen = generators[t.device] = generator_for(seed, action, t.device)
        return t + std * torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype)

    return add_noise
