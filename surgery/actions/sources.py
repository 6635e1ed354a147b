"""Tensor sources for ``add``, ``mul``, ``set`` and ``patch``: ``from:`` a file, a capture, or a Python tensor.

A source broadcasts onto the part of the tensor the op writes by PyTorch's rules (``[T, D]`` onto
``[B, T, D]``, a ``[D]`` steering vector onto every position); a source with the whole tensor's
shape, or one that broadcasts onto the whole tensor but not onto the part (a ``[T, D]`` mean written
into ``[..., 16:24]`` of ``[B, T, D]``), is first broadcast onto the whole tensor, then cut by ``index``.
The model is never handed the source itself: every call gets a new tensor, so in-place model code
cannot change what the next call reads.

``from: {capture: ACTION, what, reduce, dim}`` reads what the earlier capture ACTION recorded on the
same module. In one pass that is its latest call (the capture's hook runs first on the same call).
Inside ``Surgery.source_pass()`` such an op changes nothing; after it (or after
``Surgery.freeze_sources()``) it reads the frozen call with the same number: the k-th call of a
module in each forward of the model reads the k-th call of the source pass (a ``keep: last``
capture's one call serves every call; calls past the last frozen one read the last). Such an
action adds a forward pre-hook on the model, which starts the count of each forward, and one on
each selected module, which counts every call (also those ``calls:`` leaves alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from surgery.actions.base import KeyedError
from surgery.core.plan_cache import depends_on_more
from surgery.core.select import Target
from surgery.core.steps import broadcasts
from surgery.core.structure import get_item
from surgery.core.tensors import is_computed, owned
from surgery.errors import ConfigError, did_you_mean

Op = Callable[[torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True)
class SourceContext:
    """What a ``from: {capture}`` source is checked against: the steps bound before it and its own modules."""

    earlier: list[Any]
    targets: list[Target]
    root: Any  # the model: each of its forwards counts a module's calls from 0 again


COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "mul": torch.mul,
    "set": lambda part, src: torch.empty_like(part).copy_(src),  # copy_ broadcasts; owned memory like part
    "patch": lambda part, src: torch.empty_like(part).copy_(src),
}


def load_patch(source: dict[str, str], where: str) -> torch.Tensor:
    """The captured tensor ``source['key']`` of ``source['file']`` (a captures.safetensors)."""
    from surgery.core.limits import check_memory
    from surgery.files.gate import config_path
    from surgery.files.libraries import safetensors_reader
    from surgery.files.tensors import SAFETENSORS_DTYPE_BYTES

    depends_on_more(f"{where}.file")  # the file may change between plans
    path = config_path(str(source["file"]), f"{where}.file")
    if not path.is_file():
        raise ConfigError(f"{where}.file: {str(path)!r} does not exist; capture it first (e.g. kind: capture)")
    try:
        with safetensors_reader(path, f"{where}.file") as f:
            keys = list(f.keys())
            key = str(source["key"])
            if key not in keys:
                raise ConfigError(
                    f"{where}.key: {key!r} is not in {str(path)!r}.{did_you_mean(key, keys)}"
                    f" Keys: {', '.join(keys[:10])}{' …' if len(keys) > 10 else ''}"
                )
            declared = f.get_slice(key)  # a file from others: its header's size is checked before reading
            check_memory(math.prod(declared.get_shape()) * SAFETENSORS_DTYPE_BYTES.get(declared.get_dtype(), 8),
                         f"{where}.file", f"{key!r} of {str(path)!r}")  # fmt: skip
            return owned(f.get_tensor(key))  # aligned like the captured run's tensor: same GEMM path, same bits
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
        raise ConfigError(f"{where}.file: cannot read {str(path)!r} as safetensors: {e}") from None


def _python_tensor(cfg: Any, where: str, safe: bool) -> tuple[str, torch.Tensor] | None:
    """(key, tensor) when a Python recipe gave a tensor as ``value`` or ``from``; refused under ``safe`` unless
    surgery computed it itself from the run's config (a steering vector of ``vectors:``)."""
    for key, value in (("value", cfg.value), ("from", cfg.from_)):
        if isinstance(value, torch.Tensor):
            if safe and not is_computed(value):
                raise ConfigError(
                    f"{where}.{key}: a Python tensor is refused because safe=true (safe recipes are config text;"
                    " give it as from: {file, key} instead, or set safe=false)"
                )
            return key, value
    return None


