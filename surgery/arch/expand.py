"""Rewrite actions whose ``select`` names ``@`` sites into the real module names, ``what`` and ``item``.

Runs inside ``compile_plan`` (``SELECTOR_REWRITES``) before any action is validated, so a site recipe is
checked like any other. Sites that are a tensor, not a module, choose the hook side for you:

- ``@resid_pre``: the block's input ``hidden_states`` (capture ``what: [input]``; a modify kind acts on the input);
- ``@resid_mid``: the input of the MLP's norm (capture only: changing it would not change the stream carried on);
- ``@attn_in``, ``@mlp_in``, ``@unembed_in``: the input of the attention's, the MLP's, the final norm (a change
  reaches that branch only);
- ``@attn_pattern``: the attention probabilities (``patterns.py``);
- ``@heads``: the output projection's input viewed as ``[..., heads, d_head]`` (``head:`` picks heads);
- output sites (``@resid_post``, ``@attn``, ``@attn_out``, ``@mlp``, ``@mlp_out``): item 0 of the output.

TransformerLens hook names (``blocks.3.hook_resid_pre``) are written as the sites they name first (``tl_names.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from surgery.arch.lens import LogitLens
from surgery.arch.patterns import check_eager, pattern_action, pattern_index
from surgery.arch.sitemap import SiteMap
from surgery.arch.sites import site_map
from surgery.arch.tl_names import uses_tl_names, with_sites
from surgery.core.select import ModuleIndex
from surgery.errors import ConfigError

SITE = re.compile(r"@(?:(encoder|decoder)\.)?([a-z_]+)(?:\.(\d+))?")
INPUT_SITES = {
    "resid_pre": "hidden_states",
    "resid_mid": 0,
    "heads": 0,
    "attn_in": 0,
    "mlp_in": 0,
    "unembed_in": 0,
}  # site -> the input item it is
TENSOR_SITES = (*INPUT_SITES, "attn_pattern")  # not a module of their own: capture and modify only
OUTPUT_ITEM_SITES = ("resid_post", "attn", "attn_out", "mlp", "mlp_out")
HOOK_KINDS = ("capture", "modify_output", "modify_input")
SITE_KEYS = ("head", "lens", "top")  # keys a site action may carry that the kinds do not know


def uses_sites(node: Any) -> bool:
    """Whether an action's ``select`` names a site (or a TransformerLens hook name, read as one)."""
    return _at_sites(node) or uses_tl_names(node)


def _at_sites(node: Any) -> bool:
    select = node.get("select") if isinstance(node, Mapping) else None
    values = [select] if isinstance(select, str) else select if isinstance(select, list) else []
    return any(isinstance(v, str) and v.startswith("@") for v in values)


def expand_sites(model: nn.Module, index: ModuleIndex, actions: dict[str, Any]) -> dict[str, Any]:
    """``actions`` with every ``@`` site replaced by this model's modules (unchanged when none names a site)."""
    if not any(uses_sites(node) or _lens_by_name(node) for node in actions.values()):
        return actions
    out: dict[str, Any] = {}
    recorded: dict[str, str] = {}  # a site capture's name -> the side it records (input/output)
    real: set[str] | None = None  # the model's module names, once a TransformerLens name needs them
    for name, node in actions.items():
        where = f"actions.{name}"
        tl: dict[str, str] = {}
        if uses_tl_names(node):
            real = set(index.names) if real is None else real
            node, tl = with_sites(node, real)
        if _lens_by_name(node):  # lens: logit on modules selected by name: the same lens, no site needed
            node = dict(node)
            extra = {k: node.pop(k) for k in SITE_KEYS if k in node}
            try:
                sites = site_map(model, index)
            except ConfigError as e:
                raise ConfigError(f"{where}.lens: needs this model's final norm and unembedding: {e}") from None
            out[name] = _lens(node, sites, "", extra, where, str(node.get("kind")), index)
            continue
        if not _at_sites(node):
            out[name] = _read_from(node, recorded)
            continue
        try:
            sites = site_map(model, index)
        except ConfigError as e:
            raise ConfigError(_named(f"{where}.select: {e}".replace("select: select: ", "select: "), tl)) from None
        try:
            out[name] = _rewrite(dict(node), sites, where, recorded, name, index)
        except ConfigError as e:
            if not tl:
                raise
            raise ConfigError(_named(str(e), tl)) from None
    return out


def _named(text: str, tl: dict[str, str]) -> str:
    """An error about a site given by its TransformerLens name, saying which site that is."""
    if not tl:
        return text
    return f"{text} (TransformerLens name: {'; '.join(f'{k} is {v}' for k, v in tl.items())})"


