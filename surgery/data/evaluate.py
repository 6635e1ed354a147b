"""``surgery.evaluate``: metrics of the surgered and the unmodified model over a data set, in one pass."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import Plan, compile_plan
from surgery.core.engine import Surgery, apply_plan
from surgery.core.structure import find_logits
from surgery.data.metrics import Metric, Scores, check_metrics, metrics_dict
from surgery.errors import ConfigError


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``.logits`` of a ModelOutput, or the first tensor."""
    found = find_logits(output)
    if found is not None:
        return found
    raise ConfigError(f"metrics: the model's output ({type(output).__name__}) holds no tensor of logits")


def split_batch(batch: Any) -> tuple[Any, torch.Tensor | None]:
    """``(x, y)`` of a batch: a tensor alone is unlabelled; a pair or a ``{"x", "y"}`` dict is labelled."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict) and "x" in batch:
        return batch["x"], batch.get("y")
    if isinstance(batch, (tuple, list)) and len(batch) in (1, 2):  # a DataLoader over (x,) or (x, y) rows
        return batch[0], batch[1] if len(batch) == 2 else None
    raise ConfigError(f"data: each batch must be x or (x, y), got {type(batch).__name__}")


def reference_model(model: nn.Module, plan: Plan) -> nn.Module | None:
    """A copy of the unmodified model when the plan changes weights or modules (an apply pass), else None.

    Without such a step the surgery is paused for the reference forward instead, so nothing is copied.
    """
    if any(s.enabled and s.mechanism == "apply pass" for s in plan.steps):
        return copy.deepcopy(model)
    return None


def evaluate(
    model: nn.Module,
    data: Iterable[Any],
    actions: Any = None,
    metrics: Sequence[str | Metric] | None = ("accuracy", "loss"),
    *,
    device: torch.device | str | None = None,
    on_batch: Callable[[int], None] | None = None,
    **plan_options: Any,
) -> dict[str, Any]:
    """Metrics over ``data`` (batches of ``x`` or ``(x, y)``) for the model with ``actions`` and without.

    >>> surgery.evaluate(model, loader, "linearize", metrics=["accuracy", "kl"])["delta"]["accuracy"]

    Returns ``{"surgered", "unmodified", "delta"}`` (``unmodified`` only when ``actions`` is None);
    ``metrics=None`` picks the default for the data (with labels: accuracy, loss, agreement, kl).
    """
    batches = iter(data)
    first = next(batches, None)
    if first is None:
        raise ConfigError("data: no batches; the data set is empty")
    labelled = split_batch(first)[1] is not None
    names = check_metrics(metrics, labelled)
    from surgery.lm.kinds import refuse_causal_metrics  # perplexity on a masked LM or T5 means nothing

    refuse_causal_metrics(model, names)
    plan = None
    if actions is not None:
        plan = actions if isinstance(actions, Plan) else compile_plan(model, actions, **plan_options)
    with torch.no_grad():
        return _run(model, plan, names, _chain(first, batches), device, on_batch)


def _run(
    model: nn.Module,
    plan: Plan | None,
    names: Sequence[str | Metric],
    batches: Iterator[Any],
    device: torch.device | str | None,
    on_batch: Callable[[int], None] | None,
) -> dict[str, Any]:
    unmodified = Scores(names)
    if plan is None:
        for x, y in _moved(batches, device, on_batch):
            logits = logits_of(model(x))
            unmodified.update(logits, y, logits)
        return metrics_dict(None, unmodified.result())
    surgered = Scores(names)
    reference = reference_model(model, plan)
    surgery = apply_plan(model, plan)
    try:
        for x, y in _moved(batches, device, on_batch):
            after = logits_of(model(x))
            before = _reference_logits(reference, surgery, x)
            surgered.update(after, y, before)
            unmodified.update(before, y, before)
    finally:
        surgery.remove()
    return metrics_dict(surgered.result(), unmodified.result())


def _reference_logits(reference: nn.Module | None, surgery: Surgery, x: Any) -> torch.Tensor:
    if reference is not None:
        return logits_of(reference(x))
    with surgery.paused():
        return logits_of(surgery.model(x))


def _moved(
    batches: Iterator[Any], device: torch.device | str | None, on_batch: Callable[[int], None] | None
) -> Iterator[tuple[Any, torch.Tensor | None]]:
    for batch in batches:
        x, y = split_batch(batch)
        if device is not None:
            x = x.to(device) if isinstance(x, torch.Tensor) else x
            y = y.to(device) if y is not None else None
        yield x, y
        if on_batch is not None:
            on_batch(len(y) if y is not None else len(x))


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