def source_shape(cfg: Any, where: str) -> tuple[tuple[int, ...], str] | None:
    """The shape of a file or tensor source and how messages name it, for the probe forward's broadcast check."""
    given = _python_tensor(cfg, where, safe=False)
    if given is not None:
        return tuple(given[1].shape), f"the tensor given as {given[0]}"
    source = cfg.from_
    if isinstance(source, dict) and "file" in source:
        return tuple(load_patch(source, f"{where}.from").shape), repr(source["key"])
    return None


def onto(src: torch.Tensor, t: torch.Tensor, part: torch.Tensor, index: tuple | None, key: str) -> torch.Tensor:
    """``src`` made to write onto ``part`` (``t`` cut by ``index``): as it is when it broadcasts onto the part,
    else broadcast onto the whole tensor and cut by ``index`` like it (a ``[T, D]`` mean into ``[..., 16:24]``)."""
    if index is None or (src.shape != t.shape and broadcasts(tuple(src.shape), tuple(part.shape))):
        if not broadcasts(tuple(src.shape), tuple(part.shape)):
            raise KeyedError(
                key, f"the source has shape {list(src.shape)}, which does not broadcast onto {list(part.shape)}"
            )
        return src
    if not broadcasts(tuple(src.shape), tuple(t.shape)):
        raise KeyedError(
            key,
            f"the source has shape {list(src.shape)}, which broadcasts neither onto the indexed part"
            f" {list(part.shape)} nor onto the whole tensor {list(t.shape)}",
        )
    return src.expand(t.shape)[index]


def source_op(cfg: Any, where: str, safe: bool, index: tuple | None, ctx: SourceContext | None) -> Callable[..., Op]:
    """``build(ledger=None)`` giving the op that combines the tensor with its source (checked now)."""
    combine = COMBINE[cfg.op]
    given = _python_tensor(cfg, where, safe)
    key = "from" if cfg.from_ is not None else "value"
    scale = cfg.scale
    if given is not None:
        fixed: torch.Tensor | None = owned(given[1])  # a copy taken now: the caller may change theirs later
    elif "file" in cfg.from_:
        fixed = load_patch(cfg.from_, f"{where}.from")
    else:
        fixed = None
        read = _capture_reader(cfg, where, ctx)
    if fixed is not None and scale is not None:
        fixed = fixed * scale  # once, as a hand-written hook adding `scale * vector` computes it

    def build(ledger: Any = None) -> Op:
        source_for: Callable[[torch.Tensor, Any], torch.Tensor]
        if fixed is not None:
            ready: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

            def cached(t: torch.Tensor, m: Any) -> torch.Tensor:
                value = ready.get((t.device, t.dtype))
                if value is None:
                    value = ready[(t.device, t.dtype)] = fixed.to(device=t.device, dtype=t.dtype)
                return value

            source_for = cached
        else:
            if ledger is None:
                raise ConfigError(f"{where}.from: a capture source is read by modify_output and modify_input only")
            source_for = read(ledger)

        def op(t: torch.Tensor, m: Any) -> torch.Tensor:
            if ledger is not None and ledger.sourcing and fixed is None:
                return t  # a source pass: the capture is recording what this op will read later
            src = source_for(t, m)
            if scale is not None and fixed is None:
                src = src * scale
            part = t if index is None else t[index]
            src = onto(src, t, part, index, key)
            new = combine(part, src.to(dtype=part.dtype))
            if index is None:
                return new
            out = t.clone()
            out[index] = new
            return out

        return op

    return build


