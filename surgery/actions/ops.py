"""The ops the modify kinds share, checked at plan time and built per apply.

``make_op`` validates everything (expressions, callables, patch sources) once and returns a
factory; each apply calls it for a fresh ``op(tensor, module) -> tensor`` so per-run state
(the noise stream's call counter) starts from the seed again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from surgery.actions.base import KeyedError, seed_for
from surgery.actions.noise import noise_stream
from surgery.core.callables import resolve_callable
from surgery.core.schema import OpArgs
from surgery.errors import ActionError, ConfigError, did_you_mean
from surgery.expr.check import compile_expr, compile_index

Op = Callable[[torch.Tensor, Any], torch.Tensor]


def make_op(cfg: OpArgs, where: str, seed: int, action: str, var: str, safe: bool = False) -> Callable[[], Op]:
    """Check the op now; return ``build()`` giving ``op(tensor, module)``. ``var`` names the tensor in an expr."""
    index = compile_index(cfg.index, f"{where}.index") if cfg.index is not None else None
    build = _elementwise(cfg, where, seed, action, var, safe, index)
    if index is None:
        return build

    def build_sliced() -> Op:
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


def _elementwise(
    cfg: OpArgs, where: str, seed: int, action: str, var: str, safe: bool, index: tuple | None
) -> Callable[[], Op]:
    op = cfg.op
    if op == "add":
        value = float(cfg.value)  # type: ignore[arg-type]
        return lambda: lambda t, m: t + value
    if op == "mul":
        value = float(cfg.value)  # type: ignore[arg-type]
        return lambda: lambda t, m: t * value
    if op == "set":
        value = float(cfg.value)  # type: ignore[arg-type]
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
        key = seed_for(seed, action)  # hashed once here: Dynamo cannot trace sha256 inside a hook
        return lambda: _noise(std, key, replay=var != "grad")  # forward hooks may be recomputed by checkpointing
    if op == "expr":
        expr = compile_expr(str(cfg.expr), f"{where}.expr", names=(var, "module"))
        op_fn = expr.bind(var, "module")
        return lambda: op_fn
    if op == "fn":
        fn = resolve_callable(cfg.fn, f"{where}.fn", safe)
        return lambda: lambda t, m: fn(t)
    if op == "patch":
        source = load_patch(cfg.from_, f"{where}.from")
        patch = source[index] if index is not None else source
        return lambda: _patch(patch, f"{where}.from", cfg.from_["key"])
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


def load_patch(source: dict[str, str], where: str) -> torch.Tensor:
    """The captured tensor ``source['key']`` of ``source['file']`` (a captures.safetensors)."""
    from safetensors import safe_open

    from surgery.core.tensors import owned

    path = Path(str(source["file"]))
    if not path.is_file():
        raise ConfigError(f"{where}.file: {str(path)!r} does not exist; capture it first (e.g. kind: capture)")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            key = str(source["key"])
            if key not in keys:
                raise ConfigError(
                    f"{where}.key: {key!r} is not in {str(path)!r}.{did_you_mean(key, keys)}"
                    f" Keys: {', '.join(keys[:10])}{' …' if len(keys) > 10 else ''}"
                )
            return owned(f.get_tensor(key))  # aligned like the captured run's tensor: same GEMM path, same bits
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
        raise ConfigError(f"{where}.file: cannot read {str(path)!r} as safetensors: {e}") from None


def _patch(source: torch.Tensor, where: str, key: str) -> Op:
    """Replace the tensor by a fresh copy of the captured one (moved to its device and dtype once)."""
    ready: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def patch(t: torch.Tensor, m: Any) -> torch.Tensor:
        if t.shape != source.shape:
            raise ActionError(f"{where}: {key!r} has shape {list(source.shape)}, this tensor is {list(t.shape)}")
        value = ready.get((t.device, t.dtype))
        if value is None:
            value = ready[(t.device, t.dtype)] = source.to(device=t.device, dtype=t.dtype)
        # A copy per call (one tensor's worth of memory traffic, small next to the forward): the model may write
        # into what it is handed (`out += identity`), which must never change the source the next call reads.
        return value.clone()

    return patch


def patch_shape(cfg: OpArgs, where: str) -> tuple[int, ...] | None:
    """The shape a patch op will write (after ``index``), for the plan-time shape check."""
    if cfg.op != "patch":
        return None
    source = load_patch(cfg.from_, f"{where}.from")
    if cfg.index is not None:
        source = source[compile_index(cfg.index, f"{where}.index")]
    return tuple(source.shape)
