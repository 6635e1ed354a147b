"""A model's site map: which real modules each ``@`` site names, from a family table or by structure.

The repeated block list is found by structure (a ``ModuleList`` of one block class); its class picks the
family table (``families.py``). An unknown block class is mapped by role: attention and MLP children by
name, the projection inside the attention, the norm before the MLP, a norm next to the block list. What
neither finds is refused with what this model has, naming ``mode=modules``.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch
from torch import nn

from surgery.arch.families import BY_BLOCK, POST_NORM, Family, Path
from surgery.arch.foreign import foreign_hint
from surgery.arch.sitemap import BLOCK_SITES, HINT_ORDER, MODEL_SITES, STACK_ROLES, SiteMap, Stack
from surgery.core.select import ModuleIndex
from surgery.errors import ConfigError

# the structural fallback: children of a block, by the roles their names show
_ROLE_NAMES = {
    "attn": re.compile(r"(self_?)?attn|(self_?)?attention|mixer_attn"),
    "mlp": re.compile(r"mlp|ffn|feed_?forward|moe|block_sparse_moe"),
    "heads": re.compile(r"o_proj|out_proj|c_proj|dense|o|wo|proj"),
    "mlp_norm": re.compile(r"ln_?2|norm_?2|post_attention_layernorm|pre_feedforward_layernorm|ffn_norm"),
    "attn_norm": re.compile(r"ln_?1|norm_?1|input_layernorm|attn_norm|attention_norm|self_attn_layer_norm"),
}
_NO_PATTERN = ("mapped by structure: where the attention probabilities are is not known; capture"
               " {select: '@attn', function: softmax} with eager attention")  # fmt: skip


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[int, SiteMap | ConfigError]] = weakref.WeakKeyDictionary()


def site_map(model: nn.Module, index: ModuleIndex | None = None) -> SiteMap:
    """The site map of ``model`` (worked out once per model and module count), or a ConfigError saying why not."""
    index = index if index is not None else ModuleIndex.of(model)
    cached = _CACHE.get(model)
    if cached is not None and cached[0] == len(index):
        found = cached[1]
    else:
        try:
            found = _build(model, index)
        except ConfigError as e:
            found = e
        _CACHE[model] = (len(index), found)
    if isinstance(found, ConfigError):
        raise ConfigError(str(found))
    return found


def _stacks(index: ModuleIndex, position: dict[str, int]) -> list[tuple[Stack, type]]:
    """Every ModuleList whose children are all one class: (stack, block class), in model order."""
    out = []
    for i, cls in enumerate(index.classes):
        size = len(index.modules[i]._modules) if cls is nn.ModuleList else 0
        if not size:
            continue
        name = index.names[i]
        prefix = "" if name == "<root>" else name + "."
        kids = []
        for j in range(size):
            at = position.get(f"{prefix}{j}")
            if at is None:
                break
            kids.append(at)
        if len(kids) != size:
            continue
        classes = {index.classes[k] for k in kids}
        if len(classes) == 1:
            parent = name.rpartition(".")[0] if "." in name else "<root>"
            out.append((Stack(name, [index.names[k] for k in kids], parent), classes.pop()))
    return out


def _build(model: nn.Module, index: ModuleIndex) -> SiteMap:
    position = {name: i for i, name in enumerate(index.names)}
    found = _stacks(index, position)
    known = [(s, c) for s, c in found if c.__name__ in BY_BLOCK]
    if known:
        family = BY_BLOCK[known[0][1].__name__]
        stacks = [s for s, c in known if BY_BLOCK.get(c.__name__) is family]
        return _from_family(model, index, position, family, stacks)
    repeated = [(s, c) for s, c in found if len(s.blocks) >= 2 and _size(s, index, position) > len(s.blocks)]
    if not repeated:
        raise ConfigError(
            f"select: this model ({type(model).__name__}) has no known site map and no repeated block list;"
            " select modules by name (python -m surgery ... mode=modules lists them)"
        )
    stack, cls = max(repeated, key=lambda sc: _size(sc[0], index, position))
    return _by_structure(model, index, position, stack, cls)


def _size(stack: Stack, index: ModuleIndex, position: dict[str, int]) -> int:
    """How many modules the stack's first block holds (the block list is the biggest repeated thing)."""
    prefix = stack.blocks[0] + "."
    return sum(1 for name in index.names[position[stack.blocks[0]] :][:2000] if name.startswith(prefix)) + 1


def _resolve(block: str, path: Path, position: dict[str, int]) -> str | None:
    """The first of ``path``'s alternatives that exists inside ``block``, as a full name."""
    if path is None:
        return None
    for rel in (path,) if isinstance(path, str) else path:
        name = f"{block}.{rel}" if block else rel
        if rel and name in position:
            return name
    return None


def _roles(stacks: list[Stack]) -> None:
    """Name the stacks of an encoder-decoder model after the module holding each (encoder/decoder)."""
    if len(stacks) < 2:
        return
    for stack in stacks:
        last = stack.parent.rpartition(".")[2].lower()
        stack.role = next((r for r in STACK_ROLES if r in last), "")


