"""Pick modules and parameters by glob, one rule for every string selector.

Names are ``model.named_modules()`` names; the root module is ``<root>``. A pattern must
match the whole name and is split on ``.`` into segments:

==============  =====================================================================
``*``           any run of characters inside one segment (never crosses a dot)
``?``           one character that is not a dot
``[ab]``        a character class: ``[a-z]``, ``[!ab]`` (negated); never matches a dot
``**``          a whole segment: any number of segments, zero included; alone it
                matches every name, ``<root>`` included
``<root>``      the whole pattern: the root module
anything else   literal (``blocks.0`` matches only ``blocks.0``, not ``blocks.01``)
==============  =====================================================================

``a**b`` (``**`` sharing a segment), an unclosed ``[``, an empty segment and ``<root>``
inside a longer pattern are config errors. The root has no segments, so only
``<root>`` and all-``**`` patterns match it (``*`` needs exactly one segment).

Wrappers are invisible: the segments ``_orig_mod`` (``torch.compile``),
``_fsdp_wrapped_module`` and ``_checkpoint_wrapped_module`` are dropped anywhere, and a
leading ``module`` segment is dropped when the root (after those wrappers) is a class
named ``DistributedDataParallel`` or ``DataParallel``. When a wrapper and the module it
wraps get the same name, the innermost one is kept, so a recipe sees the real module.

Type patterns: without a dot, a glob on ``type(module).__name__`` (exact class, no
subclasses: ``Conv2d``, ``Function_*``); with a dot, the same glob rule on
``PKG.__qualname__`` for each package prefix PKG of the class's ``__module__``, so
``torch.nn.Conv2d`` and ``torch.nn.modules.conv.Conv2d`` both name ``nn.Conv2d``.

Example::

    targets = module_targets(model)
    convs = select_modules(targets, ["blocks.**"], ["Conv2d"], ["blocks.0.*"], "actions.x")
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from surgery.errors import ConfigError

ROOT = "<root>"
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
DDP_TYPE_NAMES = frozenset({"DistributedDataParallel", "DataParallel"})
_GLOB_CHARS = re.compile(r"\[[^\]]*\]?|[*?]")
_DOUBLE_STAR = {  # (first segment, last segment) -> regex for a '**' segment
    (True, False): r"(?:[^.]+\.)*",
    (False, True): r"(?:\.[^.]+)*",
    (False, False): r"\.(?:[^.]+\.)*",
}


@dataclass(frozen=True)
class Target:
    """One selectable module: the name recipes and reports use, and where it really lives."""

    name: str  # canonical name used in reports/keys ("<root>", "block1.conv")
    real_name: str  # the name in model.named_modules() ("" for root, "_orig_mod.block1.conv")
    module: nn.Module


def canonical_name(real_name: str, root_is_ddp: bool = False) -> str:
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


def module_targets(model: nn.Module) -> list[Target]:
    """Every module under its canonical name, innermost wrapped module winning, in order."""
    root_is_ddp = _root_is_ddp(model)
    found: dict[str, tuple[str, nn.Module]] = {}
    for real_name, module in model.named_modules():
        found[canonical_name(real_name, root_is_ddp)] = (real_name, module)  # inner wins
    return [Target(name, real, module) for name, (real, module) in found.items()]


def _segment_regex(segment: str, pattern: str, where: str, capture: bool = False) -> str:
    """Translate one dotted segment of a glob (no ``**``) into a regex; ``capture`` groups wildcards."""
    out: list[str] = []
    i, n = 0, len(segment)
    while i < n:
        c = segment[i]
        i += 1
        if c == "*":
            out.append("([^.]*)" if capture else "[^.]*")
        elif c == "?":
            out.append("([^.])" if capture else "[^.]")
        elif c == "[":
            j = i + 1 if i < n and segment[i] == "!" else i
            j = j + 1 if j < n and segment[j] == "]" else j  # a leading ']' is literal
            end = segment.find("]", j)
            if end < 0:
                raise ConfigError(f"{where}: unclosed '[' in glob {pattern!r}")
            negate = segment[i] == "!"
            body = "".join(ch if ch == "-" else re.escape(ch) for ch in segment[i + negate : end])
            cls = f"[^.{body}]" if negate else f"[{body}]"
            out.append(f"({cls})" if capture else cls)
            i = end + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


def _glob_regex_source(pattern: str, where: str, capture: bool = False) -> str:
    """Translate one glob into regex source that must match a whole non-root name."""
    segments: list[str] = []
    for seg in pattern.split("."):
        if not seg:
            raise ConfigError(f"{where}: empty segment in glob {pattern!r} (stray '.')")
        if "**" in seg and seg != "**":
            raise ConfigError(f"{where}: `**` must be a whole segment, got {pattern!r}")
        if ROOT in seg:
            raise ConfigError(f"{where}: {ROOT!r} must be the whole pattern, got {pattern!r}")
        if not (seg == "**" and segments and segments[-1] == "**"):  # '**.**' is '**'
            segments.append(seg)
    if segments == ["**"]:
        return "(.+)" if capture else ".+"
    out: list[str] = []
    for i, seg in enumerate(segments):
        if seg == "**":  # zero or more whole segments, with the dots around them
            first, last = i == 0, i == len(segments) - 1
            out.append(f"({_DOUBLE_STAR[first, last]})" if capture else _DOUBLE_STAR[first, last])
        else:
            if i > 0 and segments[i - 1] != "**":
                out.append(r"\.")
            out.append(_segment_regex(seg, pattern, where, capture))
    return "".join(out)


def _wildcards(pattern: str) -> list[str]:
    """The wildcards of a glob in order; ``**`` tagged by where it stands (its dots differ)."""
    segments = pattern.split(".")
    found: list[str] = []
    for i, seg in enumerate(segments):
        if seg == "**":
            found.append(
                "**" + ("" if len(segments) == 1 else "<" if i == 0 else ">" if i == len(segments) - 1 else "=")
            )
        else:
            found.extend("*" for _ in _GLOB_CHARS.findall(seg))
    return found


def glob_rename(old: str, new: str, where: str) -> Callable[[str], str | None]:
    """``rename(name)``: ``new`` with ``old``'s wildcards filled in order, or None when ``old`` does not match.

    ``blocks.*.attn`` → ``layers.*.attention`` renames ``blocks.3.attn`` to ``layers.3.attention``;
    ``module.**`` → ``**`` drops a prefix. Both sides need the same wildcards in the same order.
    """
    old_kinds, new_tags = [w[:2] for w in _wildcards(old)], _wildcards(new)
    if old_kinds != [w[:2] for w in new_tags]:
        raise ConfigError(
            f"{where}: {old!r} -> {new!r}: the new name needs the same wildcards in the same order"
            f" ({' '.join(old_kinds) or 'none'} vs {' '.join(w[:2] for w in new_tags) or 'none'})"
        )
    regex = re.compile(_glob_regex_source(old, where, capture=True))
    parts = re.split(r"(\*\*|\[[^\]]*\]|\*|\?)", new)  # literals at even positions, wildcards at odd

    def rename(name: str) -> str | None:
        match = regex.fullmatch(name)
        if match is None:
            return None
        out = list(parts)
        for k, (captured, tag) in enumerate(zip(match.groups(), new_tags)):
            at = 2 * k + 1
            out[at] = captured.strip(".") if tag.startswith("**") else captured
            if tag in ("**<", "**=") and not out[at]:  # zero segments: drop the dot after it
                out[at + 1] = out[at + 1][1:]
            elif tag == "**>" and not out[at]:  # ... or the dot before it
                out[at - 1] = out[at - 1][:-1]
        return "".join(out)

    return rename


def _glob_regex(patterns: str | Sequence[str], where: str) -> re.Pattern[str]:
    """One regex for the alternation of ``patterns``; ``fullmatch`` it against names."""
    if isinstance(patterns, str):  # one glob, never a list of characters
        patterns = [patterns]
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{where}: expected a non-empty glob string, got {p!r}")
    return _cached_glob_regex(tuple(patterns), where)


@functools.lru_cache(maxsize=256)
def _cached_glob_regex(patterns: tuple[str, ...], where: str) -> re.Pattern[str]:
    root = any(p == ROOT or set(p.split(".")) == {"**"} for p in patterns)
    sources = [_glob_regex_source(p, where) for p in patterns if p != ROOT]
    body = "|".join(f"(?:{s})" for s in sources) or "(?!)"
    # The root has no segments: '*' or '?*' must not reach it through the text '<root>'.
    source = f"{re.escape(ROOT)}|{body}" if root else rf"(?!{re.escape(ROOT)}\Z)(?:{body})"
    try:
        return re.compile(source)
    except re.error as exc:  # e.g. a reversed range '[z-a]'
        raise ConfigError(f"{where}: bad glob in {list(patterns)!r}: {exc}") from None


def compile_globs(patterns: Sequence[str], where: str) -> Callable[[str], bool]:
    """Return ``matches(name)``: true when any pattern matches the whole canonical name."""
    fullmatch = _glob_regex(patterns, where).fullmatch
    return lambda name: fullmatch(name) is not None


def _qualified_names(cls: type) -> list[str]:
    """``PKG.qualname`` for every package prefix PKG of the class's module."""
    parts = cls.__module__.split(".")
    return [".".join(parts[:k]) + "." + cls.__qualname__ for k in range(1, len(parts) + 1)]


