"""``kind: splice``: a forward hook (or pre-hook) that swaps a module's output (or input) for an SAE's reconstruction.

``at: output`` (forward hook) or ``at: input`` (forward pre-hook) is what is replaced; ``read`` is what the SAE
encodes (``read: input, at: output`` is a transcoder). ``error_term`` adds back ``x - decode(encode(x))`` (the
reconstruction before feature edits, as SAELens's ``use_error_term``), so without edits the model computes what it
did, while features can be read and edited. ``capture`` records the features as encoded (before edits).
``train: true`` registers the SAE's tensors on the module as parameters, so a training loop trains them;
``Surgery.save_added(DIR, format="saelens")`` writes the weights each splice uses as a SAELens directory (save.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from surgery.actions.base import (
    FORWARD_HOOK,
    KINDS,
    BindContext,
    KeyedError,
    Kind,
    Step,
    TensorSpec,
    hook_failed,
    hook_on,
)
from surgery.core.ledger import Ledger
from surgery.core.records import Call, Record
from surgery.core.select import Target
from surgery.core.structure import get_item, replace_item
from surgery.errors import ConfigError
from surgery.splice.formats import SpliceWeights, load
from surgery.splice.sae import decode, encode
from surgery.splice.schema import SpliceAction
from surgery.splice.widths import check_widths, width_watch

Edit = Callable[[torch.Tensor], torch.Tensor]


def paths_for(cfg: SpliceAction, targets: list[Target], where: str) -> list[str]:
    """The file of each selected module: ``module.path`` with ``{name}`` as the module's name, or the list's entry."""
    path = cfg.module["path"]
    if isinstance(path, list):
        if len(path) != len(targets):
            names = ", ".join(t.name for t in targets[:6]) + (" …" if len(targets) > 6 else "")
            raise ConfigError(
                f"{where}: {len(path)} paths for {len(targets)} selected modules ({names}); give one per module, in"
                " this order, or one path with {name} in it"
            )
        return list(path)
    return [path.replace("{name}", t.name) for t in targets]


def make_edit(features: dict[str, Any] | None, weights: SpliceWeights, where: str) -> Edit | None:
    """The ``features`` edit as a function of the activations (a new tensor); indices checked against d_sae."""
    if features is None:
        return None
    index = features["index"] if isinstance(features["index"], list) else [features["index"]]
    beyond = [i for i in index if i >= weights.d_sae]
    if beyond:
        raise ConfigError(
            f"{where}.features.index: {beyond[0]} is beyond the {weights.d_sae} features of {weights.source!r}"
            f" (indices run 0..{weights.d_sae - 1})"
        )
    op, value = features.get("op", "zero"), features.get("value")
    number = float(value) if isinstance(value, (int, float)) else 0.0
    cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def on(acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        found = cache.get(acts.device)
        if found is None:
            idx = torch.tensor(index, dtype=torch.long, device=acts.device)
            vals = torch.tensor(value, dtype=acts.dtype, device=acts.device) if isinstance(value, list) else None
            found = cache[acts.device] = (idx, vals)
        return found

    def edit(acts: torch.Tensor) -> torch.Tensor:
        idx, vals = on(acts)
        if op == "zero":
            return acts.index_fill(-1, idx, 0.0)
        if op == "set" and vals is None:
            return acts.index_fill(-1, idx, number)
        edited = acts.clone()
        given: torch.Tensor | float = vals if vals is not None else number
        if op == "set":
            edited[..., idx] = given
        elif op == "mul":
            edited[..., idx] = acts[..., idx] * given
        else:
            edited[..., idx] = acts[..., idx] + given
        return edited

    return edit


def splice_fn(
    weights: SpliceWeights, edit: Edit | None, error_term: bool, keep: Callable[[torch.Tensor], None] | None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(x, target)``: what replaces ``target``, from the SAE reading ``x`` (``x is target`` for an SAE)."""

    def spliced(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        acts, state = encode(weights, x)
        if keep is not None:
            keep(acts)
        edited = edit(acts) if edit is not None else acts
        recon = decode(weights, edited, state, x)
        if error_term:
            clean = recon if edited is acts else decode(weights, acts, state, x)
            recon = recon + (target.to(recon.dtype) - clean)
        return recon if recon.dtype == target.dtype else recon.to(target.dtype)

    return spliced


def keeper(record: Record, top: int | None) -> Callable[[torch.Tensor], None]:
    """Store each call's features in ``record`` (all of them, or the ``top`` largest as {values, indices})."""
    calls = record.calls

    def keep(acts: torch.Tensor) -> None:
        acts = acts.detach()
        if top is None:
            calls.append(Call(features=acts))
        else:
            values, indices = acts.topk(top, dim=-1)
            calls.append(Call(features={"values": values, "indices": indices}))

    return keep


@KINDS.register()
class Splice(Kind):
    """Replace the module's ``at`` (output or input) by a sparse autoencoder's reconstruction of what it ``read``s."""

    name = "splice"
    schema = SpliceAction
    mechanism = FORWARD_HOOK
    adds = True  # with train: true, the SAE's tensors (Surgery.added_state_dict; none otherwise)

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Read and check every file against its module now; nothing is touched."""
        where = f"{ctx.where}.module.path"
        loaded: list[tuple[Target, SpliceWeights]] = []
        for target, path in zip(targets, paths_for(cfg, targets, where)):
            weights = load(path, where, cfg.activation, cfg.k, cfg.apply_b_dec_to_input, cfg.reads != cfg.at)
            if weights.activation == "topk" and int(weights.k or 0) > weights.d_sae:
                raise ConfigError(f"{ctx.where}.k: topk keeps {weights.k} of {weights.d_sae} features in {path!r}")
            if cfg.features_top is not None and cfg.features_top > weights.d_sae:
                raise ConfigError(
                    f"{ctx.where}.features_top: {cfg.features_top} is more than the {weights.d_sae} features of"
                    f" {path!r}"
                )
            check_widths(weights, target, cfg, ctx)
            loaded.append((target, weights))
        edits = [(t, w, make_edit(cfg.features, w, ctx.where)) for t, w in loaded]
        added = trained_names(loaded, ctx) if cfg.train else ()
        action = ctx.name
        live: dict[str, Any] = {}  # target name -> the weights its hook uses (what save_added format saelens writes)

        def apply(ledger: Ledger) -> None:
            if cfg.capture and cfg.to == "disk":
                ledger.streamed.add(action)
            for target, weights, edit in ledger.each(action, edits, lambda e: e[0].name):
                device = _device_of(target.module, ctx.root)
                keep = keeper(ledger.record(action, target.name), cfg.features_top) if cfg.capture else None
                weights = weights.to(device)
                if cfg.train:
                    weights = as_parameters(ledger, target.module, weights)
                live[target.name] = weights
                spliced = splice_fn(weights, edit, cfg.error_term, keep)
                _register(ledger, cfg, target, spliced, action)

        watch = width_watch({id(t.module): w for t, w in loaded}, cfg, ctx.where)
        streams = cfg.capture and cfg.to == "disk"
        step = Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, streams=streams, watch=watch, added=added)
        step.live = live
        return step


TRAINED = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")  # SAELens's names; threshold is not trained


def trained_names(loaded: list[tuple[Target, SpliceWeights]], ctx: BindContext) -> tuple[str, ...]:
    """``train: true``: the names each module gets (checked free now), in SAELens's order."""
    names: dict[str, None] = {}
    for target, weights in loaded:
        module, taken = target.module, ctx.added.setdefault(id(target.module), {})
        for name in TRAINED:
            tensor = getattr(weights, name)
            if tensor is None:
                continue
            if name in taken or hasattr(module, name):
                raise ConfigError(
                    f"{ctx.where}.train: {target.name!r} already has {name!r} (another trained splice on it?); one"
                    " trained splice per module"
                )
            taken[name] = TensorSpec(tuple(tensor.shape), tensor.dtype, "parameters")
            names[name] = None
    return tuple(names)


def as_parameters(ledger: Ledger, module: nn.Module, weights: SpliceWeights) -> SpliceWeights:
    """The SAE's tensors registered on ``module`` as parameters (own copies: the read file's stay as read)."""
    made: dict[str, Any] = {}
    for name in TRAINED:
        tensor = getattr(weights, name)
        if tensor is not None:
            made[name] = nn.Parameter(tensor.detach().clone(), requires_grad=name != "threshold")
            ledger.add_tensor(module, name, made[name], "parameters")
    return replace(weights, **made)


def _device_of(module: nn.Module, root: nn.Module) -> torch.device:
    """Where the module computes: its first parameter or buffer's device, else the model's."""
    for owner in (module, root):
        for tensor in (*owner.parameters(), *owner.buffers()):
            return tensor.device
    return torch.device("cpu")


def _register(ledger: Ledger, cfg: Any, target: Target, spliced: Callable, action: str) -> None:
    module, name, item = target.module, target.name, cfg.item
    if cfg.at == "input":
        at = 0 if item is None else item

        def pre_hook(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            try:
                if not 0 <= at < len(args) or not isinstance(args[at], torch.Tensor):
                    raise KeyedError("item", f"input {at} is not a tensor passed by position ({len(args)} given)")
                return replace_item(args, at, spliced(args[at], args[at]))
            except Exception as e:
                raise hook_failed(action, name, e) from e

        hook_on(ledger, module.register_forward_pre_hook, pre_hook, cfg)
        return
    from_input = cfg.reads == "input"

    def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        try:
            if from_input and not (args and isinstance(args[0], torch.Tensor)):
                got = "no positional input" if not args else f"a {type(args[0]).__name__} as its first input"
                raise KeyedError("read", f"the module got {got}; read: input encodes a tensor passed by position")
            if type(output) is torch.Tensor:
                return spliced(args[0] if from_input else output, output)
            if item is None:
                raise KeyedError(
                    "item", f"the output is a {type(output).__name__}; pick its tensor with item (e.g. item: 0)"
                )
            target = get_item(output, item)
            return replace_item(output, item, spliced(args[0] if from_input else target, target))
        except Exception as e:
            raise hook_failed(action, name, e) from e

    hook_on(ledger, module.register_forward_hook, hook, cfg)
