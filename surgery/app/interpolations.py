"""Interpolations read before anything resolves them: loops, resolved sizes, and (under safe=true) resolvers.

OmegaConf resolves ``${...}`` each time a value is read and caches no string interpolation, so
``a1: ${a0}${a0}`` doubled 36 times is 2^36 characters and as many steps, and a resolver such as
``${oc.env:SECRET}`` runs as soon as anything reads the value. So the raw text of every value is
parsed once with OmegaConf's own grammar: the references form a graph whose loops are refused and
whose resolved sizes are summed (memoized) before Hydra or the job reads a value; under
``safe=true`` only plain interpolation and Hydra's ``now`` and ``hydra`` resolvers are admitted.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from surgery.errors import ConfigError

MAX_RESOLVED_CHARS = 1_000_000  # no run setting is anywhere near this long once resolved
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
    values: dict[Key, Any] = {}
    children: dict[Key, list[Key]] = {}
    _flatten(raw, (), values, children)
    refs: dict[Key, list[Key]] = {}
    record = ("hydra", "overrides")  # Hydra's copy of the command line: name the key the override set first
    for key, value in sorted(values.items(), key=lambda item: item[0][:2] == record):
        if isinstance(value, str) and "${" in value:
            refs[key] = _references(key, value, safe)
    _check_sizes(values, children, refs)


def _flatten(node: Any, key: Key, values: dict[Key, Any], children: dict[Key, list[Key]]) -> None:
    """Every node by its key path: leaves with their value, containers with their children's keys."""
    stack = [(node, key)]
    while stack:
        node, key = stack.pop()
        if isinstance(node, dict):
            items: list[tuple[str, Any]] = [(str(k), v) for k, v in node.items()]
        elif isinstance(node, list):
            items = [(str(i), v) for i, v in enumerate(node)]
        else:
            values[key] = node
            continue
        children[key] = [(*key, k) for k, _ in items]
        stack.extend((v, (*key, k)) for k, v in items)


def _references(key: Key, text: str, safe: bool) -> list[Key]:
    """The keys ``text`` (the value at ``key``) interpolates; under ``safe`` refuse any other resolver."""
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


def _check_sizes(values: dict[Key, Any], children: dict[Key, list[Key]], refs: dict[Key, list[Key]]) -> None:
    """Depth-first over references and containers: a loop, or a resolved size over the bound, is refused."""
    size: dict[Key, int] = {}
    on_path: set[Key] = set()

    def edges(key: Key) -> list[Key]:
        if key in children:
            return children[key]
        return [r for r in refs.get(key, []) if r in values or r in children]

    for start in [*values, *children]:
        if start in size:
            continue
        stack: list[tuple[Key, int]] = [(start, 0)]
        on_path.add(start)
        while stack:
            key, index = stack[-1]
            out = edges(key)
            if index < len(out):
                stack[-1] = (key, index + 1)
                nxt = out[index]
                if nxt in on_path:
                    loop = " -> ".join(dotted(k) for k, _ in stack[[k for k, _ in stack].index(nxt) :])
                    raise ConfigError(
                        f"{dotted(nxt)}: an interpolation loop ({loop} -> {dotted(nxt)}); no value can be resolved"
                    )
                if nxt not in size:
                    on_path.add(nxt)
                    stack.append((nxt, 0))
                continue
            stack.pop()
            on_path.discard(key)
            own = len(str(values.get(key, ""))) + len(key[-1] if key else "")
            total = own + sum(size[k] for k in out)
            size[key] = total
            if total > MAX_RESOLVED_CHARS and key in refs:
                raise ConfigError(
                    f"{dotted(key)}: would resolve to about {total:,} characters (its interpolations nest and"
                    f" repeat), more than the {MAX_RESOLVED_CHARS:,} a config value may have"
                )
