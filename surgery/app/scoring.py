"""Metrics of a CLI run: the surgered and the unmodified model scored on every batch, in the same pass
(with ``compare=false`` the surgered model alone, and the unmodified model never runs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from surgery.app.batches import Batch, Batches
from surgery.core.compiler import Plan
from surgery.core.engine import Surgery
from surgery.data.evaluate import logits_of, reference_model
from surgery.data.metrics import Metric, Scores, check_metrics, metrics_dict
from surgery.errors import ConfigError


class Scoring:
    """Running metrics for both models; the unmodified one runs with the surgery paused (or as a copy).

    Without ``compare`` only the surgered model is scored (``metric_names`` kept metrics that need no reference).
    """

    def __init__(
        self, names: Sequence[str | Metric], model: nn.Module, plan: Plan, text: bool = False, compare: bool = True
    ) -> None:
        self.surgered, self.unmodified = Scores(names), Scores(names) if compare else None
        self.reference = reference_model(model, plan) if compare else None  # made before applying: the model as it was
        self.text = text  # labels are token ids (-100 at padding) for the LM metrics, not classes
        self.examples = self.last_examples = 0

    def update(self, surgery: Surgery, batch: Batch, output: Any) -> None:
        """Score one batch: ``output`` is the surgered model's; the unmodified model runs on the batch now."""
        after = logits_of(output).detach()
        labels = batch.labels
        if labels is not None and not self.text:
            check_labels(labels, after)
        self.last_examples = int(labels.numel()) if labels is not None and not self.text else int(after.shape[0])
        self.examples += self.last_examples
        if self.unmodified is None:  # compare=false: no reference, so no metric reads one
            self.surgered.update(after, labels, after)
            return
        with torch.no_grad():
            if self.reference is not None:
                before = logits_of(self.reference(*batch.args, **batch.kwargs))
            else:
                with surgery.paused():
                    before = logits_of(surgery.model(*batch.args, **batch.kwargs))
        self.surgered.update(after, labels, before)
        self.unmodified.update(before, labels, before)

    def result(self) -> dict[str, Any]:
        """``{"surgered", "unmodified", "delta"}`` over every batch scored (``{"surgered"}`` without compare)."""
        return metrics_dict(self.surgered.result(), self.unmodified.result() if self.unmodified else None)


def check_labels(labels: torch.Tensor, logits: torch.Tensor) -> None:
    """Refuse labels that are not class indices of the model's output."""
    classes = logits.shape[-1]
    if labels.is_floating_point() or labels.min() < 0 or labels.max() >= classes:
        low, high = float(labels.min()), float(labels.max())
        raise ConfigError(
            f"input.y_key: labels run from {low:g} to {high:g} but the model's output has {classes} classes"
            f" (labels must be ints in 0..{classes - 1}); check input.y_key or the model"
        )


def metric_names(given: Any, data: Batches, compare: bool, model: nn.Module | None = None) -> tuple[str | Metric, ...]:
    """The metrics a run computes: ``metrics`` as given, or the default for the input.

    Without compare the default is none, and those named must need no unmodified model (accuracy, loss, ...):
    they score the surgered model alone, so a sweep does not pay for the unmodified forward in every job.
    Text inputs also take ``perplexity`` and ``logit_diff: {correct, wrong}`` (surgery.lm.metrics); on a
    ``model`` that is not a causal LM (BERT, T5) perplexity is left out of the default and refused when named.
    """
    if not compare and given is None:
        return ()
    if data.text is not None:
        from surgery.lm.kinds import CAUSAL_ONLY, not_causal, refuse_causal_metrics
        from surgery.lm.metrics import text_metrics

        named = text_metrics(given, data.tokenizer)
        if model is not None and given is None and not_causal(model):  # BERT, T5: the default without perplexity
            named = [n for n in named if n not in CAUSAL_ONLY]
        elif model is not None:
            refuse_causal_metrics(model, named)
        return check_metrics(named, labelled=True, compare=compare)
    if given is not None and not isinstance(given, (list, tuple)):
        raise ConfigError(f"metrics: a list of metric names, e.g. [accuracy, loss]; got {given!r}")
    return check_metrics(None if given is None else list(given), data.labelled, compare=compare)


def summary(metrics: dict[str, Any]) -> str:
    """``accuracy 99.44% → 81.89%`` (or the first metric; ``accuracy 81.89%`` without compare), for the closing line."""
    before, after = metrics.get("unmodified"), metrics.get("surgered", {})
    name = "accuracy" if "accuracy" in after else next(iter(after), None)
    if name is None:
        return ""
    shown = (lambda v: f"{100 * v:.2f}%") if name in ("accuracy", "top5", "agreement") else (lambda v: f"{v:.4g}")
    return f"{name} {shown(before[name])} → {shown(after[name])}" if before else f"{name} {shown(after[name])}"
