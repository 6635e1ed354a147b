"""A per-example metric (``logit_diff``, ``prob``, ``logit``, ``loss``) as a training loss, for the loss hooks
training loops document: ``transformers.Trainer(compute_loss_func=...)`` and a LightningModule's
``training_step``.

    >>> loss_fn = metric_loss({"logit_diff": {"correct": " Paris", "wrong": " Rome"}}, tokenizer, scale=-1)
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, compute_loss_func=loss_fn)

The loss is ``scale`` times the metric's mean over the batch's examples, the same numbers as a run's
``loss: {logit_diff: ...}`` (SPEC §14) and a study's metric (§13). ``scale: -1`` raises the metric
instead of lowering it. The Trainer does not divide a ``compute_loss_func``'s loss by its gradient
accumulation steps; give the same number as ``accumulation_steps`` and the loss is divided here.
"""

from __future__ import annotations

from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.study.inputs import logits_of
from surgery.study.metrics import PerExample, parse_metrics

TRAINABLE = ("logit_diff", "prob", "logit", "loss")  # per-example metrics with a gradient and no reference run


class MetricLoss:
    """``loss(outputs, labels=None, num_items_in_batch=None)``: ``scale ·`` the metric's mean over the batch."""

    def __init__(self, metric: Any, tokenizer: Any = None, scale: float = 1.0, accumulation_steps: int = 1) -> None:
        bound = parse_metrics(metric, tokenizer, where="loss")
        if len(bound) != 1:
            raise ConfigError(f"loss: one metric, e.g. {{logit_diff: {{correct: 3, wrong: 4}}}}; got {len(bound)}")
        if bound[0].name not in TRAINABLE:
            why = "compares with the unmodified model's run" if bound[0].name == "kl" else "has no gradient"
            raise ConfigError(f"loss: {bound[0].name} {why}; a training loss takes one of {', '.join(TRAINABLE)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale == 0:
            raise ConfigError(f"loss.scale: a non-zero number (-1 raises the metric); got {scale!r}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ConfigError(f"loss.accumulation_steps: the Trainer's gradient_accumulation_steps; got"
                              f" {accumulation_steps!r}")  # fmt: skip
        self.metric: PerExample = bound[0]
        self.scale, self.accumulation_steps = float(scale), accumulation_steps

    def __call__(
        self, outputs: Any, labels: torch.Tensor | None = None, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The loss of one batch: its logits (``outputs`` or ``outputs.logits``) scored per example, averaged."""
        per_example = self.metric(logits_of(outputs), labels)
        return per_example.mean() * (self.scale / self.accumulation_steps)


def metric_loss(metric: Any, tokenizer: Any = None, scale: float = 1.0, accumulation_steps: int = 1) -> MetricLoss:
    """A per-example metric as a training loss (``compute_loss_func`` of a transformers Trainer, or by hand)."""
    return MetricLoss(metric, tokenizer, scale, accumulation_steps)
