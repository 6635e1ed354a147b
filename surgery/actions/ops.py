"""The ops the modify kinds share, checked at plan time and built per apply.

``make_op`` validates everything (expressions, callables, patch sources) once and returns a
factory; each apply calls it for a fresh ``op(tensor, module) -> tensor`` so per-run state
(the noise stream's call counter) starts from the seed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from surgery.actions.base import KeyedError, seed_for
from surgery.actions.noise import noise_stream
from surgery.actions.sources import load_patch, source_op, source_shape
from surgery.core.callables import resolve_callable
from surgery.core.schema import OpArgs
from surgery.expr.check import compile_expr
from surgery.expr.parsing import compile_index

Op = Callable[[torch.Tensor, Any], torch.Tensor]


def make_op(
    cfg: OpArgs, where: str, seed: int, action: str, var: str, safe: bool, sources: Any = None
) -> Callable[..., Op]:
    """Check the op now; return ``build(ledger=None)`` giving ``op(tensor, module)``. ``var`` names the tensor in an
    expr. ``sources`` (a ``SourceContext``: earlier steps, matched modules) lets ``from: {capture}`` be checked;
    such an op reads the captures of the ``ledger`` given to ``build``."""
    index = compile_index(cfg.index, f"{where}.index") if cfg.index is not None else None
    if cfg.from_ is not None or isinstance(cfg.value, torch.Tensor):
        return source_op(cfg, where, safe, index, sources)
    build = _elementwise(cfg, where, seed, action, var, safe)
    if index is None:
        return lambda ledger=None: build()

    def build_sliced(ledger: Any = None) -> Op:
        fn = build()

        def sliced(t: torch.Tensor, module: Any) -> torch.Tensor:
            try:
                part = t[index]
            except IndexError as e:
                raise KeyedError("index", f"{cfg.index} does not fit a tensor of shape {list(t.shape)}: {e}") from e
            out = t.clone()
            out[index] = fn(part, module)
            return out

        return sliced

    return build_sliced


def _elementwise(cfg: OpArgs, where: str, seed: int, action: str, var: str, safe: bool) -> Callable[[], Op]:
    op = cfg.op
    if op in ("add", "mul", "set"):
        value = float(cfg.value)  # type: ignore[arg-type]
        value = value * cfg.scale if cfg.scale is not None else value
        if op == "add":
            return lambda: lambda t, m: t + value
        if op == "mul":
            return lambda: lambda t, m: t * value
        return lambda: lambda t, m: torch.full_like(t, value)
    if op == "zero":
        return lambda: lambda t, m: torch.zeros_like(t)
    if op == "clamp":
        low, high = cfg.min, cfg.max
        return lambda: lambda t, m: t.clamp(low, high)
    if op == "clip_value":
        bound = abs(float(cfg.value))  # type: ignore[arg-type]
        return lambda: lambda t, m: t.clamp(-bound, bound)
    if op == "clip_norm":
        max_norm = float(cfg.max_norm)  # type: ignore[arg-type]
        return lambda: lambda t, m: t * (max_norm / (torch.linalg.vector_norm(t) + 1e-6)).clamp(max=1.0)
    if op == "mean_ablate":
        dims = tuple(cfg.dim) if isinstance(cfg.dim, (list, tuple)) else (int(cfg.dim),)
        return lambda: _mean_ablate(dims)
    if op == "noise":
        std = float(cfg.std)  # type: ignore[arg-type]
        key = cfg.seed if cfg.seed is not None else seed_for(seed, action)  # hashed once: Dynamo cannot trace sha256
        return lambda: _noise(std, key, replay=var != "grad")  # forward hooks may be recomputed by checkpointing
    if op == "expr":
        expr = compile_expr(str(cfg.expr), f"{where}.expr", names=(var, "module"))
        op_fn = expr.bind(var, "module")
        return lambda: op_fn
    if op == "fn":
        fn = resolve_callable(cfg.fn, f"{where}.fn", safe)
        return lambda: lambda t, m: fn(t)
    raise AssertionError(f"op {op!r} passed validation but has no implementation")


def _mean_ablate(dims: tuple[int, ...]) -> Op:
    def ablate(t: torch.Tensor, m: Any) -> torch.Tensor:
        try:  # owned memory laid out like t: an expand_as view breaks a following in-place op (ReLU(inplace=True))
            return torch.empty_like(t).copy_(t.mean(dim=dims, keepdim=True))
        except IndexError as e:
            raise KeyedError("dim", f"{e} (the tensor is {list(t.shape)})") from e

    return ablate


def _noise(std: float, key: int, replay: bool) -> Op:
    """Gaussian noise from the action's own counter-based stream: new each call, the same each run, and the same
    again when activation checkpointing recomputes the call (``replay``)."""
    draw = noise_stream(key, std, replay)

    def add_noise(t: torch.Tensor, m: Any) -> torch.Tensor:
        if not t.is_floating_point():
            raise KeyedError("op", f"noise needs a floating-point tensor, this one is {t.dtype}")
        return t + draw(t, id(m))

    return add_noise


__all__ = ["Op", "load_patch", "make_op", "source_shape"]