def type_matcher(patterns: Sequence[str], where: str) -> Callable[[type], bool]:
    """Return ``matches(cls)`` for class-name globs and qualified globs, cached per class."""
    if isinstance(patterns, str):
        patterns = [patterns]
    _glob_regex(patterns, where)  # validate every pattern before splitting them
    short_match = _glob_regex([p for p in patterns if "." not in p], where).fullmatch
    dotted = [p for p in patterns if "." in p]
    dotted_match = _glob_regex(dotted, where).fullmatch
    cache: dict[type, bool] = {}

    def matches(cls: type) -> bool:
        hit = cache.get(cls)
        if hit is None:
            hit = short_match(cls.__name__) is not None or (
                bool(dotted) and any(dotted_match(q) for q in _qualified_names(cls))
            )
            cache[cls] = hit
        return hit

    return matches


def select_modules(
    targets: Sequence[Target],
    select: Sequence[str] | None,
    types: Sequence[str] | None,
    exclude: Sequence[str] | None,
    where: str,
) -> list[Target]:
    """Targets whose name matches ``select`` (None: all) and whose class matches ``types``,
    minus names matching ``exclude``; in the order given."""
    name_ok = None if select is None else _glob_regex(select, f"{where}.select").fullmatch
    type_ok = None if types is None else type_matcher(types, f"{where}.type")
    excluded = _glob_regex(exclude or [], f"{where}.exclude").fullmatch
    return [
        t
        for t in targets
        if (name_ok is None or name_ok(t.name))
        and (type_ok is None or type_ok(type(t.module)))
        and not (exclude and excluded(t.name))
    ]


def select_params(
    target: Target, pattern: str, where: str, tensors: str = "parameters"
) -> list[tuple[str, torch.Tensor]]:
    """The module's own (not its children's) parameters or buffers whose name matches."""
    if isinstance(pattern, str) and "." in pattern:
        raise ConfigError(
            f"{where}: {pattern!r} names a tensor of one module, so it has no '.'; pick the submodule with `select`"
        )
    fullmatch = _glob_regex([pattern], where).fullmatch
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
    literal = re.sub(r"\.{2,}", ".", _GLOB_CHARS.sub("", wanted)).strip(".")
    similar = difflib.get_close_matches(literal, names, n, 0.5) if literal else []
    prefix = _GLOB_CHARS.split(wanted, maxsplit=1)[0]
    shared = [len(os.path.commonprefix([prefix, name])) for name in names]
    best = max(shared, default=0)
    same_prefix = [name for name, k in zip(names, shared, strict=True) if best and k == best]
    suggestions = list(dict.fromkeys([*similar, *same_prefix]))[:n]
    return suggestions or list(names[:n])


def as_list(value: str | Sequence[str] | None) -> list[str] | None:
    """Normalise a YAML string-or-list selector to a list (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    return list(value)
