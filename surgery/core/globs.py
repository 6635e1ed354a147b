"""The glob rule every string selector uses, matched in time linear in the name for each pattern.

Names are canonical module names (see :mod:`surgery.core.select`); the root module is ``<root>``.
A pattern must match the whole name and is split on ``.`` into segments:

==============  =====================================================================
``*``           any run of characters inside one segment (never crosses a dot)
``?``           one character that is not a dot
``[ab]``        a character class: ``[a-z]``, ``[!ab]`` (negated); never matches a dot
``**``          a whole segment: any number of segments, zero included; alone it
                matches every name, ``<root>`` included
``<root>``      the whole pattern: the root module
anything else   literal (``blocks.0`` matches only ``blocks.0``, not ``blocks.01``)
==============  =====================================================================

``a**b`` (``**`` sharing a segment), an unclosed ``[``, an empty segment, ``<root>`` inside a
longer pattern and a pattern over ``MAX_GLOB_LENGTH`` characters are config errors. The root has
no segments, so only ``<root>`` and all-``**`` patterns match it (``*`` needs exactly one segment).

Time: every glob is one regex that cannot backtrack without bound (``*?*?*?b``, ``**.a.**.b``):
the pieces between a segment's stars, and the runs of segments between two ``**``, are each
placed where they first fit and never tried again (atomic groups), which finds a match whenever
there is one. Where ``rename`` needs what each wildcard matched, or a name has an empty segment,
:mod:`surgery.core.glob_table` matches without backtracking.

Type patterns: without a dot, a glob on ``type(module).__name__`` (exact class, no
subclasses: ``Conv2d``, ``Function_*``); with a dot, the same glob rule on
``PKG.__qualname__`` for each package prefix PKG of the class's ``__module__``, so
``torch.nn.Conv2d`` and ``torch.nn.modules.conv.Conv2d`` both name ``nn.Conv2d``.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

from surgery.core.glob_table import LinearGlob, runs
from surgery.errors import ConfigError

ROOT = "<root>"
GLOB_CHARS = re.compile(r"\[[^\]]*\]?|[*?]")
MAX_GLOB_LENGTH = 1000

_DOUBLE_STAR = {  # (first segment, last segment) -> regex for a '**' segment
    (True, False): r"(?:[^.]+\.)*",
    (False, True): r"(?:\.[^.]+)*",
    (False, False): r"\.(?:[^.]+\.)*",
}
_STAR = None  # in a segment's atoms: '*'; every other atom is (regex of one character, is a wildcard)


def _atoms(segment: str, pattern: str, where: str) -> list[tuple[str, bool] | None]:
    """One dotted segment of a glob (no ``**``) as atoms: ``None`` for ``*``, else one character's regex."""
    out: list[tuple[str, bool] | None] = []
    i, n = 0, len(segment)
    while i < n:
        c = segment[i]
        i += 1
        if c == "*":
            out.append(_STAR)
        elif c == "?":
            out.append(("[^.]", True))
        elif c == "[":
            j = i + 1 if i < n and segment[i] == "!" else i
            j = j + 1 if j < n and segment[j] == "]" else j  # a leading ']' is literal
            end = segment.find("]", j)
            if end < 0:
                raise ConfigError(f"{where}: unclosed '[' in glob {pattern!r}")
            negate = segment[i] == "!"
            body = "".join(ch if ch == "-" else re.escape(ch) for ch in segment[i + negate : end])
            out.append((f"[^.{body}]" if negate else f"[{body}]", True))
            i = end + 1
        else:
            out.append((re.escape(c), False))
    return out


def _segment_regex(atoms: list[tuple[str, bool] | None], capture: bool) -> str:
    """The regex of one segment's atoms; ``capture`` groups each wildcard (for rename, at most one star)."""
    parts = ["[^.]*" if atom is None else atom[0] for atom in atoms]
    if capture:
        return "".join(f"({p})" if atom is None or atom[1] else p for p, atom in zip(parts, atoms))
    pieces = ["".join(a for a, _ in run) for run in runs(atoms)]  # the fixed-width pieces between the stars
    if len(pieces) <= 2:
        return "".join(parts)
    # The pieces between the first and the last star, each where it first fits and never tried again: a
    # glob's segment matches if and only if it matches so, and no star can backtrack over another.
    middle = "".join(_once("[^.]*?" + piece) for piece in pieces[1:-1])
    return pieces[0] + middle + "[^.]*" + pieces[-1]


_IDS = itertools.count()


def _once(body: str) -> str:
    """``body`` matched where it first can and never tried again: an atomic group, as Python 3.10's re writes it."""
    name = f"g{next(_IDS)}"
    return f"(?=(?P<{name}>{body}))(?P={name})"


