"""Compiled plans reused: the same recipe on the same module tree gets the plan compiled for it before.

``compile_plan`` (so ``surgery.plan``, and ``surgery.apply`` given a recipe) looks here first. A plan
is found again only when everything it was compiled from is the same: the recipe's content (never its
identity: a dict changed in place, or a YAML file edited, is a new recipe), ``seed``, ``strict``,
``safe``, the limits in force, and the module tree (each module's identity, class and children, each
parameter's and buffer's identity, shape, dtype, device and ``requires_grad``). A recipe that depends
on more than that is compiled every time: one holding Python objects (a tensor, a function), or one
whose binding reads a file (``from: {file}``, ``init: {from: {file}}``, a splice), imports a callable
by name or builds a module (``replace_module``, ``_target_`` nodes): the step says so with
:func:`depends_on_more`.

A plan holds no state of an apply: each apply builds its records, call counters and noise streams
afresh, so one plan serves any number of applies. The plans live on the model (``SIZE`` per model,
the least recently used dropped first), so they go when the model goes; a copy or a pickle of the
model starts with none.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from omegaconf import ListConfig
from torch import nn

from surgery.core.limits import active

SIZE = 8  # plans kept per model
ATTRIBUTE = "_surgery_plans"  # in the model's __dict__: no parameter, buffer, module or hook
_OUTSIDE: ContextVar[list[str] | None] = ContextVar("surgery_plan_outside", default=None)


class PlanCache:
    """A model's recent plans by (recipe, options) key, each with the module tree it was compiled on."""

    def __init__(self) -> None:
        self.plans: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = 0

    def __reduce__(self) -> tuple[type, tuple[()]]:  # a pickled model carries no plans (nor their closures)
        return (PlanCache, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanCache:  # a copied model's plans would bind the original
        return PlanCache()


def recipe_key(specs: Mapping[str, Any], seed: int, strict: bool, safe: bool) -> tuple[Any, ...] | None:
    """What a plan is found again by: the recipe's content and the options; None when it holds anything but data."""
    content = plain(specs)
    if content is None:
        return None
    return (content, seed, strict, safe, active())


def tree_key(model: nn.Module) -> tuple[Any, ...]:
    """The module tree as a plan depends on it: each module's identity, class and child names (children by
    identity, in order), and its parameters' and buffers' names, identities, shapes, dtypes, devices and grads."""
    out: list[Any] = []
    add, extend = out.append, out.extend
    seen = {id(model)}
    stack = [model]
    while stack:
        module = stack.pop()
        children = module._modules
        extend((id(module), type(module), *children.keys()))  # keys(): a ScriptModule's dicts do not iterate
        for child in children.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
            add(id(child))
        params, buffers = module._parameters, module._buffers
        if params:
            extend(("parameters", *params.keys()))
            for t in params.values():
                extend((id(t), None) if t is None else (id(t), t.shape, t.dtype, t.device, t.requires_grad))
        if buffers:
            extend(("buffers", *buffers.keys()))
            for b in buffers.values():
                extend((id(b), None) if b is None else (id(b), b.shape, b.dtype, b.device))
    return tuple(out)


def found(model: nn.Module, key: tuple[Any, ...], tree: tuple[Any, ...]) -> Any:
    """The plan kept for ``key`` on this very module tree, or None."""
    cache = model.__dict__.get(ATTRIBUTE)
    if cache is None:
        return None
    with cache.lock:
        entry = cache.plans.get(key)
        if entry is None or entry[0] != tree:
            return None
        cache.plans.move_to_end(key)
        cache.hits += 1
        return entry[1]


def keep(model: nn.Module, key: tuple[Any, ...], tree: tuple[Any, ...], plan: Any) -> None:
    """Keep ``plan`` for ``key``; the least recently used goes past ``SIZE``."""
    cache = model.__dict__.get(ATTRIBUTE)
    if cache is None:
        cache = model.__dict__.setdefault(ATTRIBUTE, PlanCache())  # not setattr: nn.Module would not register it
    with cache.lock:
        cache.plans[key] = (tree, plan)
        cache.plans.move_to_end(key)
        while len(cache.plans) > SIZE:
            cache.plans.popitem(last=False)


def forget(model: nn.Module) -> None:
    """Drop every plan kept for ``model`` (the next plan of each recipe is compiled afresh)."""
    model.__dict__.pop(ATTRIBUTE, None)


def kept(model: nn.Module) -> int:
    """How many plans are kept for ``model``."""
    cache = model.__dict__.get(ATTRIBUTE)
    return 0 if cache is None else len(cache.plans)


@contextmanager
def watching() -> Iterator[list[str]]:
    """Inside, :func:`depends_on_more` notes why the plan being compiled cannot be reused (the list yielded)."""
    outer = _OUTSIDE.get()
    reasons: list[str] = []
    token = _OUTSIDE.set(reasons)
    try:
        yield reasons
    finally:
        _OUTSIDE.reset(token)
        if outer is not None:
            outer.extend(reasons)


def depends_on_more(why: str) -> None:
    """Note that the plan being compiled depends on more than its recipe and the module tree (a file read, a
    callable imported by name, a module built), so it is compiled afresh every time."""
    reasons = _OUTSIDE.get()
    if reasons is not None:
        reasons.append(why)


def plain(value: Any) -> Any:
    """A hashable copy of JSON-like data (str, numbers, bools, None, lists, mappings); None for anything else."""
    kind = type(value)
    if value is None or kind in (str, bool, int):
        return (kind.__name__, value)
    if kind is float:  # by its text: -0.0 and 0.0 are equal numbers, and give different bits
        return ("float", repr(value))
    if isinstance(value, (list, tuple, ListConfig)):
        items = [plain(v) for v in value]
        return None if any(i is None for i in items) else ("list", tuple(items))
    if isinstance(value, Mapping):
        pairs = [(plain(k), plain(v)) for k, v in value.items()]
        return None if any(k is None or v is None for k, v in pairs) else ("map", tuple(pairs))
    return None
