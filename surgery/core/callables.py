"""Custom Python named in configs: ``pkg.module:function`` and ``_target_`` nodes.

Both run code the config names, so ``safe=true`` refuses every import path and any
``_target_`` outside torch and surgery. Everything is resolved at plan time, so a typo is a
config error before the model is touched.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from surgery.errors import ConfigError, did_you_mean

SAFE_TARGET_PREFIXES = ("torch.", "surgery.")


def check_targets(node: Any, where: str, safe: bool) -> None:
    """Under ``safe``, refuse any ``_target_`` (at any depth) outside torch and surgery."""
    if isinstance(node, Mapping):
        target = node.get("_target_")
        if safe and target is not None and not str(target).startswith(SAFE_TARGET_PREFIXES):
            raise ConfigError(
                f"{where}._target_: {target!r} is outside torch and surgery, refused because safe=true"
                " (safe mode runs no code a config names; set safe=false to allow it)"
            )
        for key, value in node.items():
            check_targets(value, f"{where}.{key}", safe)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_targets(value, f"{where}[{i}]", safe)


def instantiate_node(node: Mapping[str, Any], where: str, safe: bool) -> Any:
    """Build a ``_target_`` node with Hydra, turning every failure into a ConfigError."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check_targets(node, where, safe)
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
    """A callable from ``pkg.module:function`` or a ``_target_`` node (e.g. with ``_partial_: true``)."""
    if isinstance(spec, Mapping) and "_target_" in spec:
        obj = instantiate_node(spec, where, safe)
    elif isinstance(spec, str) and ":" in spec:
        if safe:
            raise ConfigError(
                f"{where}: {spec!r} is an import-path callable, refused because safe=true;"
                " use expr or a built-in, or set safe=false"
            )
        obj = _import(spec, where)
    else:
        raise ConfigError(f"{where}: expected pkg.module:function or a _target_ node, got {spec!r}")
    if not callable(obj):
        raise ConfigError(f"{where}: {spec!r} gives a {type(obj).__name__}, which is not callable")
    return obj


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
