"""The overhead tasks through peer tools, where they can express them: nnsight, pyvene, TransformerLens.

Used by ``python -m scripts.bench.overhead --peers``; each peer works on its own deep copy of the model
(nnsight and pyvene change the modules they wrap), so the engine and hand-written variants
time an untouched model. nnsight and pyvene results are checked against the hand-written
hooks (same output, same captures) before timing. TransformerLens runs its own
``HookedTransformer`` (random weights, GPT-2 small's shape), so its ratio is to its own
forward without hooks, and its hook points are the closest to the task, not the same modules.

Which setup each is timed with (``SCOPE``): nnsight's ``trace`` and TransformerLens'
``run_with_hooks`` / ``run_with_cache`` install their hooks on every call, inside the timer, so
they compare with ``surgery scoped`` (apply + forward + remove per call); pyvene's
``IntervenableModel`` is built once, outside it, so it compares with ``surgery`` (applied once).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scripts.bench.cases import ACTIVATION, ADD, LINEAR, ModelCase, Task, step_for
from scripts.bench.common import Variant, nothing, version_of

PACKAGES = {"nnsight": "nnsight", "pyvene": "pyvene", "TransformerLens": "transformer-lens"}
NOT_EXPRESSIBLE = {
    ("pyvene", "replace_forward expr on activations"): "pyvene interventions see only the output being replaced",
    ("nnsight", "modify_grad clip_norm on Linear weights"): "no parameter-gradient hooks",
    ("pyvene", "modify_grad clip_norm on Linear weights"): "no parameter-gradient hooks",
    ("TransformerLens", "modify_grad clip_norm on Linear weights"): "hook points carry activations, not weights",
}
SCOPE = {"nnsight": "scoped", "pyvene": "persistent", "TL hooks": "scoped"}
_cache: dict[tuple[int, str], Any] = {}


def versions() -> dict[str, str | None]:
    """Installed version of each peer (None: not installed)."""
    return {name: version_of(dist) for name, dist in PACKAGES.items()}


def available(name: str) -> bool:
    return versions()[name] is not None


def execution_order(model: nn.Module, inputs: dict[str, torch.Tensor], types_: tuple[str, ...]) -> list[str]:
    """Names of the modules of ``types_`` in the order a forward calls them (nnsight wants that order)."""
    order: list[str] = []
    handles = [
        m.register_forward_hook(lambda *_, name=name: order.append(name))
        for name, m in model.named_modules()
        if type(m).__name__ in types_
    ]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return list(dict.fromkeys(order))


def _grad_mode(mode: str) -> Any:
    return torch.no_grad() if mode == "fwd" else torch.enable_grad()


def _finish(case: ModelCase, out: Any, mode: str) -> torch.Tensor:
    out = case.output(out)
    if mode != "fwd":
        torch.autograd.backward(out.sum())  # not Tensor.backward, which nnsight replaces
        out = out.detach()
    return out


# ----------------------------------------------------------------------------- nnsight


def _nnsight_model(case: ModelCase) -> tuple[Any, list[Any], list[Any]]:
    key = (id(case), "nnsight")
    if key not in _cache:
        from nnsight import NNsight

        model = copy.deepcopy(case.model)
        linear = execution_order(model, case.inputs, LINEAR)
        acts = execution_order(model, case.inputs, ACTIVATION)
        wrapped = NNsight(model)
        _cache[key] = (wrapped, [_envoy(wrapped, n) for n in linear], [_envoy(wrapped, n) for n in acts])
    return _cache[key]


def _envoy(root: Any, name: str) -> Any:
    envoy = root
    for part in name.split("."):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


def nnsight_step(case: ModelCase, task: Task, mode: str) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    import nnsight

    wrapped, linear, acts = _nnsight_model(case)
    inputs = case.inputs

    if task.name.startswith("capture"):

        def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
            with _grad_mode(mode), wrapped.trace(**inputs):
                saved = nnsight.save([e.output for e in linear])
                out = wrapped.output.save()
            return _finish(case, out, mode), [t.detach() for t in saved]

    elif task.name.startswith("add"):

        def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
            with _grad_mode(mode), wrapped.trace(**inputs):
                for e in linear:
                    e.output = e.output + ADD
                out = wrapped.output.save()
            return _finish(case, out, mode), []

    elif task.name.startswith("replace_forward"):

        def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
            with _grad_mode(mode), wrapped.trace(**inputs):
                for e in acts:
                    x = e.input
                    e.output = x * torch.sigmoid(x)
                out = wrapped.output.save()
            return _finish(case, out, mode), []

    else:
        raise NotImplementedError(task.name)
    return step


# ----------------------------------------------------------------------------- pyvene


def pyvene_step(case: ModelCase, task: Task, mode: str) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    key = (id(case), f"pyvene/{task.name}")
    if key not in _cache:
        import pyvene as pv

        model = copy.deepcopy(case.model)
        if not hasattr(model, "config"):
            model.config = types.SimpleNamespace()  # pyvene reads model.config; a plain module has none
        linear = execution_order(model, case.inputs, LINEAR)
        if task.name.startswith("capture"):
            reps = [{"component": f"{n}.output", "intervention": pv.CollectIntervention()} for n in linear]
        elif task.name.startswith("add"):
            reps = [{"component": f"{n}.output", "intervention": lambda b, s=None: b + ADD} for n in linear]
        else:
            raise NotImplementedError(task.name)
        _cache[key] = pv.IntervenableModel(reps, model=model)
        model.requires_grad_(True)  # pyvene freezes the model it wraps; fwd+bwd needs its gradients
    wrapped = _cache[key]
    inputs = case.inputs
    collect = task.name.startswith("capture")

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        with _grad_mode(mode):
            base, out = wrapped(base=inputs)
        if collect:  # CollectIntervention: the collected tensors come back as (None, [tensors]) first
            return _finish(case, out, mode), [t.detach() for t in base[1]]
        return _finish(case, out, mode), []

    return step


# ----------------------------------------------------------------------------- TransformerLens


TL_LINEAR_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "hook_attn_out", "mlp.hook_pre", "hook_mlp_out")


def _tl_model(case: ModelCase) -> Any:
    key = (id(case), "TL")
    if key not in _cache:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        hf = case.model.config
        cfg = HookedTransformerConfig(
            n_layers=hf.n_layer,
            d_model=hf.n_embd,
            n_ctx=hf.n_positions,
            d_head=hf.n_embd // hf.n_head,
            n_heads=hf.n_head,
            d_mlp=4 * hf.n_embd,
            d_vocab=hf.vocab_size,
            act_fn="gelu_new",
            normalization_type="LN",
            seed=0,
            device="cpu",
        )
        _cache[key] = HookedTransformer(cfg).eval()
    return _cache[key]


def tl_steps(case: ModelCase, task: Task, mode: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(TL bare, TL with hooks) for the task on a HookedTransformer of the case's GPT-2 shape."""
    model = _tl_model(case)
    tokens = case.inputs["input_ids"]

    def is_linear(name: str) -> bool:
        return name.endswith(TL_LINEAR_HOOKS)

    def bare() -> Any:
        with _grad_mode(mode):
            return _finish(case, model(tokens), mode)

    if task.name.startswith("capture"):

        def hooked() -> Any:
            with _grad_mode(mode):
                out, cache = model.run_with_cache(tokens, names_filter=is_linear)
            return _finish(case, out, mode), list(cache.values())

    elif task.name.startswith("add"):
        hooks = [(is_linear, lambda t, hook: t + ADD)]

        def hooked() -> Any:
            with _grad_mode(mode):
                return _finish(case, model.run_with_hooks(tokens, fwd_hooks=hooks), mode), []

    elif task.name.startswith("replace_forward"):
        pre: dict[int, torch.Tensor] = {}

        def keep(t: torch.Tensor, hook: Any) -> None:
            pre[hook.layer()] = t

        def replace(t: torch.Tensor, hook: Any) -> torch.Tensor:
            x = pre.pop(hook.layer())
            return x * torch.sigmoid(x)

        hooks = [(lambda n: n.endswith("mlp.hook_pre"), keep), (lambda n: n.endswith("mlp.hook_post"), replace)]

        def hooked() -> Any:
            with _grad_mode(mode):
                return _finish(case, model.run_with_hooks(tokens, fwd_hooks=hooks), mode), []

    else:
        raise NotImplementedError(task.name)
    return bare, hooked


