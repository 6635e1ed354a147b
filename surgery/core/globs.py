"""The glob rule every string selector uses, compiled to regexes once.

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

``a**b`` (``**`` sharing a segment), an unclosed ``[``, an empty segment and ``<root>``
inside a longer pattern are config errors. The root has no segments, so only
``<root>`` and all-``**`` patterns match it (``*`` needs exactly one segment).

Type patterns: without a dot, a glob on ``type(module).__name__`` (exact class, no
subclasses: ``Conv2d``, ``Function_*``); with a dot, the same glob rule on
``PKG.__qualname__`` for each package prefix PKG of the class's ``__module__``, so
``torch.nn.Conv2d`` and ``torch.nn.modules.conv.Conv2d`` both name ``nn.Conv2d``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from surgery.errors import ConfigError

ROOT = "<root>"
GLOB_CHARS = re.compile(r"\[[^\]]*\]?|[*?]")

_DOUBLE_STAR = {  # (first segment, last segment) -> regex for a '**' segment
    (True, False): r"(?:[^.]+\.)*",
    (False, True): r"(?:\.[^.]+)*",
    (False, False): r"\.(?:[^.]+\.)*",
}


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
            found.extend("*" for _ in GLOB_CHARS.findall(seg))
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


def glob_regex(patterns: str | Sequence[str], where: str) -> re.Pattern[str]:
    """One regex for the alternation of ``patterns``; ``fullmatch`` it against names."""
    if isinstance(patterns, str):  # one glob, never a list of characters
        patterns = [patterns]
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{where}: expected a non-empty glob string, got {p!r}")
    return _cachedglob_regex(tuple(patterns), where)


@functools.lru_cache(maxsize=256)
def _cachedglob_regex(patterns: tuple[str, ...], where: str) -> re.Pattern[str]:
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
