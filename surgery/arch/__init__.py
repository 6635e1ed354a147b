"""Sites: ``@mlp``, ``@resid_pre.3``, ``@heads`` ... named once, resolved per architecture (SPEC §16).

Importing this package adds ``expand_sites`` to ``surgery.core.compiler.SELECTOR_REWRITES``, so every plan
(the Python API, the CLI, studies) resolves sites. ``site_map(model)`` gives a model's map; ``str(it.table())``
is what ``mode=modules`` and ``mode=plan`` print.

>>> plan = surgery.plan(model, {"cap": {"kind": "capture", "select": "@resid_post"}})
"""

from __future__ import annotations

from surgery.arch.expand import expand_sites, uses_sites
from surgery.arch.lens import LogitLens, lens_report, top_tokens
from surgery.arch.sitemap import SITES, SiteMap
from surgery.arch.sites import site_hint, site_map, site_map_text
from surgery.core.compiler import NO_MATCH_HINTS, SELECTOR_REWRITES

if expand_sites not in SELECTOR_REWRITES:
    SELECTOR_REWRITES.append(expand_sites)
    NO_MATCH_HINTS.append(site_hint)

__all__ = [
    "SITES", "LogitLens", "SiteMap", "expand_sites", "lens_report", "site_map", "site_map_text", "top_tokens",
    "uses_sites",
]  # fmt: skip
