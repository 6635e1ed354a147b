"""What ``all`` means for a grid variable: every value it can take where the actions use it (SPEC §20).

A variable written as a site's block number (``select: "@resid_pre.{layer}"``) takes every block of
that stack; one given as ``head: "{h}"`` every attention head; anywhere else (an ``index``) every
position of the text input. A variable used two ways is refused: ``all`` would mean two things.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from surgery.errors import ConfigError

_SITE_BLOCK = re.compile(r"@(?:(encoder|decoder)\.)?([a-z_]+)\.\{([A-Za-z_][A-Za-z_0-9]*)\}")
_TL_BLOCK = re.compile(r"(?:^|[^A-Za-z0-9_.])blocks\.\{([A-Za-z_][A-Za-z_0-9]*)\}\.(?:attn\.)?hook_")  # TransformerLens
_WHOLE = re.compile(r"\{([A-Za-z_][A-Za-z_0-9]*)\}")


def every_value(
    grid: Mapping[str, Any], actions: Any, model: nn.Module | None, positions: int | None
) -> dict[str, int]:
    """For each variable given as ``all``: how many values it takes (blocks, heads or positions)."""
    wanted = [name for name, values in grid.items() if values == "all"]
    if not wanted:
        return {}
    meanings: dict[str, dict[str, tuple[int | None, str]]] = {name: {} for name in wanted}
    for at, key, text in _strings(actions, "actions"):
        for role, site, name in _SITE_BLOCK.findall(text) if key in ("select", "exclude") else ():
            if name in meanings:
                meanings[name].setdefault("blocks", (_blocks(model, site, role, at), at))
        for name in _TL_BLOCK.findall(text) if key in ("select", "exclude") else ():
            if name in meanings:
                meanings[name].setdefault("blocks", (_blocks(model, "resid_pre", "", at), at))
        whole = _WHOLE.fullmatch(text)
        if key == "head" and whole and whole.group(1) in meanings:
            meanings[whole.group(1)].setdefault("heads", (_heads(model, at), at))
        elif key not in ("select", "exclude"):
            for name in _WHOLE.findall(text):
                if name in meanings:
                    meanings[name].setdefault("positions", (positions, at))
    out = {}
    for name, found in meanings.items():
        at = f"study.grid.{name}"
        if len(found) > 1:
            uses = " and ".join(f"{kind} at {where}" for kind, (_, where) in found.items())
            raise ConfigError(f"{at}: 'all' is ambiguous: {{{name}}} is used as {uses}; give a range such as '0:4'")
        if not found:
            continue  # unused: check_uses says so
        kind, (count, _) = next(iter(found.items()))
        if count is None:
            raise ConfigError(f"{at}: 'all' means every position of a text input; give a range such as '0:13'")
        out[name] = count
    return out


def _blocks(model: nn.Module | None, site: str, role: str, where: str) -> int:
    """How many blocks the stack of ``@site`` has (the one ``role`` names, in an encoder-decoder model)."""
    if model is None:
        raise ConfigError(f"{where}: 'all' blocks needs the model; give a range such as '0:12'")
    from surgery.arch.sites import site_map

    sites = site_map(model)
    stacks = [s for s in sites.stacks if not role or s.role == role]
    counts = {len(s.blocks) for s in stacks}
    if len(counts) != 1:
        names = ", ".join(f"{s.name} ({len(s.blocks)})" for s in stacks)
        raise ConfigError(f"{where}: 'all' blocks is ambiguous on this model ({names}): write @encoder. or @decoder.")
    return counts.pop()


def _heads(model: nn.Module | None, where: str) -> int:
    if model is None:
        raise ConfigError(f"{where}: 'all' heads needs the model; give a range such as '0:8'")
    from surgery.arch.sites import site_map

    heads = site_map(model).heads
    if heads is None:
        raise ConfigError(f"{where}: this model's number of attention heads is not known; give a range such as '0:8'")
    return heads


def _strings(node: Any, where: str, key: str = "") -> list[tuple[str, str, str]]:
    """(where, its last key, text) for every string in ``node``."""
    if isinstance(node, Mapping):
        return [s for k, v in node.items() for s in _strings(v, f"{where}.{k}", str(k))]
    if isinstance(node, list | tuple):
        return [s for i, v in enumerate(node) for s in _strings(v, f"{where}[{i}]", key)]
    return [(where, key, node)] if isinstance(node, str) else []