def _segments(pattern: str, where: str) -> list[str]:
    """The segments of a glob, checked, with ``**.**`` folded to ``**``."""
    if len(pattern) > MAX_GLOB_LENGTH:
        raise ConfigError(
            f"{where}: glob is {len(pattern):,} characters long, more than {MAX_GLOB_LENGTH:,}: {pattern[:40]!r}..."
        )
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
    return segments


def _regex_source(segments: list[str], atoms: list[Any], capture: bool) -> str:
    """Regex source that must match a whole non-root name (``atoms[i]`` of each non-``**`` segment)."""
    if segments == ["**"]:
        return "(.+)" if capture else ".+"
    if not capture and segments.count("**") > 1:
        return _groups_source(segments, atoms)
    out: list[str] = []
    for i, seg in enumerate(segments):
        if seg == "**":  # zero or more whole segments, with the dots around them
            first, last = i == 0, i == len(segments) - 1
            out.append(f"({_DOUBLE_STAR[first, last]})" if capture else _DOUBLE_STAR[first, last])
        else:
            if i > 0 and segments[i - 1] != "**":
                out.append(r"\.")
            out.append(_segment_regex(atoms[i], capture))
    return "".join(out)


def _groups_source(segments: list[str], atoms: list[Any]) -> str:
    """A yes/no regex for a glob with several ``**``, for names without empty segments (the others are refused
    here and matched by :class:`LinearGlob`): each run of segments between two ``**`` is placed where it first
    fits and never tried again, so no ``**`` backtracks over another; the last ``**`` alone may backtrack."""
    groups: list[list[str]] = [[]]
    for i, seg in enumerate(segments):
        if seg == "**":
            groups.append([])
        else:
            groups[-1].append(_segment_regex(atoms[i], capture=False))
    out = [r"(?!\.|(?s:.*)\.\.|(?s:.*)\.\Z)", r"\.".join(groups[0])]  # no empty segment
    for i in range(1, len(groups) - 1):
        lead = r"\." if i > 1 or groups[0] else ""
        out.append(lead + _once(r"(?:[^.]+\.)*?" + r"\.".join(groups[i]) + r"(?=\.|\Z)"))
    out.append(r"\.(?:[^.]+\.)*" + r"\.".join(groups[-1]) if groups[-1] else r"(?:\.[^.]+)*")
    return "".join(out)


def _has_empty_segment(name: str) -> bool:
    return name.startswith(".") or name.endswith(".") or ".." in name


def _parse(pattern: str, where: str) -> tuple[list[str], list[Any], bool]:
    """Segments, each segment's atoms (None for ``**``), and whether a regex with a group per wildcard (for
    rename's captures) could backtrack on it: several ``**``, or a segment with several ``*``."""
    segments = _segments(pattern, where)
    atoms = [None if seg == "**" else _atoms(seg, pattern, where) for seg in segments]
    stars = [sum(a is None for a in seg_atoms) for seg_atoms in atoms if seg_atoms is not None]
    backtracks = segments.count("**") > 1 or any(count > 1 for count in stars)
    return segments, atoms, backtracks


def _compile(source: str, patterns: Any, where: str) -> re.Pattern[str]:
    try:
        return re.compile(source)
    except re.error as exc:  # e.g. a reversed range '[z-a]'
        raise ConfigError(f"{where}: bad glob in {list(patterns)!r}: {exc}") from None


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
            found.extend("*" for _ in GLOB_CHARS.findall(seg))
    return found


