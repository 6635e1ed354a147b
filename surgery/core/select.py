"""Pick modules and parameters by glob (the rule is in :mod:`surgery.core.globs`).

Names are ``model.named_modules()`` names; the root module is ``<root>``.

Wrappers are invisible: the segments ``_orig_mod`` (``torch.compile``),
``_fsdp_wrapped_module`` and ``_checkpoint_wrapped_module`` are dropped anywhere, and a
leading ``module`` segment is dropped when the root (after those wrappers) is a class
named ``DistributedDataParallel`` or ``DataParallel``. When a wrapper and the module it
wraps get the same name, the innermost one is kept, so a recipe sees the real module.

A model's modules are walked once into a :class:`ModuleIndex` (parallel lists of names,
modules and classes); selections run over those lists in C where they can, and a
:class:`Target` is made only for a module some action selects, so plans over 100k
modules stay fast.

Example::

    index = ModuleIndex.of(model)
    convs = index.select(["blocks.**"], ["Conv2d"], ["blocks.0.*"], "actions.x")
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress
from typing import Any, NamedTuple

import torch
from torch import nn

from surgery.core.globs import GLOB_CHARS, MAX_GLOB_LENGTH, ROOT, glob_regex, type_matcher
from surgery.errors import ConfigError

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
DDP_TYPE_NAMES = frozenset({"DistributedDataParallel", "DataParallel"})


class Target(NamedTuple):
    """One selectable module: the name recipes and reports use, and where it really lives."""

    name: str  # canonical name used in reports/keys ("<root>", "block1.conv")
    real_name: str  # the name in model.named_modules() ("" for root, "_orig_mod.block1.conv")
    module: nn.Module


def canonical_name(real_name: str, root_is_ddp: bool) -> str:
    """Drop wrapper segments so a bare, compiled, DDP or FSDP model share one name."""
    name = real_name
    if "_orig_mod" in name or "_wrapped_module" in name:  # cheap test first: 100k names
        name = ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)
    if root_is_ddp and (name == "module" or name.startswith("module.")):
        name = name[len("module.") :]
    return name or ROOT


def _root_is_ddp(model: nn.Module) -> bool:
    """Whether the root, looking through compile/FSDP/checkpoint wrappers, is DDP-like."""
    module: nn.Module | None = model
    while module is not None:
        if type(module).__name__ in DDP_TYPE_NAMES:
            return True
        children = module._modules
        module = next((children[s] for s in WRAPPER_SEGMENTS if s in children), None)
    return False


def _walk(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """``named_modules()`` as two lists, without its nested generators: same order, each module once."""
    names: list[str] = []
    modules: list[nn.Module] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    pop, push, mark = stack.pop, stack.extend, seen.add  # bound once: this loop runs once per module
    add_name, add_module = names.append, modules.append
    while stack:
        name, module = pop()
        key = id(module)
        if key in seen:
            continue
        mark(key)
        add_name(name)
        add_module(module)
        children = module._modules
        if children:
            prefix = name + "." if name else ""
            push(
                [(prefix + child_name, child) for child_name, child in reversed(children.items()) if child is not None]
            )
    return names, modules


class ModuleIndex:
    """Every module of a model under its canonical name, as parallel lists; Targets made on demand."""

    __slots__ = ("names", "real_names", "modules", "classes", "_targets")

    def __init__(self, names: list[str], real_names: list[str], modules: list[nn.Module]) -> None:
        self.names, self.real_names, self.modules = names, real_names, modules
        self.classes = list(map(type, modules))
        self._targets: dict[int, Target] = {}

    @classmethod
    def of(cls, model: nn.Module) -> ModuleIndex:
        """Walk ``model`` once: canonical names, the innermost wrapped module winning, in order."""
        real_names, modules = _walk(model)
        root_is_ddp = _root_is_ddp(model)
        if not root_is_ddp and not any("_orig_mod" in n or "_wrapped_module" in n for n in real_names):
            return cls([n or ROOT for n in real_names], real_names, modules)  # the usual case: names are final
        found: dict[str, tuple[str, nn.Module]] = {}
        for real_name, module in zip(real_names, modules):
            found[canonical_name(real_name, root_is_ddp)] = (real_name, module)  # inner wins
        return cls(list(found), [r for r, _ in found.values()], [m for _, m in found.values()])

    @classmethod
    def from_targets(cls, targets: Sequence[Target]) -> ModuleIndex:
        """An index over ``targets`` as given (their order, their names)."""
        index = cls([t.name for t in targets], [t.real_name for t in targets], [t.module for t in targets])
        index._targets = dict(enumerate(targets))
        return index

    def __len__(self) -> int:
        return len(self.names)

    def target(self, i: int) -> Target:
        """The Target of module ``i`` (made once)."""
        found = self._targets.get(i)
        if found is None:
            found = self._targets[i] = Target(self.names[i], self.real_names[i], self.modules[i])
        return found

    def targets(self) -> list[Target]:
        """Every module as a Target, in order."""
        return self._targets_at(range(len(self.names)))

    def select(
        self, select: Sequence[str] | None, types: Sequence[str] | None, exclude: Sequence[str] | None, where: str
    ) -> list[Target]:
        """Modules whose name matches ``select`` (None: all) and whose class matches ``types``,
        minus names matching ``exclude``; in order."""
        name_ok: Callable[[str], Any] | None
        if select is not None and all(_exact_name(p) for p in select):
            name_ok = frozenset(select).__contains__  # exact names (what a site resolves to): no regex to build
        else:
            name_ok = None if select is None else glob_regex(select, f"{where}.select").fullmatch
        type_ok = None if types is None else type_matcher(types, f"{where}.type")
        excluded = glob_regex(exclude or [], f"{where}.exclude").fullmatch
        rows: Iterable[int] = range(len(self.names))
        if name_ok is not None:  # map and compress run in C: one regex call per name and no Python frame
            rows = compress(rows, map(name_ok, self.names))
        if type_ok is not None:
            verdict = {cls: type_ok(cls) for cls in set(self.classes)}
            if name_ok is None:
                rows = compress(rows, map(verdict.__getitem__, self.classes))
            else:
                rows = [i for i in rows if verdict[self.classes[i]]]
        if exclude:
            rows = [i for i in rows if not excluded(self.names[i])]
        return self._targets_at(rows)

    def _targets_at(self, rows: Iterable[int]) -> list[Target]:
        """``[self.target(i) for i in rows]`` without a call per row (a selection can be most of 100k modules)."""
        made, names, real_names, modules = self._targets, self.names, self.real_names, self.modules
        out: list[Target] = []
        add = out.append
        for i in rows:
            found = made.get(i)
            if found is None:
                found = made[i] = Target(names[i], real_names[i], modules[i])
            add(found)
        return out


def module_targets(model: nn.Module) -> list[Target]:
    """Every module under its canonical name, innermost wrapped module winning, in order."""
    return ModuleIndex.of(model).targets()


def select_modules(
    targets: Sequence[Target],
    select: Sequence[str] | None,
    types: Sequence[str] | None,
    exclude: Sequence[str] | None,
    where: str,
) -> list[Target]:
    """Targets whose name matches ``select`` (None: all) and whose class matches ``types``,
    minus names matching ``exclude``; in the order given."""
    return ModuleIndex.from_targets(targets).select(select, types, exclude, where)


def _exact_name(pattern: Any) -> bool:
    """A selector that can only be a module's own name: the fast path; anything else is checked as a glob."""
    return (isinstance(pattern, str) and 0 < len(pattern) <= MAX_GLOB_LENGTH and "" not in pattern.split(".")
            and not GLOB_CHARS.search(pattern))  # fmt: skip


