"""Declarative model surgery for PyTorch: name modules by glob, list actions, apply, remove.

>>> import surgery
>>> plan = surgery.plan(model, "linearize")
>>> with surgery.apply(model, plan) as s:
...     y = model(x)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

import surgery.actions  # noqa: F401 - registers every action kind into surgery.core.steps.KINDS
import surgery.activations as activations  # surgery.activations.open(DIR): a harvested activation dataset
import surgery.arch  # noqa: F401
import surgery.circuit as _circuit_package  # noqa: F401 - loaded first, so the function circuit() below keeps the name - resolves "@" sites (surgery.core.compiler.SELECTOR_REWRITES)
import surgery.splice  # noqa: F401 - registers kind: splice (surgery/splice/)
import surgery.study as _study_package  # noqa: F401 - loaded first, so the function study() below keeps the name
from surgery.core.compiler import Plan, compile_plan
from surgery.core.engine import Surgery, apply_plan
from surgery.errors import ActionError, ConfigError, NoMatchError, SurgeryError

__version__ = "0.1.0"


def plan(
    model: nn.Module,
    actions: Any,
    *,
    seed: int = 0,
    strict: bool = True,
    safe: bool = False,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    reuse: bool = True,
) -> Plan:
    """Compile ``actions`` (a name in conf/actions, a YAML path, a dict or DictConfig) for ``model``.

    ``example_inputs`` (a tuple of positional inputs) and ``example_kwargs`` (keyword inputs, e.g. a
    tokenized batch's ``input_ids``/``attention_mask``) let shapes be checked before applying. The same
    recipe (by content) on the same module tree returns the plan compiled before (docs/behaviour.md,
    "Plans reused"); ``reuse=False`` compiles afresh.
    """
    return compile_plan(
        model, actions, seed=seed, strict=strict, safe=safe, example_inputs=example_inputs,
        example_kwargs=example_kwargs, reuse=reuse,
    )  # fmt: skip


def evaluate(
    model: nn.Module,
    data: Iterable[Any],
    actions: Any = None,
    metrics: Sequence[str] | None = ("accuracy", "loss"),
    **options: Any,
) -> dict[str, Any]:
    """Metrics over batches ``(x, y)`` for the model with ``actions`` and without, in one pass over ``data``.

    Returns ``{"surgered", "unmodified", "delta"}`` (only ``unmodified`` when ``actions`` is None), as
    ``report.json["metrics"]``. Metrics: accuracy, top5, loss, agreement, kl (None: the default for the data).
    """
    from surgery.data.evaluate import evaluate as run_evaluation

    return run_evaluation(model, data, actions, metrics, **options)


def study(
    model: nn.Module,
    actions: Any,
    grid: Any,
    inputs: Any,
    metrics: Any,
    source: Any = None,
    normalize: Any = False,
    ci: float | None = None,
    tokenizer: Any = None,
    method: str = "patch",
    steps: int | None = None,
    verify_top: int | None = None,
    **options: Any,
) -> Any:
    """Every cell of ``grid`` applied to ``model`` and scored per example; returns a ``StudyResult``.

    >>> r = surgery.study(model, {"cap": {...}, "patch": {..., "index": "[:, {pos}]"}}, {"layer": "0:2", "pos": "all"},
    ...                   corrupted_ids, [{"logit_diff": {"correct": " w44", "wrong": " w45"}}], source=clean_ids)
    >>> r.mean["logit_diff"]        # [layers, positions]

    ``options``: ``labels`` (for ``loss``/``accuracy`` on non-text inputs), ``n_boot``, ``seed``,
    ``batch_size``, ``strict``, ``safe``. See docs/studies.md.
    """
    from surgery.study.run import run_study

    return run_study(model, actions, grid, inputs, metrics, source=source, normalize=normalize, ci=ci,
                     method=method, steps=steps, verify_top=verify_top,
                     tokenizer=tokenizer, **options)  # fmt: skip


def circuit(
    model: nn.Module,
    inputs: Any,
    source: Any,
    metrics: Any,
    method: str = "eap",
    nodes: str = "blocks",
    steps: int | None = None,
    top_edges: Any = None,
    tokenizer: Any = None,
    **options: Any,
) -> Any:
    """Every edge between ``model``'s components scored per example; returns a ``CircuitResult``.

    >>> r = surgery.circuit(model, corrupted_ids, clean_ids, [{"logit_diff": {"correct": " w25", "wrong": " w60"}}],
    ...                     method="eap", nodes="heads", top_edges=[10, 50])
    >>> r.ranked(5)                 # [{"sender": "head.0.1", "receiver": "attn.1", "score": ...}, ...]

    ``method``: edges (exact edge patching), eap, eap_ig (``steps`` points). ``options``: ``labels``,
    ``batch_size``, ``batch_edges``, ``verify_top``. See docs/circuits.md.
    """
    from surgery.circuit.run import run_circuit

    return run_circuit(model, inputs, source, metrics, method=method, nodes=nodes, steps=steps, top_edges=top_edges,
                       tokenizer=tokenizer, **options)  # fmt: skip


def apply(model: nn.Module, plan_or_actions: Any, **plan_options: Any) -> Surgery:
    """Apply a plan (or compile ``actions`` first) all-or-nothing; returns a removable Surgery."""
    return apply_plan(model, plan_or_actions, **plan_options)


__all__ = [
    "ActionError",
    "ConfigError",
    "NoMatchError",
    "Plan",
    "Surgery",
    "SurgeryError",
    "activations",
    "apply",
    "circuit",
    "evaluate",
    "plan",
    "study",
    "__version__",
]
