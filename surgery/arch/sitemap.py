"""The site names and ``SiteMap``: which real modules each ``@`` site names in one model, and how it prints.

``sites.py`` builds a map from a family table or by structure; ``expand.py`` reads it to rewrite actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from surgery.errors import ConfigError

BLOCK_SITES = ("blocks", "resid_pre", "resid_mid", "resid_post", "attn", "attn_out", "mlp", "mlp_out", "heads",
               "attn_in", "mlp_in", "attn_pattern")  # fmt: skip
MODEL_SITES = ("embed", "final_norm", "unembed", "unembed_in")
SITES = ("embed", *BLOCK_SITES, "final_norm", "unembed", "unembed_in")
INPUT_SIDE = ("resid_pre", "resid_mid", "attn_in", "mlp_in", "unembed_in")  # printed "[input]"
STACK_ROLES = ("encoder", "decoder")
HINT_ORDER = ("mlp", "attn", "attn_out", "mlp_out", "heads", "resid_mid", "blocks", "embed", "final_norm", "unembed")


@dataclass
class Stack:
    """One repeated block list: its name, its blocks' names, and the module holding it."""

    name: str
    blocks: list[str]
    parent: str
    role: str = ""  # "encoder" / "decoder" in an encoder-decoder model, else ""


@dataclass
class SiteMap:
    """Every site of one model: per stack and block the real module name, or why it is absent."""

    family: str  # a family's name, or "structure (BLOCK_CLASS)"
    stacks: list[Stack]
    per_block: dict[str, list[list[str]]]  # site -> per stack, per block: the module name
    model_level: dict[str, list[str]]  # embed, final_norm, unembed, unembed_in -> module names
    absent: dict[str, str]  # site -> why this model has none
    heads: int | None = None  # attention heads (of q, not kv)
    d_head: int | None = None
    output_only: tuple[str, ...] = ()
    notes: str = ""
    lens: dict[str, Any] = field(default_factory=dict)  # what a logit lens needs: norm, unembed, softcap, scale
    pattern_item: int = 1  # the item of the attention module's output holding the probabilities (eager)

    def names(self, site: str, block: int | None = None, role: str = "", where: str = "select") -> list[str]:
        """The real module names of ``site`` (block ``block`` only; stack ``role`` only), or a ConfigError."""
        if site not in SITES:
            raise ConfigError(f"{where}: @{site} is not a site; sites: {', '.join('@' + s for s in SITES)}")
        if site in self.absent:
            raise ConfigError(f"{where}: @{site} does not exist on this model ({self.family}): {self.absent[site]}")
        stacks = [i for i, s in enumerate(self.stacks) if not role or s.role == role]
        if role and not stacks:
            roles = [s.role for s in self.stacks if s.role]
            raise ConfigError(
                f"{where}: @{role}. needs an encoder-decoder model; this one ({self.family}) has"
                f" {'stacks ' + ', '.join(roles) if roles else 'one block list'}: drop the {role}. prefix"
            )
        if site in MODEL_SITES:
            if block is not None:
                raise ConfigError(f"{where}: @{site} is one module for the model, not per block: drop .{block}")
            found = self.model_level[site]
            if role:
                prefixes = tuple(self.stacks[i].parent + "." for i in stacks)
                found = [n for n in found if n.startswith(prefixes)] or found
            return found
        out = []
        for i in stacks:
            per = self.per_block[site][i]
            if block is not None:
                if block >= len(per):
                    counts = " and ".join(f"{len(s.blocks)} ({s.name})" for s in self.stacks)
                    raise ConfigError(
                        f"{where}: @{site}.{block} is past the last block: this model ({self.family}) has {counts}"
                        f" blocks, numbered from 0"
                    )
                out.append(per[block])
            else:
                out.extend(per)
        return out

    def rows(self) -> list[tuple[str, str]]:
        """(site, modules) for printing: each site with its first block's module, or why it is absent."""
        out = []
        for site in SITES:
            if site in self.absent:
                out.append((f"@{site}", f"- ({self.absent[site]})"))
                continue
            extra = ""
            if site == "heads":
                extra = f"  [input, as {self.heads} heads × {self.d_head}]"
            elif site == "attn_pattern":
                extra = f"  [output item {self.pattern_item}: probabilities, eager attention]"
            elif site in INPUT_SIDE:
                extra = "  [input]"
            elif site in self.output_only:
                extra = "  [output]"
            if site in MODEL_SITES:
                out.append((f"@{site}", ", ".join(self.model_level[site]) + extra))
                continue
            shown = []
            for per in self.per_block[site]:
                first, last = per[0], per[-1]
                shown.append(first if len(per) == 1 else f"{first} … {last} ({len(per)})")
            out.append((f"@{site}", "; ".join(shown) + extra))
        return out

    def table(self) -> str:
        """The site map as lines: ``@site  real module names``."""
        rows = self.rows()
        width = max(len(r[0]) for r in rows)
        head = f"sites ({self.family}; {', '.join(f'{s.name}: {len(s.blocks)} blocks' for s in self.stacks)}):"
        return "\n".join([head, *(f"  {site.ljust(width)}  {where}" for site, where in rows)])
