"""TransformerLens hook names as selectors: ``blocks.3.hook_resid_pre`` is ``@resid_pre.3`` on every family.

A ``select`` that is exactly such a name (``blocks.*.NAME`` for every block; ``blocks.{layer}.NAME`` in a study,
whose placeholder is filled before the plan) becomes the site it names before sites are resolved, so it takes
the same modules, ``what`` and ``item``. A model holding a module by that very name (a TransformerLens model,
whose hook points are modules) keeps it: the real module wins.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

PER_BLOCK = {
    "hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid", "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out", "hook_mlp_out": "mlp_out", "hook_mlp_in": "mlp_in",
    "attn.hook_z": "heads", "attn.hook_pattern": "attn_pattern",
}  # fmt: skip
MODEL_LEVEL = {"hook_embed": "embed", "ln_final.hook_normalized": "final_norm"}
_BLOCK = re.compile(r"blocks\.(\d+|\*)\.(" + "|".join(re.escape(k) for k in PER_BLOCK) + ")")


def tl_site(text: str) -> str | None:
    """The site a TransformerLens hook name names (``blocks.3.hook_resid_pre`` → ``@resid_pre.3``), else None."""
    if text in MODEL_LEVEL:
        return "@" + MODEL_LEVEL[text]
    match = _BLOCK.fullmatch(text)
    if match is None:
        return None
    site = PER_BLOCK[match.group(2)]
    return f"@{site}" if match.group(1) == "*" else f"@{site}.{match.group(1)}"


def _values(node: Any) -> list[Any]:
    select = node.get("select") if isinstance(node, Mapping) else None
    return [select] if isinstance(select, str) else list(select) if isinstance(select, list) else []


def uses_tl_names(node: Any) -> bool:
    """Whether an action's ``select`` holds a TransformerLens hook name (real modules by that name aside)."""
    return any(isinstance(v, str) and tl_site(v) is not None for v in _values(node))


def with_sites(node: Any, names: Collection[str]) -> tuple[Any, dict[str, str]]:
    """``node`` with each TransformerLens name in ``select`` written as its site, and {TL name: site} done.

    ``names``: the model's module names; a TL name that is one of them (``*`` read as block 0) stays as it is.
    """
    done: dict[str, str] = {}
    values = []
    for value in _values(node):
        site = tl_site(value) if isinstance(value, str) else None
        if site is not None and value.replace("*", "0") not in names:
            done[value] = site
            value = site
        values.append(value)
    if not done:
        return node, done
    select = node["select"]
    return {**node, "select": values[0] if isinstance(select, str) else values}, done