def _from_family(
    model: nn.Module, index: ModuleIndex, position: dict[str, int], family: Family, stacks: list[Stack]
) -> SiteMap:
    _roles(stacks)
    absent = dict(family.absent)
    per_block: dict[str, list[list[str]]] = {s: [] for s in BLOCK_SITES}
    paths = {"attn": family.attn, "attn_out": family.attn_out, "mlp": family.mlp, "mlp_out": family.mlp_out,
             "heads": family.heads, "resid_mid": family.mlp_norm, "attn_in": family.attn_norm,
             "mlp_in": family.mlp_norm, "attn_pattern": family.attn}  # fmt: skip
    for stack in stacks:
        per_block["blocks"].append(list(stack.blocks))
        per_block["resid_pre"].append(list(stack.blocks))
        per_block["resid_post"].append(list(stack.blocks))
        for site, path in paths.items():
            names = [_resolve(b, path, position) for b in stack.blocks]
            if site in absent:
                continue
            if any(n is None for n in names):
                what = path if isinstance(path, str) else " or ".join(path or ())
                absent[site] = f"no module {what!r} in the blocks of {stack.name}"
                continue
            per_block[site].append([n for n in names if n is not None])
    _post_norm(index, position, family, stacks, absent)
    model_level = _model_level(model, index, position, family, stacks, absent)
    heads, d_head = _head_shape(model, index, position, per_block, absent)
    block_class = type(index.modules[position[stacks[0].blocks[0]]]).__name__
    sites = SiteMap(f"{family.name}: {block_class}", stacks, per_block, model_level, absent, heads, d_head,
                    family.output_only, family.notes, pattern_item=family.pattern_item)  # fmt: skip
    sites.lens = _lens(model, sites)
    return sites


def _post_norm(
    index: ModuleIndex, position: dict[str, int], family: Family, stacks: list[Stack], absent: dict[str, str]
) -> None:
    """Refuse @resid_mid where the blocks are configured so that no such stream exists."""
    block = index.modules[position[stacks[0].blocks[0]]]
    if getattr(block, "use_parallel_residual", False):
        absent["resid_mid"] = "parallel attention and MLP (use_parallel_residual): both read the block input"
    if getattr(block, "do_layer_norm_before", True) is False:
        absent["resid_mid"] = "post-norm blocks (do_layer_norm_before: false): the MLP norm follows the residual add"
        for site in ("attn_in", "mlp_in"):
            absent[site] = f"post-norm blocks (do_layer_norm_before: false): {POST_NORM}"


def _name_of(module: Any, index: ModuleIndex) -> str | None:
    if module is None:
        return None
    return next((n for n, m in zip(index.names, index.modules) if m is module), None)


def _model_level(
    model: nn.Module,
    index: ModuleIndex,
    position: dict[str, int],
    family: Family | None,
    stacks: list[Stack],
    absent: dict[str, str],
) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    getter = getattr(model, "get_input_embeddings", None)
    embeds = [n for s in stacks if (n := _resolve(_inside(s), family.embed, position))] if family else []
    embed = None if embeds else _name_of(_call(getter), index)
    if embed is None and not embeds and "embed" not in absent:
        embed = next((n for n, c in zip(index.names, index.classes) if issubclass(c, nn.Embedding)), None)
    if embed is None and not embeds:
        absent.setdefault("embed", "no input embedding (get_input_embeddings() gives none)")
    out["embed"] = embeds or ([embed] if embed else [])
    norm_path = family.final_norm if family is not None else None
    norms = [n for s in stacks if (n := _resolve(_inside(s), norm_path, position))]
    if family is None:
        norms = _structural_norms(index, position, stacks)
    if not norms:
        absent.setdefault("final_norm", "no final norm next to the block list")
    out["final_norm"] = norms
    if family is not None and family.unembed is not None:
        unembed = family.unembed if family.unembed in position else None
    else:
        unembed = _name_of(_call(getattr(model, "get_output_embeddings", None)), index)
    if unembed is None:
        absent.setdefault("unembed", "no output embedding (get_output_embeddings() gives none): no LM head")
    out["unembed"] = [unembed] if unembed else []
    out["unembed_in"] = _unembed_norm(norms, stacks)
    if "final_norm" in absent or "unembed" in absent:
        absent.setdefault("unembed_in", absent.get("final_norm") or absent["unembed"])
    return out


def _unembed_norm(norms: list[str], stacks: list[Stack]) -> list[str]:
    """The final norm the unembedding reads: the decoder's in an encoder-decoder model."""
    decoder = [s.parent + "." for s in stacks if s.role == "decoder"]
    return [n for n in norms if n.startswith(tuple(decoder))] if decoder else norms[-1:]


def _inside(stack: Stack) -> str:
    """The prefix of names next to the block list ("" at the root)."""
    return "" if stack.parent == "<root>" else stack.parent


