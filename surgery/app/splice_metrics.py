"""The splice metrics in a CLI run: ``metrics: [l0, reconstruction_mse, explained_variance, ce_loss_recovered]``.

They are taken out of ``metrics`` before the logit metrics are checked, and computed after the run (the surgery
removed) over the run's batches made again, by ``surgery.splice.metrics.splice_metrics``; report.json holds them
as ``splice_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from surgery.splice.metrics import SPLICE_METRICS


def split_metrics(given: Any) -> tuple[Any, tuple[str, ...]]:
    """``metrics`` without the splice metrics (None stays None: the default), and the splice metrics named."""
    if not isinstance(given, (list, tuple)):
        return given, ()
    splice = tuple(str(m) for m in given if isinstance(m, str) and m in SPLICE_METRICS)
    if not splice:
        return given, ()
    return [m for m in given if not (isinstance(m, str) and m in SPLICE_METRICS)], splice


def splice_report(model: Any, plan: Any, remake: Callable[[], Any], names: tuple[str, ...], text: bool) -> Any:
    """The splice metrics over the run's batches, made again (``remake``), with the model as it was."""
    from surgery.splice.metrics import splice_metrics

    return splice_metrics(model, plan, _batches(remake(), text), metrics=names)


def _batches(data: Any, text: bool) -> Iterator[Any]:
    """The run's batches as splice_metrics takes them: keyword inputs (text), ``(x, y)``, or ``x``."""
    for batch in data:
        if batch.kwargs and not batch.args:
            yield dict(batch.kwargs)
        elif batch.labels is not None and not text and len(batch.args) == 1:
            yield batch.args[0], batch.labels
        else:
            yield batch.args[0]
