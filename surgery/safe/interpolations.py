"""Interpolations read before anything resolves them: loops, resolved sizes, and (under safe=true) resolvers.

OmegaConf resolves ``${...}`` each time a value is read and caches no string interpolation, so
``a1: ${a0}${a0}`` doubled 36 times is 2^36 characters and as many steps, and a resolver such as
``${oc.env:SECRET}`` runs as soon as anything reads the value. So the raw text of every value is
parsed once with OmegaConf's own grammar: the references form a graph whose loops are refused and
whose resolved sizes are summed (memoized) before Hydra or the job reads a value; under
``safe=true`` only plain interpolation and Hydra's ``now`` and ``hydra`` resolvers are admitted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from surgery.errors import ConfigError

MAX_RESOLVED_CHARS = 1_000_000  # no run setting is anywhere near this long once resolved
MAX_RESOLVER_ARGUMENT = 256  # ${now:FORMAT}'s format and the like: a date format is a few dozen characters
SAFE_RESOLVERS = ("now", "hydra")  # what the shipped run directories and Hydra's defaults use
ALLOWED = "plain interpolation ${a.b} or ${.sibling}, ${now:FORMAT}, ${hydra:KEY}"

Key = tuple[str, ...]


def dotted(key: Key) -> str:
    """``('actions', 'a', '0')`` as ``actions.a.0``: how error messages name a key."""
    return ".".join(key) or "<root>"


def check_interpolations(raw: Any, safe: bool) -> None:
    """Refuse interpolation loops and values that would resolve too large; under ``safe`` also resolvers.

    ``raw`` is the whole config as plain values, unresolved (``OmegaConf.to_container(cfg, resolve=False)``).
    """
    record = ("hydra", "overrides")  # Hydra's copy of the command line: name the key the override set first
    found = sorted(_interpolated(raw), key=lambda item: item[0][:2] == record)
    refs = {key: _references(key, text, safe) for key, text in found}
    if refs:
        _check_sizes(raw, refs)


def _interpolated(raw: Any) -> Iterator[tuple[Key, str]]:
    """Every string value holding ``${``, with its key path (keys are made only for containers and those)."""
    stack: list[tuple[Any, Key]] = [(raw, ())]
    while stack:
        node, key = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for name, value in items:
            if isinstance(value, (dict, list)):
                stack.append((value, (*key, str(name))))
            elif isinstance(value, str) and "${" in value:
                yield (*key, str(name)), value


def _references(key: Key, text: str, safe: bool) -> list[Key]:
    """The keys ``text`` (the value at ``key``) interpolates; under ``safe`` refuse any other resolver."""
    _check_arguments(key, text)
    parsed = _parse(text)
    if parsed is None:  # not valid interpolation grammar: OmegaConf refuses it when it is read
        return []
    found = []
    for kind, payload in parsed:
        if kind == "resolver":
            name, argument = payload
            if safe and name not in SAFE_RESOLVERS:
                raise ConfigError(
                    f"{dotted(key)}: ${{{name}:...}} runs a resolver, refused because safe=true"
                    f" (allowed: {ALLOWED}; set safe=false to allow it)"
                )
            if name == "hydra" and argument:
                found.append(("hydra", *argument.split(".")))
        elif kind == "computed":
            if safe:
                raise ConfigError(
                    f"{dotted(key)}: {payload!r} computes the key it reads, which safe=true cannot check"
                    f" (allowed: {ALLOWED}; set safe=false to allow it)"
                )
        else:
            dots, parts = payload
            if dots == 0:
                found.append(tuple(parts))
            else:  # ${.x}: a sibling; each further dot one level up
                base = key[:-1]
                base = base[: max(0, len(base) - (dots - 1))]
                found.append((*base, *parts))
    return found


_RESOLVER = re.compile(r"\$\{\s*([\w.]+)\s*:")
_BRACE = re.compile(r"[{}]")


def _check_arguments(key: Key, text: str) -> None:
    """Refuse a resolver argument longer than MAX_RESOLVER_ARGUMENT before OmegaConf's parser (seconds per
    100 KB) or the resolver (``now``'s strftime) ever sees it; a linear scan of the braces."""
    for opening in _RESOLVER.finditer(text):
        depth, end = 1, len(text)
        for brace in _BRACE.finditer(text, opening.end()):
            depth += 1 if brace.group() == "{" else -1
            if depth == 0:
                end = brace.start()
                break
            if brace.start() - opening.end() > MAX_RESOLVER_ARGUMENT:
                break
        length = end - opening.end()
        if length > MAX_RESOLVER_ARGUMENT:
            raise ConfigError(
                f"{dotted(key)}: the argument of ${{{opening.group(1)}:...}} is {length:,} characters, more than the"
                f" {MAX_RESOLVER_ARGUMENT} a resolver's argument may have"
            )


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[tuple[str, Any], ...] | None:
    """The interpolations in ``text``: ('node', (dots, parts)), ('resolver', (name, plain argument)) or
    ('computed', text); None when OmegaConf's grammar does not parse it."""
    from omegaconf import grammar_parser
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as P

    try:
        tree = grammar_parser.parse(text)
    except GrammarParseError:
        return None
    found: list[tuple[str, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, P.InterpolationNodeContext):
            keys = [c for c in node.getChildren() if isinstance(c, P.ConfigKeyContext)]
            if any(k.interpolation() is not None for k in keys):
                found.append(("computed", node.getText()))
            else:
                dots = 0
                for child in node.getChildren():
                    if isinstance(child, P.ConfigKeyContext):
                        break
                    dots += child.getText() == "."
                found.append(("node", (dots, tuple(k.getText() for k in keys))))
        elif isinstance(node, P.InterpolationResolverContext):
            name = node.resolverName().getText()
            sequence = node.sequence()
            argument = sequence.getText() if sequence is not None and "${" not in sequence.getText() else ""
            found.append(("resolver", (name, argument)))
        if hasattr(node, "getChildren"):
            stack.extend(node.getChildren())
    return tuple(found)


_MISSING = object()


def _node(raw: Any, key: Key) -> Any:
    """The raw value at ``key``, or ``_MISSING`` (an interpolation of a key that is not there: OmegaConf says so)."""
    node = raw
    for part in key:
        if isinstance(node, dict):
            node = node[part] if part in node else next((v for k, v in node.items() if str(k) == part), _MISSING)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _check_sizes(raw: Any, refs: dict[Key, list[Key]]) -> None:
    """Depth-first over references and containers: a loop, or a resolved size over the bound, is refused."""
    size: dict[Key, int] = {}
    on_path: set[Key] = set()

    def edges(key: Key, node: Any) -> list[tuple[Key, Any]]:
        if isinstance(node, dict):
            return [((*key, str(k)), v) for k, v in node.items()]
        if isinstance(node, list):
            return [((*key, str(i)), v) for i, v in enumerate(node)]
        targets = [(r, _node(raw, r)) for r in refs.get(key, [])]
        return [(r, n) for r, n in targets if n is not _MISSING]

    for start in refs:  # every loop passes through an interpolation; sizes only matter where one reads them
        if start in size:
            continue
        first = _node(raw, start)
        stack: list[tuple[Key, Any, list[tuple[Key, Any]], int]] = [(start, first, edges(start, first), 0)]
        on_path.add(start)
        while stack:
            key, node, out, index = stack[-1]
            if index < len(out):
                stack[-1] = (key, node, out, index + 1)
                nxt, value = out[index]
                if nxt in on_path:
                    keys = [k for k, _, _, _ in stack]
                    loop = " -> ".join(dotted(k) for k in keys[keys.index(nxt) :])
                    raise ConfigError(
                        f"{dotted(nxt)}: an interpolation loop ({loop} -> {dotted(nxt)}); no value can be resolved"
                    )
                if nxt in size:
                    continue
                if not isinstance(value, (dict, list)) and nxt not in refs:  # a plain leaf: no need to descend
                    size[nxt] = len(str(value)) + len(nxt[-1])
                    continue
                on_path.add(nxt)
                stack.append((nxt, value, edges(nxt, value), 0))
                continue
            stack.pop()
            on_path.discard(key)
            own = 0 if isinstance(node, (dict, list)) else len(str(node))
            total = own + len(key[-1] if key else "") + sum(size[k] for k, _ in out)
            size[key] = total
            if total > MAX_RESOLVED_CHARS and key in refs:
                raise ConfigError(
                    f"{dotted(key)}: would resolve to about {total:,} characters (its interpolations nest and"
                    f" repeat), more than the {MAX_RESOLVED_CHARS:,} a config value may have"
                )