def glob_rename(old: str, new: str, where: str) -> Callable[[str], str | None]:
    """``rename(name)``: ``new`` with ``old``'s wildcards filled in order, or None when ``old`` does not match.

    ``blocks.*.attn`` → ``layers.*.attention`` renames ``blocks.3.attn`` to ``layers.3.attention``;
    ``module.**`` → ``**`` drops a prefix. Both sides need the same wildcards in the same order.
    """
    if len(new) > MAX_GLOB_LENGTH:
        _segments(new, where)  # the same message as for the old glob
    old_kinds, new_tags = [w[:2] for w in _wildcards(old)], _wildcards(new)
    if old_kinds != [w[:2] for w in new_tags]:
        raise ConfigError(
            f"{where}: {old!r} -> {new!r}: the new name needs the same wildcards in the same order"
            f" ({' '.join(old_kinds) or 'none'} vs {' '.join(w[:2] for w in new_tags) or 'none'})"
        )
    segments, atoms, backtracks = _parse(old, where)
    regex = _compile(_regex_source(segments, atoms, capture=not backtracks), [old], where)
    linear = LinearGlob(segments, atoms) if backtracks else None
    several = segments.count("**") > 1
    parts = re.split(r"(\*\*|\[[^\]]*\]|\*|\?)", new)  # literals at even positions, wildcards at odd

    def rename(name: str) -> str | None:
        match = regex.fullmatch(name)
        if linear is None:
            groups: Sequence[str] | None = None if match is None else match.groups()
        elif match is not None or (several and _has_empty_segment(name)):  # the yes/no regex first: most keys
            groups = linear.captures(name)
        else:
            return None
        if groups is None:
            return None
        out = list(parts)
        for k, (captured, tag) in enumerate(zip(groups, new_tags)):
            at = 2 * k + 1
            out[at] = captured.strip(".") if tag.startswith("**") else captured
            if tag in ("**<", "**=") and not out[at]:  # zero segments: drop the dot after it
                out[at + 1] = out[at + 1][1:]
            elif tag == "**>" and not out[at]:  # ... or the dot before it
                out[at - 1] = out[at - 1][:-1]
        return "".join(out)

    return rename


class _Globs:
    """Globs with several ``**``: their regex, and for a name with an empty segment (``a..b``, which no module
    has), which that regex leaves out, the table of :class:`LinearGlob`."""

    __slots__ = ("_regex", "_linear")

    def __init__(self, regex: re.Pattern[str], linear: list[LinearGlob]) -> None:
        self._regex, self._linear = regex, linear

    def fullmatch(self, name: str) -> bool | None:
        if self._regex.fullmatch(name) is not None:
            return True
        if name == ROOT or not _has_empty_segment(name):
            return None
        return True if any(glob.captures(name) is not None for glob in self._linear) else None


def glob_regex(patterns: str | Sequence[str], where: str) -> Any:
    """The alternation of ``patterns``: an object whose ``fullmatch(name)`` is truthy for a matching name."""
    if isinstance(patterns, str):  # one glob, never a list of characters
        patterns = [patterns]
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{where}: expected a non-empty glob string, got {p!r}")
    return _cachedglob_regex(tuple(patterns), where)


@functools.lru_cache(maxsize=256)
def _cachedglob_regex(patterns: tuple[str, ...], where: str) -> Any:
    root = any(p == ROOT or set(p.split(".")) == {"**"} for p in patterns)
    parsed = [_parse(p, where) for p in patterns if p != ROOT]
    body = "|".join(f"(?:{_regex_source(segments, atoms, capture=False)})" for segments, atoms, _ in parsed)
    # The root has no segments: '*' or '?*' must not reach it through the text '<root>'.
    source = f"{re.escape(ROOT)}|{body or '(?!)'}" if root else rf"(?!{re.escape(ROOT)}\Z)(?:{body or '(?!)'})"
    regex = _compile(source, patterns, where)
    linear = [LinearGlob(segments, atoms) for segments, atoms, _ in parsed if segments.count("**") > 1]
    return _Globs(regex, linear) if linear else regex


def compile_globs(patterns: Sequence[str], where: str) -> Callable[[str], bool]:
    """Return ``matches(name)``: true when any pattern matches the whole canonical name."""
    fullmatch = glob_regex(patterns, where).fullmatch
    return lambda name: fullmatch(name) is not None


def _qualified_names(cls: type) -> list[str]:
    """``PKG.qualname`` for every package prefix PKG of the class's module."""
    parts = cls.__module__.split(".")
    return [".".join(parts[:k]) + "." + cls.__qualname__ for k in range(1, len(parts) + 1)]


def original_class(cls: type) -> type:
    """The class FSDP2's ``fully_shard`` renamed (``FSDPLinear`` is ``(FSDPModule, Linear)``): ``type:`` sees it."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def type_matcher(patterns: Sequence[str], where: str) -> Callable[[type], bool]:
    """Return ``matches(cls)`` for class-name globs and qualified globs, cached per class."""
    if isinstance(patterns, str):
        patterns = [patterns]
    glob_regex(patterns, where)  # validate every pattern before splitting them
    short_match = glob_regex([p for p in patterns if "." not in p], where).fullmatch
    dotted = [p for p in patterns if "." in p]
    dotted_match = glob_regex(dotted, where).fullmatch
    cache: dict[type, bool] = {}

    def matches(cls: type) -> bool:
        hit = cache.get(cls)
        if hit is None:
            seen = original_class(cls)
            hit = short_match(seen.__name__) is not None or (
                bool(dotted) and any(dotted_match(q) for q in _qualified_names(seen))
            )
            cache[cls] = hit
        return hit

    return matches
