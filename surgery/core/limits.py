"""What one run may cost: the memory, disk and counts a config or a file from others may ask for.

Under ``safe=true`` the CLI enforces the run setting ``limits`` (``conf/config.yaml``) for the
whole job with :func:`enforced`; a Python user may do the same. Outside it nothing is bounded
(``active()`` returns unbounded limits). Every check runs before the allocation or the write it
guards, and a refusal names the key that asked and the setting that would admit it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from surgery.errors import ConfigError

GB = 2**30
T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """Bounds for one run; None is unbounded."""

    memory_gb: float | None = None  # tensors a config or file asks for (shapes, dims, parameters, decoded files)
    disk_gb: float | None = None  # everything the run writes into its directory
    count: int | None = None  # actions, calls: entries, batches, new tokens, sweep jobs one config may ask for
    paths_inside: bool = False  # a path a data file names (image, arrow file, symlink) must stay in its directory


UNBOUNDED = Limits()
SAFE_DEFAULTS = Limits(memory_gb=8.0, disk_gb=8.0, count=10_000, paths_inside=True)
_ACTIVE: ContextVar[Limits] = ContextVar("surgery_limits", default=UNBOUNDED)
_WRITTEN: ContextVar[list[float]] = ContextVar("surgery_written")  # bytes written inside the current enforced()


def active() -> Limits:
    """The limits in force here (unbounded unless inside :func:`enforced`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def enforced(limits: Limits) -> Iterator[Limits]:
    """Enforce ``limits`` for everything run inside the block (this thread and tasks it starts)."""
    token, written = _ACTIVE.set(limits), _WRITTEN.set([0.0])
    try:
        yield limits
    finally:
        _WRITTEN.reset(written)
        _ACTIVE.reset(token)


def check_memory(nbytes: float, key: str, what: str = "") -> None:
    """Refuse ``nbytes`` asked for at ``key`` when more than ``limits.memory_gb``, before allocating."""
    bound = active().memory_gb
    if bound is not None and nbytes > bound * GB:
        about = f" ({what})" if what else ""
        raise ConfigError(
            f"{key}: would need {nbytes / GB:.3g} GB{about}, more than limits.memory_gb={bound:g};"
            f" if that is meant, raise it: limits.memory_gb={_above(nbytes / GB)}"
        )


def check_disk(nbytes: float, written: float, key: str) -> None:
    """Refuse writing ``nbytes`` more when ``written`` bytes are already out and ``limits.disk_gb`` would be passed."""
    bound = active().disk_gb
    if bound is not None and written + nbytes > bound * GB:
        total = (written + nbytes) / GB
        raise ConfigError(
            f"{key}: the run would write {total:.3g} GB, more than limits.disk_gb={bound:g};"
            f" if that is meant, raise it: limits.disk_gb={_above(total)}"
        )


def written() -> float:
    """Bytes charged with :func:`charge_disk` so far in the current :func:`enforced` block (0 outside one)."""
    counter = _WRITTEN.get(None)
    return counter[0] if counter else 0.0


def charge_disk(nbytes: float, key: str) -> None:
    """Count ``nbytes`` the run is about to write against ``limits.disk_gb`` (:func:`check_disk`), before writing."""
    written = _WRITTEN.get(None)
    check_disk(nbytes, written[0] if written else 0.0, key)
    if written is not None:
        written[0] += nbytes


def check_count(count: int, key: str, what: str) -> None:
    """Refuse ``count`` of ``what`` asked for at ``key`` when more than ``limits.count``."""
    refused = count_refusal(count, what)
    if refused is not None:
        raise ConfigError(f"{key}: {refused}")


def count_refusal(count: int, what: str) -> str | None:
    """Why ``count`` of ``what`` is refused (the message after the key), or None when within ``limits.count``."""
    bound = active().count
    if bound is None or count <= bound:
        return None
    return f"{count:,} {what} are more than limits.count={bound}; if that is meant, raise it: limits.count={count}"


def check_built(build: Callable[[], T], key: str, what: str, copies: int = 1) -> None:
    """Refuse, before building for real, what ``build()`` would allocate (``copies`` times) past ``limits.memory_gb``.

    Under a memory bound ``build`` is called once under ``torch.device("meta")``, where tensors have shapes but no
    storage, and the bytes of the tensors it holds (a module's parameters, buffers and tensor attributes, or a
    tensor) are counted; more modules than ``limits.count`` stop it early, so a deep model is bounded in time too.
    Random states are restored afterwards, so the real build draws exactly what it would have. A build that cannot
    run on meta (it reads values) is not measured. Without a memory bound nothing is called.
    """
    limits = active()
    if limits.memory_gb is None:
        return
    measured = _measure_on_meta(build, key, limits.count)
    if measured is not None:
        nbytes, modules = measured
        many = f"{copies:,} × " if copies > 1 else ""
        count = f", {modules:,} modules" if modules > 1 else ""
        check_memory(nbytes * copies, key, f"{many}{what}: {nbytes / GB:.3g} GB of tensors{count}")


def sized_call(fn: Callable[..., T], key: str) -> Callable[..., T]:
    """``fn`` as it is; a partial of a torch function (``_partial_: true``) refusing its output past the bound.

    ``torch.nn.functional.pad`` or ``interpolate`` with a config's arguments can make any input huge. Under a
    memory bound each call first runs on meta copies of its tensors (shapes only, no storage), and an output
    larger than ``limits.memory_gb`` is refused before the real call allocates it. Only torch's own functions are
    wrapped: they compute and change nothing else, so running one twice is harmless.
    """
    import functools

    if not isinstance(fn, functools.partial):  # a bare function gets no size from the config
        return fn
    target = fn.func
    if isinstance(target, type) or not str(getattr(target, "__module__", None) or "").startswith("torch"):
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        if active().memory_gb is not None:
            name = getattr(target, "__name__", "the function")
            try:
                made = target(*_on_meta((*fn.args, *args)), **_on_meta({**fn.keywords, **kwargs}))
            except Exception:  # noqa: BLE001 - the real call says what is wrong with its arguments
                made = None
            check_memory(_nbytes(made), key, f"the output of {name}")
        return fn(*args, **kwargs)

    return call


def _on_meta(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.is_meta else value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


class _TooManyModulesError(Exception):
    """Raised from inside a meta build that registered more modules than ``limits.count``."""


def check_forward(module: Any, build: Callable[[], Any], key: str) -> None:
    """Under a memory bound, refuse before each call of ``module`` an output past it, measured on a meta twin.

    A replacement such as ``torch.nn.Upsample(scale_factor=1000)`` holds nothing and makes its input huge: its
    twin, built again from the same config on meta, runs first on meta copies of the inputs (shapes only). A
    module whose forward cannot run on meta is not measured. Without a memory bound nothing is added.
    """
    limits = active()
    if limits.memory_gb is None:
        return
    twin = _build_on_meta(build, key, limits.count)
    if twin is None or not hasattr(twin, "register_forward_pre_hook"):
        return
    floating = [t for t in module.parameters() if t.is_floating_point()]
    twin = twin.to(dtype=floating[0].dtype) if floating else twin
    twin.train(module.training)
    name = type(module).__name__

    def before(_module: Any, args: Any, kwargs: Any) -> None:
        if active().memory_gb is None:
            return
        try:
            made = twin(*_on_meta(args), **_on_meta(kwargs))
        except Exception:  # noqa: BLE001 - the real forward says what is wrong with its input
            return
        check_memory(_nbytes(made), key, f"the output of {name} on this input")

    module.register_forward_pre_hook(before, with_kwargs=True)  # on the new module only: the model keeps none


def _measure_on_meta(build: Callable[[], Any], key: str, most: int | None) -> tuple[int, int] | None:
    built = _build_on_meta(build, key, most)
    return None if built is None else _tensor_bytes(built)


def _build_on_meta(build: Callable[[], Any], key: str, most: int | None) -> Any:
    import random

    import numpy as np
    import torch
    from torch.nn.modules.module import register_module_module_registration_hook

    made = [0]

    def count(module: Any, name: str, submodule: Any) -> None:
        made[0] += 1
        if most is not None and made[0] > most:
            raise _TooManyModulesError

    python_state, numpy_state = random.getstate(), np.random.get_state()
    handle = register_module_module_registration_hook(count)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. a checkpoint copied into meta parameters: a no-op, said per tensor
            built = build()
    except Exception as e:  # noqa: BLE001 - Hydra wraps what the constructor raised; ours is inside
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, _TooManyModulesError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise ConfigError(
                f"{key}: builds more than {most:,} modules, more than limits.count={most}; if that is meant, raise"
                f" it: limits.count={10 * (most or 0)}"
            ) from None
        return None  # reads values or wants a real device: measured no further
    finally:
        handle.remove()
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return built


def _tensor_bytes(built: Any) -> tuple[int, int]:
    """Bytes of the distinct tensors ``built`` holds, and how many modules it is."""
    import torch
    from torch import nn

    if isinstance(built, torch.Tensor):
        return built.nelement() * built.element_size(), 1
    if not isinstance(built, nn.Module):
        return 0, 0
    seen: dict[int, torch.Tensor] = {}
    modules = 0
    for module in built.modules():
        modules += 1
        own = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for tensor in own:
            if isinstance(tensor, torch.Tensor):
                seen.setdefault(id(tensor), tensor)
    return sum(t.nelement() * t.element_size() for t in seen.values()), modules


def _above(value: float) -> str:
    """A round number of GB at least ``value``, for a suggestion that works when pasted."""
    whole = int(value) + 1
    return str(whole)
