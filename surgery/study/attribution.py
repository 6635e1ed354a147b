"""Attribution patching: every cell of a patching study estimated from one forward and backward.

For a cell whose change is an op on a site (a module's input or output item, cut by ``index``),
the estimate of ``metric(cell) - metric(unmodified)`` per example is ``Σ delta · ∂metric/∂site``
over the indexed part (every dim but the examples'), where ``delta`` is what the op changes:
``set``/``patch`` the source's part minus the main run's part, ``add`` its value (or source),
``mul`` ``(value - 1) · part``, ``zero`` ``-part``. The gradient is taken at the main (unmodified)
run (``attribution``, AtP), or averaged over ``steps`` points on the way from the main to the
source activation at that site (``integrated_gradients``; midpoints ``(k + ½) / steps``). This file runs
the passes; surgery/study/edits.py reads each cell's edits from its plan, surgery/study/estimates.py the
estimates from the passes' tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.actions.base import KeyedError, input_at, with_input
from surgery.core.structure import get_item, replace_item
from surgery.errors import ConfigError
from surgery.study.edits import Key, Site
from surgery.study.estimates import EditedCells

Replace = Callable[[Key, torch.Tensor], torch.Tensor]


def record(sites: dict[Key, Site], into: dict[Key, torch.Tensor], replace: Replace | None = None) -> list[Any]:
    """Hooks that keep each site's tensor in ``into`` (after ``replace`` gave its new value); returns the handles."""
    handles = []
    for key, site in sites.items():
        if site.what == "output":

            def after(m: nn.Module, args: Any, output: Any, key: Key = key, site: Site = site) -> Any:
                try:
                    value = get_item(output, site.item)
                except (IndexError, KeyError, TypeError) as e:
                    raise _not_there(site, e) from None
                new = replace(key, value) if replace is not None else value
                into[key] = new
                return None if new is value else replace_item(output, site.item, new)

            handles.append(site.module.register_forward_hook(after))
        else:

            def before(m: nn.Module, args: Any, kwargs: Any, key: Key = key, site: Site = site) -> Any:
                try:
                    holder, at = input_at(args, kwargs, site.item, site.position)
                except KeyedError as e:
                    raise _not_there(site, e) from None
                value = holder[at]
                new = replace(key, value) if replace is not None else value
                into[key] = new
                if new is value:
                    return None
                return with_input(args, kwargs, at, new)

            handles.append(site.module.register_forward_pre_hook(before, with_kwargs=True))
    return handles


def _not_there(site: Site, e: Exception) -> ConfigError:
    """The site's ``item`` is not in the module's input or output on this input."""
    why = str(e) if isinstance(e, KeyedError) else e
    return ConfigError(f"{site.where}.item: {site.item!r} does not fit the {site.what} of the module on this input:"
                       f" {why}")  # fmt: skip


def attribute_batch(
    sites: dict[Key, Site], cells: EditedCells, run: Callable[[], Any],
    run_source: Callable[[], Any] | None, score: Callable[[Any], torch.Tensor], steps: int | None,
    outputs: dict[str, Any] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each cell's estimate of ``metric(cell) - metric(unmodified)`` per example: ``[cells, examples]``.

    ``run`` and ``run_source`` run the model on the batch and on its source; ``score`` maps the
    model's output to the metric per example (differentiably); its first call scores the unmodified
    run. ``outputs`` (when given) receives the source run's output as ``"source"``.
    """
    source: dict[Key, torch.Tensor] = {}
    if run_source is not None:
        handles = record(sites, source)
        try:
            with torch.no_grad():
                output = run_source()
                if outputs is not None:
                    outputs["source"] = output
        finally:
            for handle in handles:
                handle.remove()
    main, grad = _gradients(sites, run, score)
    if steps is not None:  # integrated gradients: each edited site's gradient along the way to the source
        if run_source is None:
            raise ConfigError("study.method: integrated_gradients interpolates towards the source run; give a source")
        for key in {e.site for cell in cells.edits for e in cell}:
            grad[key] = _integrated(sites, key, run, score, main[key].detach(), source[key], steps)
    return cells.estimates(main, grad, source)


def _gradients(
    sites: dict[Key, Site], run: Callable[[], Any], score: Callable[[Any], torch.Tensor],
) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:  # fmt: skip
    """One forward and backward of the unmodified model: each site's tensor and the metric's gradient there."""
    main: dict[Key, torch.Tensor] = {}

    def keep(key: Key, value: torch.Tensor) -> torch.Tensor:
        if value.requires_grad:
            return value
        return value.detach().requires_grad_(value.is_floating_point())

    return main, _backward(record(sites, main, keep), run, score, main)


def _backward(
    handles: list[Any], run: Callable[[], Any], score: Callable[[Any], torch.Tensor], at: dict[Key, torch.Tensor]
) -> dict[Key, torch.Tensor]:
    """One forward with ``handles``' hooks, then the gradient of the metric's sum at each tensor of ``at`` (filled
    by the hooks), zero where it does not reach; hooks removed.

    Only these gradients are computed (``torch.autograd.grad``): not the weights', so the backward skips their
    products, and any gradient the model's parameters hold is left as it was.
    """
    try:
        with torch.enable_grad():
            total = score(run()).sum()
    finally:
        for handle in handles:
            handle.remove()
    keys = [k for k, v in at.items() if v.requires_grad]
    found: tuple[torch.Tensor | None, ...] = ()
    if keys and total.requires_grad:
        found = torch.autograd.grad(total, [at[k] for k in keys], allow_unused=True)
    grad = dict(zip(keys, found, strict=False))
    return {k: g if (g := grad.get(k)) is not None else torch.zeros_like(v) for k, v in at.items()}


def _at_point(point: torch.Tensor, key: Key, value: torch.Tensor) -> torch.Tensor:
    return point


def _integrated(
    sites: dict[Key, Site], key: Key, run: Callable[[], Any], score: Callable[[Any], torch.Tensor],
    main: torch.Tensor, source: torch.Tensor, steps: int,
) -> torch.Tensor:  # fmt: skip
    """The metric's gradient at ``key`` averaged over ``steps`` midpoints from the main to the source activation."""
    total = torch.zeros_like(main, dtype=torch.float64)
    for k in range(steps):
        alpha = (k + 0.5) / steps
        point = (main + alpha * (source.to(main.dtype).expand(main.shape) - main)).requires_grad_(True)
        held: dict[Key, torch.Tensor] = {}
        grad = _backward(record({key: sites[key]}, held, partial(_at_point, point)), run, score, held)
        if key in held:
            total += grad[key].double()
    return (total / steps).to(main.dtype)