def _lens_by_name(node: Any) -> bool:
    """A ``lens`` (or ``top``) on an action that selects by name or type, not by site."""
    return isinstance(node, Mapping) and ("lens" in node or "top" in node) and not _at_sites(node)


def _read_from(node: Any, recorded: dict[str, str]) -> Any:
    """A modify reading ``from: {capture: X}`` where X captured a site's input: read the input."""
    if not isinstance(node, Mapping):
        return node
    source = node.get("from")
    if isinstance(source, Mapping) and source.get("capture") in recorded and "what" not in source:
        return {**node, "from": {**source, "what": recorded[str(source["capture"])]}}
    return node


def _parse(select: Any, where: str) -> list[tuple[str, str, int | None]]:
    """(role, site, block) per selector; every one must be a site, and one kind of site."""
    values = [select] if isinstance(select, str) else list(select)
    parsed = []
    for value in values:
        match = SITE.fullmatch(str(value)) if isinstance(value, str) else None
        if not isinstance(value, str) or not value.startswith("@"):
            raise ConfigError(f"{where}: {value!r} mixes a glob with sites; give sites only, or globs in another one")
        if match is None:
            raise ConfigError(
                f"{where}: {value!r} is not a site; write @SITE, @SITE.N (block N) or @encoder.SITE / @decoder.SITE,"
                " e.g. @mlp.3"
            )
        parsed.append((match.group(1) or "", match.group(2), int(match.group(3)) if match.group(3) else None))
    kinds = sorted({site for _, site, _ in parsed})
    if len(kinds) > 1:
        raise ConfigError(f"{where}: one kind of site per action, got {', '.join('@' + k for k in kinds)}")
    return parsed


def _rewrite(
    node: dict[str, Any], sites: SiteMap, where: str, recorded: dict[str, str], name: str, index: ModuleIndex
) -> dict[str, Any]:
    kind = str(node.get("kind"))
    parsed = _parse(node["select"], f"{where}.select")
    site = parsed[0][1]
    if "lens" in node and any(s.role == "decoder" for s in sites.stacks):  # a lens reads the decoder's head
        parsed = [(role or "decoder", s, block) for role, s, block in parsed]
    names: list[str] = []
    for role, _, block in parsed:
        for found in sites.names(site, block, role, f"{where}.select"):
            if found not in names:
                names.append(found)
    node["select"] = names
    extra = {k: node.pop(k) for k in SITE_KEYS if k in node}
    if "head" in extra and site not in ("heads", "attn_pattern"):
        raise ConfigError(f"{where}.head: picks attention heads of @heads or @attn_pattern, not of @{site}; drop head")
    if site in TENSOR_SITES and kind not in HOOK_KINDS:
        raise ConfigError(
            f"{where}.kind: @{site} is a tensor inside the model, not a module: use capture, modify_output or"
            f" modify_input (got {kind})"
        )
    if "lens" in extra or "top" in extra:
        recorded[name] = "output"
        return _lens(node, sites, site, extra, where, kind, index)
    if site == "attn_pattern":
        check_eager(index, names, where)
        pattern_index(node, _head_part(sites, extra.get("head"), where), where)
        if kind == "capture":
            _given(node, "what", ["output"], site, where)
            _given(node, "item", sites.pattern_item, site, where)
            recorded[name] = "output"
        return pattern_action(node, kind, where)
    if kind == "capture":
        return _capture(node, sites, site, extra, where, recorded, name)
    if kind in ("modify_output", "modify_input"):
        return _read_from(_modify(node, sites, site, extra, where, kind), recorded)
    return node


def _given(node: dict[str, Any], key: str, chosen: Any, site: str, where: str) -> None:
    """Set ``key`` to what the site needs; a different value given by the user is refused."""
    if key in node and node[key] != chosen:
        raise ConfigError(f"{where}.{key}: @{site} sets {key} to {chosen!r} for you; drop {key} (got {node[key]!r})")
    node[key] = chosen


def _capture(
    node: dict[str, Any], sites: SiteMap, site: str, extra: dict[str, Any], where: str, recorded: dict[str, str],
    name: str,
) -> dict[str, Any]:  # fmt: skip
    if site in INPUT_SITES:
        _given(node, "what", ["input"], site, where)
        _given(node, "item", INPUT_SITES[site], site, where)
        recorded[name] = "input"
        if site == "heads":
            node["heads"] = sites.heads
            _head_index(node, sites, extra.get("head"), where)
        return node
    if site in sites.output_only and "input" in (node.get("what") or ["output"]):
        raise ConfigError(f"{where}.what: @{site} on {sites.family} stands in by its output only; capture output")
    if site in OUTPUT_ITEM_SITES and node.get("what", ["output"]) == ["output"] and "function" not in node:
        node.setdefault("item", 0)  # with input too, or the calls of a function inside: as given
    recorded[name] = "output"
    return node


