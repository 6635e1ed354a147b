"""The names a harvest stores its sites under: an ``@`` site's own name, else the module's."""

from __future__ import annotations

from torch import nn


def site_labels(model: nn.Module, selector: str, modules: list[str]) -> dict[str, str]:
    """Each module's stored name: its site name for an ``@`` selector (``resid_pre.1``, ``decoder.mlp.0``,
    ``embed``), else the module's own name."""
    if not selector.startswith("@"):
        return {m: m for m in modules}
    from surgery.arch.sites import MODEL_SITES, site_map

    parts = selector[1:].split(".")
    role = parts.pop(0) if parts[0] in ("encoder", "decoder") else ""
    prefix, site = f"{role}." if role else "", parts[0]
    if site in MODEL_SITES:
        return {m: f"{prefix}{site}" if len(modules) == 1 else m for m in modules}
    sites = site_map(model)
    found = {}
    for stack, per in zip(sites.stacks, sites.per_block.get(site, []), strict=False):
        if not role or stack.role == role:
            found.update({name: f"{prefix}{site}.{i}" for i, name in enumerate(per)})
    labels = {m: found.get(m, m) for m in modules}
    return labels if len(set(labels.values())) == len(labels) else {m: m for m in modules}
