"""Custom Python named in configs: ``pkg.module:function`` and ``_target_`` nodes.

Both run code the config names, so ``safe=true`` admits only an explicit allowlist
(:func:`is_allowed`): a name is resolved to the object it denotes and that object is compared by
identity, never by the spelling of its path (``torch.load`` starts with ``torch.`` and is refused).
Everything is resolved at plan time, so a typo is a config error before the model is touched.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from surgery.core.limits import sized_call
from surgery.core.plan_cache import depends_on_more
from surgery.errors import ConfigError, did_you_mean

# Only names under these packages are ever imported to be checked: importing any other module
# could itself run code, and nothing outside them is allowed anyway.
_IMPORTABLE = ("torch", "surgery")
OWN_PACKAGE = "surgery.models"
# Hydra's own callback that only logs a job's return value: the one hydra.callbacks entry safe mode admits.
SAFE_CALLBACKS = ("hydra.experimental.callbacks.LogJobReturnCallback",)

ALLOWED = (
    "torch.nn module classes (torch.nn.Linear, torch.nn.GELU, ...), torch.nn.init functions, the tensor functions"
    " of expressions and torch.nn.functional (torch.relu, torch.nn.functional.gelu, ...), surgery.models and"
    " surgery.lm.load.load_pretrained (+model=hf)"
)


@cache
def _allowed_objects() -> frozenset[int]:
    """ids of every allowed callable except surgery.models' own (those are recognised by where they are defined)."""
    import torch.nn.functional as F  # noqa: N812
    from torch import nn

    from surgery.expr.runtime import FUNCTIONS

    allowed: list[Any] = [obj for name, obj in vars(nn).items() if _is_module_class(obj) and not name.startswith("_")]
    allowed += [obj for name, obj in vars(nn.init).items() if _public_function(name, obj, "torch.nn.init")]
    allowed += [obj for name, obj in vars(F).items() if _public_function(name, obj, None)]
    allowed += [obj for obj in FUNCTIONS.values() if getattr(obj, "__module__", "") != "surgery.expr.runtime"]
    return frozenset(map(id, allowed))


def _is_module_class(obj: Any) -> bool:
    from torch import nn

    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _public_function(name: str, obj: Any, module: str | None) -> bool:
    """A public function defined (or, for torch.nn.functional, exposed) in that namespace; not a class or module."""
    if name.startswith("_") or isinstance(obj, type) or inspect.ismodule(obj) or not callable(obj):
        return False
    if module is not None:
        return getattr(obj, "__module__", None) == module
    # torch.nn.functional also holds typing helpers and dispatch utilities imported from elsewhere
    return getattr(obj, "__module__", None) in ("torch.nn.functional", "torch._C._nn", "torch")


def _own(obj: Any) -> bool:
    """A public class or function defined at the top level of a surgery.models module."""
    module_name = getattr(obj, "__module__", None) or ""
    qualname = getattr(obj, "__qualname__", "") or ""
    if not (module_name == OWN_PACKAGE or module_name.startswith(OWN_PACKAGE + ".")) or "." in qualname:
        return False
    module = sys.modules.get(module_name)
    return not qualname.startswith("_") and getattr(module, qualname, None) is obj


# Loaders of data directories that run nothing from the directory (files/pretrained.py: no remote code, config.json
# and the model's size checked first, weights as safetensors or weights-only pickles), named for safe mode's allowlist.
SAFE_LOADERS = ("surgery.lm.load.load_pretrained",)

OWN_TRANSFORMS: set[type] = set()  # classes whose instances surgery itself builds for a config (surgery.arch's lens)


def allowed_object(obj: Any) -> bool:
    """Whether a resolved callable is on the safe-mode allowlist (by identity, never by name)."""
    return id(obj) in _allowed_objects() or _own(obj) or type(obj) in OWN_TRANSFORMS or id(obj) in _safe_loaders()


@cache
def _safe_loaders() -> frozenset[int]:
    """ids of :data:`SAFE_LOADERS` (imported only when a target is checked: transformers loads lazily)."""
    from hydra._internal.utils import _locate

    return frozenset(id(_locate(name)) for name in SAFE_LOADERS)


def _resolve(target: Any) -> Any:
    """The object a ``_target_`` names, importing only torch and surgery modules; None when it names nothing."""
    if not isinstance(target, str):
        return target if callable(target) else None
    if target.partition(".")[0] not in _IMPORTABLE:
        return None
    from hydra._internal.utils import _locate  # what hydra.utils.instantiate itself resolves with

    try:
        return _locate(target)
    except Exception:  # noqa: BLE001 - a name that resolves to nothing is not allowed
        return None


