"""How good a spliced SAE is: ``l0``, ``reconstruction_mse``, ``explained_variance`` and ``ce_loss_recovered``.

Per batch, the model runs once unmodified (each spliced module's clean input/output recorded, and ``CE_clean``),
once with the splices (``CE_splice``) and once with every spliced site zero-ablated (``CE_zero``, computed once per
batch, shared by every splice of the plan); the last two only when ``ce_loss_recovered`` is asked for. Over every
position ``p`` of every batch, with ``x`` what the SAE reads, ``y`` what it replaces (``y = x`` for an SAE, the
module's output for a transcoder), ``f = encode(x)`` and ``ŷ = decode(f)`` (before any ``features`` edit):

- ``l0``: mean over positions of the number of non-zero features, ``mean_p #{i: f_pi != 0}``;
- ``reconstruction_mse``: mean over positions and dimensions of ``(y - ŷ)²``;
- ``explained_variance``: ``1 - Σ_p ‖y_p - ŷ_p‖² / Σ_p ‖y_p - ȳ‖²``, ``ȳ`` the mean of ``y`` over all positions;
- ``ce_loss_recovered``: ``1 - (CE_splice - CE_clean) / (CE_zero - CE_clean)``, each CE the mean next-token
  cross-entropy (language models: ``logits[:, :-1]`` against ``ids[:, 1:]``, padding masked) or against the labels
  of ``(x, y)`` batches. 1: the splice loses nothing; 0: as bad as deleting the site.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from surgery.core.compiler import Plan, compile_plan
from surgery.core.engine import apply_plan
from surgery.core.structure import find_logits, get_item, replace_item
from surgery.errors import ConfigError
from surgery.splice.formats import SpliceWeights, load
from surgery.splice.kind import paths_for
from surgery.splice.sae import decode, encode

SPLICE_METRICS = ("l0", "reconstruction_mse", "explained_variance", "ce_loss_recovered")


class _Site:
    """One spliced module's running sums (float64) for l0, MSE and explained variance."""

    def __init__(self, key: str, module: nn.Module, weights: SpliceWeights, cfg: Any) -> None:
        self.key, self.module, self.weights, self.cfg = key, module, weights, cfg
        self.positions = self.elements = 0
        self.active = self.sse = 0.0
        self.sum: torch.Tensor | None = None
        self.sumsq: torch.Tensor | None = None
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def hook(self, m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Record what the splice reads (x) and what it replaces (y) in the clean pass."""
        out = output if isinstance(output, torch.Tensor) else output[self.cfg.item or 0]
        at = args[self.cfg.item or 0] if self.cfg.at == "input" else out
        x = args[0] if self.cfg.reads == "input" and self.cfg.at == "output" else at
        self.seen = (x.detach(), at.detach())

    def add(self) -> None:
        """Fold in the last clean call: encode and decode without edits, and compare."""
        assert self.seen is not None, f"{self.key}: the spliced module did not run"
        x, y = self.seen
        w = self.weights.to(x.device)
        acts, state = encode(w, x)
        recon = decode(w, acts, state, x).double()
        y = y.double().reshape(-1, y.shape[-1])
        recon = recon.reshape(-1, recon.shape[-1])
        self.positions += y.shape[0]
        self.elements += y.numel()
        self.active += float((acts != 0).sum())
        self.sse += float(((y - recon) ** 2).sum())
        total, squares = y.sum(0), (y * y).sum(0)
        self.sum = total if self.sum is None else self.sum + total
        self.sumsq = squares if self.sumsq is None else self.sumsq + squares
        self.seen = None

    def result(self) -> dict[str, float]:
        """The three reconstruction metrics over everything added."""
        assert self.sum is not None and self.sumsq is not None
        sst = float((self.sumsq - self.sum * self.sum / self.positions).sum())
        return {
            "l0": self.active / self.positions,
            "reconstruction_mse": self.sse / self.elements,
            "explained_variance": 1 - self.sse / sst if sst > 0 else float("nan"),
        }


def splice_metrics(
    model: nn.Module,
    actions: Any,
    data: Iterable[Any],
    metrics: Sequence[str] = SPLICE_METRICS,
    **plan_options: Any,
) -> dict[str, Any]:
    """The splice metrics of ``actions`` (their ``splice`` steps) over ``data``; see this module's docstring.

    >>> splice_metrics(model, {"sae": {"kind": "splice", "select": "transformer.h.1", "module": {"path": "sae"}}},
    ...                [ids])   # {"l0": {"sae/transformer.h.1": 11.2}, ..., "ce_loss_recovered": 0.93, ...}

    ``data``: batches of token ids, dicts of model keyword inputs (``input_ids``, ``attention_mask``), or ``(x, y)``.
    Returns per-site dicts for ``l0``, ``reconstruction_mse``, ``explained_variance`` (keys ``ACTION/MODULE``) and,
    for ``ce_loss_recovered``, the number with ``ce_clean``, ``ce_splice`` and ``ce_zero``.
    """
    unknown = [m for m in metrics if m not in SPLICE_METRICS]
    if unknown:
        raise ConfigError(f"metrics: {unknown[0]!r} is not a splice metric; they are {', '.join(SPLICE_METRICS)}")
    plan = actions if isinstance(actions, Plan) else compile_plan(model, actions, **plan_options)
    sites = _sites(plan)
    if "ce_loss_recovered" in metrics:
        with_error = [s.name for s in plan.steps if s.enabled and s.kind == "splice" and s.config.error_term]
        if with_error:
            raise ConfigError(
                f"actions.{with_error[0]}.error_term: ce_loss_recovered measures the loss with the reconstruction in"
                " place; with error_term: true the model computes what it did (the metric is 1). Drop error_term"
            )
    ce = {"clean": [0.0, 0], "splice": [0.0, 0], "zero": [0.0, 0]}
    with torch.no_grad():
        for batch in data:
            args, kwargs, labels = _split(batch)
            handles = [s.module.register_forward_hook(s.hook) for s in sites]
            try:
                clean = _logits(model(*args, **kwargs))
            finally:
                for h in handles:
                    h.remove()
            for site in sites:
                site.add()
            if "ce_loss_recovered" not in metrics:
                continue
            targets = _targets(args, kwargs, labels)
            _add(ce["clean"], clean, targets)
            with apply_plan(model, plan):
                _add(ce["splice"], _logits(model(*args, **kwargs)), targets)
            handles = [_zero(s) for s in sites]
            try:
                _add(ce["zero"], _logits(model(*args, **kwargs)), targets)
            finally:
                for h in handles:
                    h.remove()
    if not sites or sites[0].sum is None:
        raise ConfigError("data: no batches; the data set is empty")
    result: dict[str, Any] = {}
    per_site = {s.key: s.result() for s in sites}
    for name in ("l0", "reconstruction_mse", "explained_variance"):
        if name in metrics:
            result[name] = {key: values[name] for key, values in per_site.items()}
    if "ce_loss_recovered" in metrics:
        clean_ce, splice_ce, zero_ce = (ce[k][0] / max(ce[k][1], 1) for k in ("clean", "splice", "zero"))
        denominator = zero_ce - clean_ce
        recovered = 1 - (splice_ce - clean_ce) / denominator if denominator != 0 else float("nan")
        result.update(ce_loss_recovered=recovered, ce_clean=clean_ce, ce_splice=splice_ce, ce_zero=zero_ce)
    return result


def _sites(plan: Plan) -> list[_Site]:
    sites = []
    for step in plan.steps:
        if not (step.enabled and step.kind == "splice"):
            continue
        cfg, where = step.config, f"actions.{step.name}.module.path"
        for target, path in zip(step.targets, paths_for(cfg, step.targets, where)):
            weights = load(path, where, cfg.activation, cfg.k, cfg.apply_b_dec_to_input)
            sites.append(_Site(f"{step.name}/{target.name}", target.module, weights, cfg))
    if not sites:
        raise ConfigError("actions: no splice action (kind: splice) to measure; the splice metrics need one")
    return sites


def _zero(site: _Site) -> Any:
    """A hook zero-ablating the site the splice replaces (its output, item or input)."""
    cfg = site.cfg
    if cfg.at == "input":
        at = cfg.item or 0

        def pre(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (*args[:at], torch.zeros_like(args[at]), *args[at + 1 :])

        return site.module.register_forward_pre_hook(pre)

    def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return torch.zeros_like(output)
        return replace_item(output, cfg.item or 0, torch.zeros_like(get_item(output, cfg.item or 0)))

    return site.module.register_forward_hook(hook)


def _split(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None]:
    """(args, kwargs, labels) of a batch: ids, a dict of keyword inputs, or (x, y)."""
    if isinstance(batch, dict):
        return (), dict(batch), None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return (batch[0],), {}, batch[1]
    if isinstance(batch, torch.Tensor):
        return (batch,), {}, None
    raise ConfigError(f"data: each batch must be token ids, a dict of inputs or (x, y); got {type(batch).__name__}")


def _logits(output: Any) -> torch.Tensor:
    found = find_logits(output)
    if found is not None:
        return found
    raise ConfigError(f"model: ce_loss_recovered needs logits; the model returned a {type(output).__name__}")


def _targets(args: tuple[Any, ...], kwargs: dict[str, Any], labels: torch.Tensor | None) -> torch.Tensor:
    """What each logit row is scored against: the labels, or the next token (-100 at padding and the last position)."""
    if labels is not None:
        return labels
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        raise ConfigError("data: ce_loss_recovered needs token ids [batch, positions] (a language model) or (x, y)")
    target = torch.full_like(ids, -100)
    target[:, :-1] = ids[:, 1:]
    mask = kwargs.get("attention_mask")
    if mask is not None:
        target[:, :-1][mask[:, 1:] == 0] = -100
    return target


def _add(total: list, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Add a batch's summed cross-entropy (float64) and how many rows it scored."""
    flat, target = logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1)
    total[0] += float(F.cross_entropy(flat, target, reduction="sum", ignore_index=-100))
    total[1] += int((target != -100).sum())