def select_params(
    target: Target, pattern: str, where: str, tensors: str = "parameters"
) -> list[tuple[str, torch.Tensor]]:
    """The module's own (not its children's) parameters or buffers whose name matches."""
    if isinstance(pattern, str) and "." in pattern:
        raise ConfigError(
            f"{where}: {pattern!r} names a tensor of one module, so it has no '.'; pick the submodule with `select`"
        )
    fullmatch = glob_regex([pattern], where).fullmatch
    named: Iterator[tuple[str, torch.Tensor]]
    if tensors == "parameters":
        named = target.module.named_parameters(recurse=False)
    elif tensors == "buffers":
        named = target.module.named_buffers(recurse=False)
    else:
        raise ConfigError(f"{where}: tensors must be 'parameters' or 'buffers', got {tensors!r}")
    return [(name, tensor) for name, tensor in named if fullmatch(name)]


def closest_names(wanted: str, names: Sequence[str], n: int = 5) -> list[str]:
    """Suggestions for a glob that matched nothing: similar names, then shared prefixes."""
    literal = re.sub(r"\.{2,}", ".", GLOB_CHARS.sub("", wanted)).strip(".")
    similar = difflib.get_close_matches(literal, names, n, 0.5) if literal else []
    prefix = GLOB_CHARS.split(wanted, maxsplit=1)[0]
    shared = [len(os.path.commonprefix([prefix, name])) for name in names]
    best = max(shared, default=0)
    same_prefix = [name for name, k in zip(names, shared, strict=True) if best and k == best]
    suggestions = list(dict.fromkeys([*similar, *same_prefix]))[:n]
    return suggestions or _by_segments(wanted, names, n)


def _by_segments(wanted: str, names: Sequence[str], n: int) -> list[str]:
    """Names ranked by how alike their last segments are to the pattern's literal ones (``**.mlp`` finds the
    MLPs of any model), scored once per name shape (numbers as ``*``); model order among equals and when none is."""
    segments = wanted.split(".")
    if "**" in segments:  # aligned from the end up to the '**', which may stand for anything
        segments = segments[len(segments) - segments[::-1].index("**") :]
    if not names or not any(s and not GLOB_CHARS.search(s) for s in segments):
        return list(names[:n])
    shapes: dict[str, list[str]] = {}
    for name in names:
        shapes.setdefault(re.sub(r"(?<![^.])\d+(?![^.])", "*", name), []).append(name)

    def score(shape: str) -> float:
        pairs = zip(reversed(segments), reversed(shape.split(".")))
        alike = (1.0 if GLOB_CHARS.search(a) else difflib.SequenceMatcher(None, a, b).ratio() for a, b in pairs)
        return sum(alike) / len(segments)

    ranked = sorted(shapes, key=score, reverse=True)  # stable: model order among equal scores
    if score(ranked[0]) < 0.5:
        return list(names[:n])
    return [name for shape in ranked for name in shapes[shape]][:n]


def as_list(value: str | Sequence[str] | None) -> list[str] | None:
    """Normalise a YAML string-or-list selector to a list (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    return list(value)