def is_allowed(target: Any) -> bool:
    """Whether a ``_target_`` (a dotted path or a callable) names an allowlisted callable."""
    if isinstance(target, str) and target in SAFE_CALLBACKS:
        return False  # callbacks only: see check_callbacks
    obj = _resolve(target)
    return obj is not None and allowed_object(obj)


def refusal(where: str, what: Any) -> ConfigError:
    """The one-line safe-mode refusal: the key, what was refused, what is allowed."""
    return ConfigError(
        f"{where}: {what!r} is not on the safe-mode allowlist, refused because safe=true"
        f" (allowed: {ALLOWED}; set safe=false to allow it)"
    )


def check_targets(node: Any, where: str, safe: bool) -> None:
    """Under ``safe``, refuse any ``_target_`` (at any depth, in lists too) that is not allowlisted."""
    if not safe:
        return
    if isinstance(node, Mapping):
        if "_target_" in node and not is_allowed(node["_target_"]):
            raise refusal(f"{where}._target_", node["_target_"])
        for key, value in node.items():
            check_targets(value, f"{where}.{key}", safe)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_targets(value, f"{where}[{i}]", safe)


def check_callbacks(callbacks: Any, safe: bool) -> None:
    """Under ``safe``, refuse ``hydra.callbacks`` entries outside the allowlist (checked before Hydra builds them)."""
    if not safe or not isinstance(callbacks, Mapping):
        return
    for name, node in callbacks.items():
        where = f"hydra.callbacks.{name}"
        if isinstance(node, Mapping) and node.get("_target_") in SAFE_CALLBACKS:
            check_targets({k: v for k, v in node.items() if k != "_target_"}, where, safe)
            continue
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise refusal(where, node)
        check_targets(node, where, safe)


def instantiate_node(node: Mapping[str, Any], where: str, safe: bool) -> Any:
    """Build a ``_target_`` node with Hydra, turning every failure into a ConfigError."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check_targets(node, where, safe)
    depends_on_more(where)  # a new object each time (a module replace_module puts in, with its own state)
    try:
        return instantiate(dict(node))
    except InstantiationException as e:
        target = str(node.get("_target_"))
        raise ConfigError(f"{where}: cannot build {target!r}: {instantiate_reason(e, target)}") from None
    except Exception as e:  # noqa: BLE001 - the target's own constructor failed
        raise ConfigError(f"{where}: building {node.get('_target_')!r} failed: {type(e).__name__}: {e}") from None


def instantiate_reason(error: Exception, target: str) -> str:
    """The telling part of a Hydra instantiation error: a missing name, or the constructor's own error."""
    cause = error.__cause__
    if isinstance(cause, ImportError) or "Error locating target" in str(error):
        module_name, _, attr = target.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            return f"cannot import {module_name!r}: {e}"
        return f"module {module_name!r} has no attribute {attr!r}.{did_you_mean(attr, dir(module))}".rstrip(".")
    if cause is not None:
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return str(error).strip().splitlines()[-1]


def resolve_callable(spec: Any, where: str, safe: bool) -> Callable[..., Any]:
    """A callable from ``pkg.module:function``, a ``_target_`` node (e.g. with ``_partial_: true``), or (Python
    dict recipes) the callable itself; under ``safe`` only allowlisted ones."""
    if callable(spec) and not isinstance(spec, (str, Mapping, type)):  # a Python callable in a dict recipe
        if safe and not allowed_object(spec):
            raise refusal(where, getattr(spec, "__qualname__", spec))
        return spec
    if isinstance(spec, Mapping) and "_target_" in spec:
        obj = instantiate_node(spec, where, safe)
    elif isinstance(spec, str) and ":" in spec:
        if safe and not _allowed_path(spec):
            raise refusal(where, spec)
        depends_on_more(where)  # the name may denote another object later (a module reloaded)
        obj = _import(spec, where)
    else:
        raise ConfigError(f"{where}: expected pkg.module:function or a _target_ node, got {spec!r}")
    if not callable(obj):
        raise ConfigError(f"{where}: {spec!r} gives a {type(obj).__name__}, which is not callable")
    return sized_call(obj, where)  # torch functions: an output past limits.memory_gb is refused before allocating


def _allowed_path(spec: str) -> bool:
    """Whether ``pkg.module:function`` names an allowlisted callable; imports only torch and surgery modules."""
    module_name, _, attr_path = spec.partition(":")
    if module_name.partition(".")[0] not in _IMPORTABLE:
        return False
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except Exception:  # noqa: BLE001 - a name that resolves to nothing is not allowed
        return False
    return allowed_object(obj)


def _import(spec: str, where: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import {module_name!r} for {spec!r}: {e}") from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"{where}: {module_name!r} has no {attr_path!r} (from {spec!r})")
        obj = getattr(obj, attr)
    return obj