def _capture_reader(
    cfg: Any, where: str, ctx: SourceContext | None
) -> Callable[[Any], Callable[[torch.Tensor, Any], torch.Tensor]]:
    """Check ``from: {capture: ACTION, ...}`` against the plan so far; return ``read(ledger)``."""
    source = cfg.from_
    name, what = source["capture"], source.get("what", "output")
    reduce, dim = source.get("reduce", "none"), source.get("dim", 0)
    dims = tuple(dim) if isinstance(dim, list) else (dim,)
    at = f"{where}.from.capture"
    if ctx is None:
        raise ConfigError(f"{at}: a capture source is read by modify_output and modify_input only")
    earlier = {s.name: s for s in ctx.earlier}
    step = earlier.get(name)
    if step is None:
        captures = [n for n, s in earlier.items() if s.kind == "capture"]
        raise ConfigError(
            f"{at}: no capture action {name!r} is listed before this one.{did_you_mean(name, captures)}"
            f" Captures listed before: {', '.join(captures) or 'none'} (a source must come first)"
        )
    if step.kind != "capture":
        raise ConfigError(f"{at}: {name!r} is a {step.kind} action, not a capture")
    if not step.enabled:
        raise ConfigError(f"{at}: capture {name!r} is disabled (enabled: false), so it records nothing")
    config = step.config
    if config.reduce != "none" or getattr(config, "function", None) is not None:
        raise ConfigError(f"{at}: capture {name!r} keeps statistics or function calls, not module calls; a source"
                          " needs reduce: none and no function")  # fmt: skip
    if what not in config.what:
        raise ConfigError(f"{where}.from.what: capture {name!r} records {', '.join(config.what)}, not {what}")
    captured = {id(t.module) for t in step.targets}
    names = {id(t.module): t.name for t in ctx.targets}
    missing = [t.name for t in ctx.targets if id(t.module) not in captured]
    if missing:
        raise ConfigError(f"{at}: capture {name!r} does not record {missing[0]!r} (a source is read on the same"
                          " module); select it in both")  # fmt: skip
    item = cfg.item if isinstance(getattr(cfg, "item", None), (int, str)) else 0

    def read(ledger: Any) -> Callable[[torch.Tensor, Any], torch.Tensor]:
        counts: dict[int, int] = {}  # id(module) -> its calls so far in this forward of the model

        def count(m: Any, args: Any) -> None:
            counts[id(m)] = counts.get(id(m), 0) + 1

        for target in ctx.targets:  # every call counts, also those `calls:` leaves alone; before this op's hook
            ledger.hook(target.module.register_forward_pre_hook, count)
        ledger.hook(ctx.root.register_forward_pre_hook, lambda m, args: counts.clear())

        def source_for(t: torch.Tensor, m: Any) -> torch.Tensor:
            record = ledger.captures[name][names[id(m)]]
            frozen = record.sources
            if frozen is not None:
                k = counts[id(m)] - 1  # this call's number in this forward
                if not frozen:
                    raise KeyedError(
                        "from", f"capture {name!r} recorded no call of {names[id(m)]!r} in the source pass"
                    )
                call = frozen[min(k, len(frozen) - 1)]  # keep: last froze one call, which serves every call
            else:
                calls = record.calls
                if not calls:
                    raise KeyedError(
                        "from", f"capture {name!r} has recorded no call of {names[id(m)]!r} yet (modify_input runs"
                        " before a capture records the call: run a source pass, Surgery.freeze_sources())"
                    )  # fmt: skip
                call = calls[-1]
            value = get_item(call.output if what == "output" else call.input, item)
            if not isinstance(value, torch.Tensor):
                raise KeyedError("from", f"capture {name!r} recorded a {type(value).__name__} here, not a tensor")
            return value.mean(dim=dims, keepdim=True) if reduce == "mean" else value

        return source_for

    return read