def _modify(node: dict[str, Any], sites: SiteMap, site: str, extra: dict[str, Any], where: str, kind: str) -> dict:
    if site == "resid_mid":
        raise ConfigError(
            f"{where}.select: @resid_mid can be captured, not changed: the MLP norm's input is a copy of the stream"
            " that the residual add does not read; change @mlp_in (what the MLP reads), @attn_out or @resid_pre of"
            " the next block instead"
        )
    if site in INPUT_SITES:
        node["kind"] = "modify_input"
        _given(node, "item", INPUT_SITES[site], site, where)
        if site == "heads":
            node["heads"] = sites.heads
            _head_index(node, sites, extra.get("head"), where)
        return node
    if site in sites.output_only and kind == "modify_input":
        raise ConfigError(f"{where}.kind: @{site} on {sites.family} stands in by its output only; use modify_output")
    if site in OUTPUT_ITEM_SITES and kind == "modify_output":
        node.setdefault("item", 0)
    return node


def _head_index(node: dict[str, Any], sites: SiteMap, head: Any, where: str) -> None:
    """``head: N`` or a list of neighbouring heads, as the subscript of the heads dim after any ``index``."""
    part = _head_part(sites, head, where)
    if part is None:
        return
    index = node.get("index")
    inner = ""
    if index is not None:
        text = str(index).strip()
        if not (text.startswith("[") and text.endswith("]")):
            raise ConfigError(f"{where}.index: a subscript such as '[:, -1]', got {index!r}")
        inner = text[1:-1].strip()
        if "..." in inner:
            raise ConfigError(f"{where}.index: with head, index subscripts the leading dims only; drop the '...'")
    node["index"] = f"[{inner + ', ' if inner else ''}..., {part}, :]"


def _head_part(sites: SiteMap, head: Any, where: str) -> str | None:
    """The subscript of ``head: N`` (``N``) or of a run of neighbouring heads (``2:4``); None without head."""
    if head is None:
        return None
    heads = head if isinstance(head, list) else [head]
    try:
        picked = [int(h) for h in heads]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}.head: a head number or a list of them, got {head!r}") from None
    if not picked or any(isinstance(h, bool) for h in heads):
        raise ConfigError(f"{where}.head: a head number or a list of them, got {head!r}")
    total = int(sites.heads or 0)
    bad = [h for h in picked if not 0 <= h < total]
    if bad:
        raise ConfigError(
            f"{where}.head: head {bad[0]} does not exist: this model ({sites.family}) has {total} attention heads"
            f" (of the queries), numbered 0 to {total - 1}"
        )
    if isinstance(head, list):
        if picked != list(range(picked[0], picked[0] + len(picked))):
            raise ConfigError(
                f"{where}.head: {head!r} is not a run of neighbouring heads; give a range such as [2, 3], or one"
                " action per head"
            )
        return f"{picked[0]}:{picked[-1] + 1}"
    return str(picked[0])


def _lens(
    node: dict[str, Any], sites: SiteMap, site: str, extra: dict[str, Any], where: str, kind: str, index: ModuleIndex
) -> dict[str, Any]:
    """``lens: logit``: record final norm + unembedding of each site's output instead of the output itself."""
    if kind != "capture":
        raise ConfigError(f"{where}.lens: reads what a capture records; use kind: capture")
    lens, top = extra.get("lens"), extra.get("top")
    if lens != "logit":
        raise ConfigError(f"{where}.lens: {lens!r} is not a lens; lens: logit (final norm + unembedding)")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ConfigError(f"{where}.top: the number of top tokens per position to report (1 or more), got {top!r}")
    if site in INPUT_SITES or site in ("embed", "unembed", "attn_pattern"):
        raise ConfigError(
            f"{where}.lens: reads a site's output; use @resid_post, @blocks, @attn_out, @mlp_out or @final_norm"
        )
    for key in ("what", "item", "index", "fn", "reduce"):
        if key in node:
            raise ConfigError(f"{where}.{key}: lens records the logits of the site's output; drop {key}")
    node["fn"] = LogitLens.of(sites, index, node["select"] if site else [], where)
    return node