# ----------------------------------------------------------------------------- variants


def _checked(
    name: str, step: Callable[[], Any], case: ModelCase, task: Task, mode: str, check: bool
) -> Callable[[], Any]:
    """Check a peer once against the hand-written hooks: the same output and captures."""
    if not check:
        return step
    out, saved = step()
    handles, store = task.hand(case.model)
    try:
        case.model.zero_grad(set_to_none=True)
        want = step_for(case, mode)()
        case.model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    if not torch.equal(out, want):  # the same weights (a deep copy) and the same ops: bit for bit
        diff = (out - want).abs().max().item()
        raise AssertionError(
            f"{name} / {case.name} / {task.name}: output differs from the hand-written hooks ({diff:g})"
        )
    hand_saved = [t for calls in store.values() for t in calls]
    if saved and (len(saved) != len(hand_saved) or any(not torch.equal(a, b) for a, b in zip(saved, hand_saved))):
        raise AssertionError(f"{name} / {case.name} / {task.name}: captures differ from the hand-written hooks")
    return step


def variants(case: ModelCase, task: Task, mode: str, check: bool = True) -> tuple[list[Variant], list[str]]:
    """Timed variants for each installed peer that can express the task, and notes for those that cannot."""
    found: list[Variant] = []
    notes: list[str] = []
    for peer in PACKAGES:
        if not available(peer):
            notes.append(f"{peer}: not installed")
            continue
        reason = NOT_EXPRESSIBLE.get((peer, task.name))
        if reason:
            notes.append(f"{peer}: {reason}")
            continue
        if peer == "nnsight":
            step = _checked(peer, nnsight_step(case, task, mode), case, task, mode, check)
            found.append(Variant(peer, nothing, step))
        elif peer == "pyvene":
            step = _checked(peer, pyvene_step(case, task, mode), case, task, mode, check)
            found.append(Variant(peer, nothing, step))
        elif peer == "TransformerLens":
            if not case.is_gpt2:
                notes.append(f"{peer}: runs only its own HookedTransformer (GPT-2 rows)")
                continue
            bare, hooked = tl_steps(case, task, mode)
            found += [Variant("TL bare", nothing, bare), Variant("TL hooks", nothing, hooked)]
    return found, notes
