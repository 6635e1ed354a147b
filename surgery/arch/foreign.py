"""A module name of another family on this model (``transformer.h.1.attn`` on a Llama): the part it means here.

Recipes are often written against GPT-2 and run on another family; when a selector that names another family's
block list matches nothing, the refusal names this model's module for the same part and the site that names it on
every family (``... the same part is model.layers.1.self_attn (@attn.1 names it on every family)``).
"""

from __future__ import annotations

import re

from surgery.arch.families import FAMILIES, Family
from surgery.arch.sitemap import SiteMap

# block lists by the name other families give them (the first block's path is LIST.0)
FOREIGN_LISTS = {"transformer.h": "gpt2", "gpt_neox.layers": "gpt_neox", "model.decoder.layers": "opt",
                 "model.layers": "llama"}  # fmt: skip
PARTS = ("attn", "mlp", "heads", "attn_out", "mlp_out")  # sites whose module a family's table names by path
NORMS = {"attn_norm": "attn_in", "mlp_norm": "mlp_in"}  # a block's norms: their inputs are these sites
NAME = re.compile(r"(?P<list>[\w.]+?)\.(?P<layer>\d+|\*)(?:\.(?P<tail>[\w.]+))?")


def foreign_hint(sites: SiteMap, pattern: str) -> str:
    """What ``pattern``, another family's module name, is on this model; "" when it is none or the part is unknown."""
    found = NAME.fullmatch(pattern)
    if found is None or found["list"] not in FOREIGN_LISTS or not sites.stacks:
        return ""
    theirs = next(f for f in FAMILIES if f.name == FOREIGN_LISTS[found["list"]])
    if sites.family.split(":")[0] == theirs.name:
        return ""  # the same family: a layer past the last, or a part it lacks, is said elsewhere
    site = _site_of(theirs, found["tail"])
    layer = found["layer"]
    if site is None or site in sites.absent or not sites.per_block.get(site):
        return (f" {found['list']}.N is {theirs.name}'s block list; sites (@resid_pre.{layer}, @attn.{layer}, ...)"
                " name the same parts on every family (mode=modules lists them here).")  # fmt: skip
    names = sites.per_block[site][0]
    if layer == "*":
        here = ", ".join(names[:2]) + (" …" if len(names) > 2 else "")
        return (f" That is {theirs.name}'s name; on this model the same parts are {here} (@{site} names them on every"
                " family).")  # fmt: skip
    if int(layer) >= len(names):
        return ""
    names_it = f"its input is @{site}.{layer}" if site in NORMS.values() else f"@{site}.{layer} names it"
    return (f" That is {theirs.name}'s name; on this model the same part is {names[int(layer)]} ({names_it} on"
            " every family).")  # fmt: skip


def _site_of(family: Family, tail: str | None) -> str | None:
    """The site a path inside one of ``family``'s blocks is (``attn`` → attn), or None."""
    if tail is None:
        return "blocks"
    for site in PARTS:
        path = getattr(family, site)
        if tail == path or (isinstance(path, tuple) and tail in path):
            return site
    return next((site for field, site in NORMS.items() if getattr(family, field) == tail), None)