def _call(getter: Any) -> Any:
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def _head_shape(
    model: nn.Module, index: ModuleIndex, position: dict[str, int], per_block: dict[str, list[list[str]]],
    absent: dict[str, str],
) -> tuple[int | None, int | None]:  # fmt: skip
    """Heads (of q) from the config, d_head from the output projection's input width."""
    if "heads" in absent:
        return None, None
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    proj = index.modules[position[per_block["heads"][0][0]]]
    width = getattr(proj, "in_features", None) or getattr(proj, "nx", None)
    weight = getattr(proj, "weight", None)
    if width is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        width = int(weight.shape[1])
    if not isinstance(heads, int) or not isinstance(width, int) or heads < 1 or width % heads:
        absent["heads"] = (
            f"the number of heads is not known (config.num_attention_heads: {heads!r}, projection input {width!r})"
        )
        return None, None
    return heads, width // heads


def _lens(model: nn.Module, sites: SiteMap) -> dict[str, Any]:
    """The model's own output scaling a logit lens applies too: T5's tied rescale, Gemma's softcap."""
    config: Any = getattr(model, "config", None)
    return {
        "softcap": getattr(config, "final_logit_softcapping", None),
        "scale": (config.d_model**-0.5)
        if sites.family.startswith("t5:") and getattr(config, "tie_word_embeddings", False)
        else None,
    }


def _by_structure(model: nn.Module, index: ModuleIndex, position: dict[str, int], stack: Stack, cls: type) -> SiteMap:
    """Sites found by role inside the blocks of the biggest repeated block list (an unknown architecture)."""
    absent: dict[str, str] = {}
    per_block: dict[str, list[list[str]]] = {s: [list(stack.blocks)] for s in ("blocks", "resid_pre", "resid_post")}
    first = stack.blocks[0]
    inside = [n[len(first) + 1 :] for n in index.names if n.startswith(first + ".")]
    children = [n for n in inside if "." not in n]
    found: dict[str, str | None] = {}
    for role in ("attn", "mlp", "mlp_norm", "attn_norm"):
        found[role] = next((c for c in children if _ROLE_NAMES[role].fullmatch(c.lower())), None)
    attn = found["attn"]
    if attn is not None:
        inner = [n[len(first) + len(attn) + 2 :] for n in index.names if n.startswith(f"{first}.{attn}.")]
        proj = next((c for c in inner if "." not in c and _ROLE_NAMES["heads"].fullmatch(c.lower())), None)
        found["heads"] = f"{attn}.{proj}" if proj else None
    else:
        found["heads"] = None
    found["attn_out"], found["mlp_out"] = attn, found["mlp"]
    roles = {"attn": "attn", "attn_out": "attn_out", "mlp": "mlp", "mlp_out": "mlp_out", "heads": "heads",
             "resid_mid": "mlp_norm", "attn_in": "attn_norm", "mlp_in": "mlp_norm"}  # fmt: skip
    absent["attn_pattern"] = _NO_PATTERN
    for site, role in roles.items():
        rel = found[role]
        names = [_resolve(b, rel, position) for b in stack.blocks] if rel else []
        if not names or any(n is None for n in names):
            absent[site] = f"no child of {cls.__name__} is recognisably its {role.replace('_', ' ')}"
            continue
        per_block[site] = [[n for n in names if n]]
    model_level = _model_level(model, index, position, None, [stack], absent)
    heads, d_head = _head_shape(model, index, position, per_block, absent)
    sites = SiteMap(f"structure ({cls.__name__})", [stack], per_block, model_level, absent, heads, d_head,
                    notes="mapped by structure: check the map (mode=modules) before trusting it")  # fmt: skip
    sites.lens = _lens(model, sites)
    return sites


def _structural_norms(index: ModuleIndex, position: dict[str, int], stacks: list[Stack]) -> list[str]:
    """A norm that is a direct child of the module holding the block list, after it."""
    out = []
    for stack in stacks:
        prefix = "" if stack.parent == "<root>" else stack.parent + "."
        start = position[stack.name]
        for name, cls in zip(index.names[start:], index.classes[start:]):
            rest = name[len(prefix) :] if name.startswith(prefix) else None
            if rest and "." not in rest and "norm" in cls.__name__.lower():
                out.append(name)
                break
    return out


def site_map_text(model: nn.Module) -> str:
    """The site map as ``mode=modules`` prints it; "" for a model with none (a CNN)."""
    try:
        return site_map(model).table()
    except ConfigError:
        return ""


def site_hint(index: ModuleIndex, close: list[str], pattern: str) -> str:
    """ " The site @mlp names model.layers.0.mlp ..." when a site would have matched the closest name; what another
    family's module name (``transformer.h.1.attn``) is on this model; else ""."""
    if not close or not len(index):
        return ""
    try:
        sites = site_map(index.modules[0], index)
    except ConfigError:
        return ""
    foreign = foreign_hint(sites, pattern)
    if foreign:
        return foreign
    for site in HINT_ORDER:
        if site in sites.absent:
            continue
        found = sites.model_level[site] if site in MODEL_SITES else [n for per in sites.per_block[site] for n in per]
        if close[0] in found:
            every = f" (and its like in each of the {len(found)} blocks)" if len(found) > 1 else ""
            return f" On this architecture ({sites.family}) the site @{site} names {close[0]}{every}."
    return ""
