"""Metrics over batches of logits: each is a mean over examples, accumulated as (sum, count) per batch.

A metric sees the model's logits, the labels (or None) and the unmodified model's logits on the same
batch (the reference). ``agreement`` and ``kl`` compare with the reference; the unmodified model
compared with itself scores 1 and 0, so every metric has a value for both models and a delta.
Without a comparison (``compare=false``) only metrics that need no reference are computed, for the
surgered model alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from surgery.core.registry import Registry
from surgery.errors import ConfigError

Batch = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], tuple[float, int]]


@dataclass(frozen=True)
class Metric:
    """A mean over examples: ``batch(logits, labels, reference)`` gives this batch's (sum, count).

    ``finish`` maps the final mean to the reported value (perplexity: ``math.exp`` of the mean NLL).
    """

    name: str
    doc: str
    labels: bool  # needs labels
    batch: Batch
    finish: Callable[[float], float] | None = None
    reference: bool = False  # compares with the unmodified model's logits (so needs compare=true)


METRICS: Registry[Metric] = Registry("metric")
DEFAULT_LABELLED = ("accuracy", "loss", "agreement", "kl")
DEFAULT_UNLABELLED = ("agreement", "kl")


def metric(
    name: str, doc: str, labels: bool, finish: Callable[[float], float] | None = None, reference: bool = False
) -> Callable[[Batch], Batch]:
    """Register ``fn`` as metric ``name``."""

    def register(fn: Batch) -> Batch:
        METRICS.register(name)(Metric(name, doc, labels, fn, finish, reference))
        return fn

    return register


def rows(logits: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits as [examples, classes] (token positions count as examples), labels as [examples]."""
    flat = logits.detach().reshape(-1, logits.shape[-1]).double()
    return flat, None if labels is None else labels.reshape(-1)


def with_labels(logits: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` for a metric that needs labels (``check_metrics`` has made sure there are some)."""
    z, y = rows(logits, labels)
    if y is None:
        raise ConfigError("metrics: this metric needs labels and the batch has none")
    return z, y


@metric("accuracy", "share of examples whose argmax is the label", labels=True)
def _accuracy(logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, int]:
    z, y = with_labels(logits, labels)
    return float((z.argmax(-1) == y).sum()), len(z)


@metric("top5", "share of examples whose label is among the 5 largest logits", labels=True)
def _top5(logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, int]:
    z, y = with_labels(logits, labels)
    top = z.topk(min(5, z.shape[-1]), dim=-1).indices
    return float((top == y[:, None]).any(-1).sum()), len(z)


@metric("loss", "mean cross-entropy against the labels", labels=True)
def _loss(logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, int]:
    z, y = with_labels(logits, labels)
    return float(F.cross_entropy(z, y, reduction="sum")), len(z)


@metric("agreement", "share of examples whose argmax equals the unmodified model's", labels=False, reference=True)
def _agreement(logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, int]:
    z, _ = rows(logits)
    if logits is reference:  # the unmodified model against itself: every example agrees
        return float(len(z)), len(z)
    r, _ = rows(reference)
    return float((z.argmax(-1) == r.argmax(-1)).sum()), len(z)


@metric("kl", "mean KL(unmodified ‖ surgered) of the softmax over classes", labels=False, reference=True)
def _kl(logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, int]:
    z, _ = rows(logits)
    if logits is reference:  # KL of a distribution with itself is exactly 0 (log p - log p)
        return 0.0, len(z)
    r, _ = rows(reference)
    kl = F.kl_div(z.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum")
    return float(kl), len(z)


def check_metrics(
    names: Iterable[str | Metric] | None, labelled: bool, where: str = "metrics", compare: bool = True
) -> tuple[str | Metric, ...]:
    """The metrics to compute (the default for the data when None); unknown or label-less ones refused.

    An entry is a registered name or a Metric bound to options (``surgery.lm.metrics.logit_diff``).
    Without ``compare`` (the surgered model alone) a metric that compares with the unmodified model is refused.
    """
    if names is None:
        return DEFAULT_LABELLED if labelled else DEFAULT_UNLABELLED
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ConfigError(f"{where}: a list of metric names, e.g. [accuracy, loss]; got {names!r}")
    chosen = tuple(n if isinstance(n, Metric) else str(n) for n in names)
    for i, entry in enumerate(chosen):
        found = entry if isinstance(entry, Metric) else METRICS.get(entry, f"{where}[{i}]")
        name = found.name
        if found.labels and not labelled:
            raise ConfigError(
                f"{where}[{i}]: {name!r} needs labels and this input has none; use agreement or kl,"
                " or an input with labels (a dataset with y_key)"
            )
        if found.reference and not compare:
            raise ConfigError(
                f"{where}[{i}]: {name!r} compares with the unmodified model, which compare=false does not run;"
                " set compare=true or leave it out (metrics of the surgered model alone: accuracy, top5, loss, ...)"
            )
    return chosen


class Scores:
    """Running (sum, count) per metric for one model; ``result()`` gives the means.

    ``names`` are registered names, or Metric objects bound to options (``surgery.lm.metrics.logit_diff``).
    """

    def __init__(self, names: Sequence[str | Metric]) -> None:
        self.metrics = [n if isinstance(n, Metric) else METRICS.get(n) for n in names]
        self.sums = dict.fromkeys((m.name for m in self.metrics), 0.0)
        self.counts = dict.fromkeys((m.name for m in self.metrics), 0)

    def update(self, logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> None:
        """Add one batch (logits in float64 once, shared by every metric)."""
        same = logits is reference
        logits = logits.detach().double()
        reference = logits if same else reference.detach().double()
        for m in self.metrics:
            total, count = m.batch(logits, labels, reference)
            self.sums[m.name] += total
            self.counts[m.name] += count

    def result(self) -> dict[str, float]:
        """Each metric's mean over every example seen, through its ``finish`` if any (NaN before any)."""
        out = {}
        for m in self.metrics:
            mean = self.sums[m.name] / self.counts[m.name] if self.counts[m.name] else float("nan")
            out[m.name] = m.finish(mean) if m.finish is not None and self.counts[m.name] else mean
        return out


def metrics_dict(surgered: Mapping[str, float] | None, unmodified: Mapping[str, float] | None) -> dict[str, Any]:
    """``{"surgered", "unmodified", "delta"}`` as report.json holds them; only ``unmodified`` without surgery,
    only ``surgered`` without a comparison (``compare=false``)."""
    if unmodified is None:
        return {"surgered": dict(surgered or {})}
    if surgered is None:
        return {"unmodified": dict(unmodified)}
    delta = {k: surgered[k] - unmodified[k] for k in surgered}
    return {"surgered": dict(surgered), "unmodified": dict(unmodified), "delta": delta}
