"""YAML bombs stopped while a config file is read, before anything is expanded or recursed into.

A few bytes of YAML can ask for billions of nodes (aliases of aliases: "billion laughs") or nest so
deep that every reader after PyYAML recurses past Python's limit. OmegaConf reads every file Hydra
loads (``--config-dir``, ``hydra.searchpath``, experiment files, the shipped ``conf/``) with the
loader ``omegaconf._utils.get_yaml_loader`` returns; :func:`install` makes that loader count as it
composes. No legitimate config comes near these bounds, so they hold always, not only under
``safe=true``.
"""

from __future__ import annotations

from typing import Any

import yaml

from surgery.errors import ConfigError

MAX_DEPTH = 100  # nesting levels of one YAML document
MAX_NODES = 50_000  # nodes of one YAML document once its aliases are expanded


def guarded(loader: type) -> type:
    """A subclass of the YAML ``loader`` class that refuses deep nesting and aliases expanding past the bounds."""

    class GuardedLoader(loader):  # type: ignore[misc, valid-type]
        _depth = 0
        _nodes = 0  # nodes composed so far, an alias counted as everything it stands for
        _aliases = False
        _sizes: dict[int, int]

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self._depth >= MAX_DEPTH:
                raise self._refusal(f"nested deeper than {MAX_DEPTH} levels")
            alias = self.check_event(yaml.AliasEvent)
            self._depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            sizes = self.__dict__.setdefault("_sizes", {})
            size = sizes.get(id(node))
            if size is None:  # a node just composed: its children are counted already
                size = 1 + sum(sizes.get(id(child), 1) for child in _children(node))
                sizes[id(node)] = size
            self._nodes += size if alias else 1
            self._aliases = self._aliases or alias
            if self._nodes > MAX_NODES:
                what = "aliases expanding to" if self._aliases else "with"
                raise self._refusal(f"{what} more than {MAX_NODES:,} nodes")
            return node

        def _refusal(self, what: str) -> ConfigError:
            mark = self.peek_event().start_mark if self.check_event() else None
            line = f", line {mark.line + 1}" if mark is not None else ""
            return ConfigError(f"{self.name}{line}: refused YAML {what} (no config needs that; nothing was expanded)")

    GuardedLoader.__name__ = GuardedLoader.__qualname__ = f"Guarded{loader.__name__}"
    return GuardedLoader


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def install() -> None:
    """Make OmegaConf (and so Hydra) read every YAML text through the guarded loader (once per process)."""
    import omegaconf._utils as omegaconf_utils
    from omegaconf import basecontainer

    original = omegaconf_utils.get_yaml_loader
    if getattr(original, "surgery_guard", False):
        return

    def get_yaml_loader() -> Any:
        return guarded(original())

    get_yaml_loader.surgery_guard = True  # type: ignore[attr-defined]
    omegaconf_utils.get_yaml_loader = get_yaml_loader  # OmegaConf.load and create import it when called
    basecontainer.get_yaml_loader = get_yaml_loader  # type: ignore[attr-defined]  # imported by name there
