"""Attribution patching: every cell of a patching study estimated from one forward and backward.

For a cell whose change is an op on a site (a module's input or output item, cut by ``index``),
the estimate of ``metric(cell) - metric(unmodified)`` per example is ``Σ delta · ∂metric/∂site``
over the indexed part (every dim but the examples'), where ``delta`` is what the op changes:
``set``/``patch`` the source's part minus the main run's part, ``add`` its value (or source),
``mul`` ``(value - 1) · part``, ``zero`` ``-part``. The gradient is taken at the main (unmodified)
run (``attribution``, AtP), or averaged over ``steps`` points on the way from the main to the
source activation at that site (``integrated_gradients``; midpoints ``(k + ½) / steps``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from surgery.actions.base import KeyedError, input_at, input_position
from surgery.actions.sources import onto
from surgery.core.compiler import Plan
from surgery.core.structure import get_item, replace_item
from surgery.errors import ConfigError
from surgery.expr.parsing import compile_index

EDITS = ("set", "patch", "add", "mul", "zero")
Key = tuple[int, str, Any]  # (id(module), "input" | "output", item)


class Edit(NamedTuple):
    """One cell's change at one site: the op, its value, where its source is recorded, and the index."""

    site: Key
    source: Key | None  # where a from: {capture} source is recorded (the same module)
    op: str
    value: float | None
    cut: tuple[Any, ...] | None  # the index, parsed
    heads: int | None = None  # the index is on the site viewed as [..., heads, d_head] (an @heads site)
    where: str = ""  # "study cell {layer: 0, pos: 3}: actions.patch", for a shape that does not fit
    index_text: str | None = None
    action: str = ""


@dataclass
class Site:
    """A module's input or output item, as the hooks read and replace it."""

    module: nn.Module
    what: str
    item: Any
    position: int | None
    where: str = ""  # the first action reading it: "actions.patch"


def edits_of(plan: Plan, cell: str) -> list[Edit]:
    """The changes one cell makes, each a site an attribution can read; anything else is refused."""
    edits = []
    for step in plan.steps:
        if not step.enabled or step.traits.observes:
            continue
        cfg, where = step.config, f"{cell}: actions.{step.name}"
        if step.kind not in ("modify_input", "modify_output") or cfg.op not in EDITS or cfg.function is not None:
            what = step.kind + (f" op {cfg.op}" if getattr(cfg, "op", None) else "")
            raise ConfigError(
                f"study.method: attribution estimates {', '.join(EDITS)} ops of modify_input/modify_output;"
                f" {where} is {what}; use method: patch"
            )
        source = cfg.from_
        if source is not None and not (isinstance(source, dict) and "capture" in source):
            raise ConfigError(f"study.method: {where}.from: attribution reads sources from a capture only")
        if cfg.calls is not None:
            raise ConfigError(f"study.method: {where}.calls: attribution reads every call as one; drop calls")
        index = compile_index(cfg.index, f"{where}.index") if cfg.index is not None else None
        if index and index[0] != slice(None) and index[0] is not Ellipsis:
            raise ConfigError(f"study.method: {where}.index: its first subscript must keep every example (':')")
        what = "input" if step.kind == "modify_input" else "output"
        for target in step.targets:
            site = (id(target.module), what, cfg.item)
            src = (id(target.module), str(source.get("what", "output")), cfg.item) if source else None
            heads = getattr(cfg, "heads", None)
            edits.append(Edit(site, src, cfg.op, cfg.value, index, heads, where, cfg.index, step.name))
    if not edits:
        raise ConfigError(f"study.method: {cell} changes nothing an attribution can estimate")
    return edits


def sites_of(plans: list[Plan]) -> dict[Key, Site]:
    """Every module input/output an edit of any cell acts on or reads its source from."""
    modules = {id(t.module): t for p in plans for s in p.steps if s.enabled for t in s.targets}
    found: dict[Key, Site] = {}
    for plan in plans:
        for step in plan.steps:
            if not step.enabled or step.kind not in ("modify_input", "modify_output"):
                continue
            keys = [(id(t.module), "input" if step.kind == "modify_input" else "output", step.config.item)
                    for t in step.targets]  # fmt: skip
            source = step.config.from_
            if isinstance(source, dict) and "capture" in source:
                keys += [(k[0], str(source.get("what", "output")), k[2]) for k in keys]
            for key in keys:
                target = modules[key[0]]
                named = isinstance(key[2], str) and key[1] == "input"
                position = input_position(target, key[2], "study") if named else None
                found.setdefault(key, Site(target.module, key[1], key[2], position, f"actions.{step.name}"))
    return found


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
                if holder is kwargs:
                    return args, {**kwargs, at: new}
                return (*args[:at], new, *args[at + 1 :]), kwargs

            handles.append(site.module.register_forward_pre_hook(before, with_kwargs=True))
    return handles


def _not_there(site: Site, e: Exception) -> ConfigError:
    """The site's ``item`` is not in the module's input or output on this input."""
    why = str(e) if isinstance(e, KeyedError) else e
    return ConfigError(f"{site.where}.item: {site.item!r} does not fit the {site.what} of the module on this input:"
                       f" {why}")  # fmt: skip


def checked_estimate(
    edit: Edit, main: dict[Key, torch.Tensor], grad: dict[Key, torch.Tensor], source: dict[Key, torch.Tensor],
    products: dict[Any, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """``estimate``; an index or source that does not fit the site on this input is a ConfigError naming the cell."""
    try:
        return estimate(edit, main, grad, source, products)
    except (IndexError, RuntimeError, KeyedError) as e:
        shape = list(main[edit.site].shape)
        if edit.heads is not None and (not shape or shape[-1] % edit.heads):
            raise ConfigError(f"{edit.where}.heads: the {edit.site[1]} has shape {shape}, whose last dim does not"
                              f" split into {edit.heads} heads") from None  # fmt: skip
        if isinstance(e, KeyedError):
            raise ConfigError(f"{edit.where}.{e.key}: {e}") from None
        if edit.index_text is not None:
            raise ConfigError(
                f"{edit.where}.index: {edit.index_text} does not fit the {edit.site[1]}, shape {shape}: {e}"
            ) from None
        raise


def estimate(
    edit: Edit,
    main: dict[Key, torch.Tensor],
    grad: dict[Key, torch.Tensor],
    source: dict[Key, torch.Tensor],
    products: dict[Any, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``Σ delta · gradient`` over the edit's part, per example (float64).

    ``products`` keeps ``(source - main) · gradient`` over a whole site, so that the cells patching parts of
    the same site from the same source cut it instead of each computing its part (the same numbers).
    """
    product = _product(edit, main, grad, source, products) if products is not None else None
    if product is not None:
        cut = product[edit.cut]
        return cut.reshape(cut.shape[0], -1).sum(dim=1) if cut.dim() > 1 else cut
    t, g = _viewed(main[edit.site].detach(), edit.heads), _viewed(grad[edit.site], edit.heads)
    part = t if edit.cut is None else t[edit.cut]
    g_part = g if edit.cut is None else g[edit.cut]
    if edit.op in ("set", "patch"):
        if edit.source is None:
            delta = torch.as_tensor(edit.value, dtype=part.dtype) - part
        else:
            delta = onto(_viewed(source[edit.source], edit.heads).to(part.dtype), t, part, edit.cut, "from") - part
    elif edit.op == "add":
        delta = (onto(_viewed(source[edit.source], edit.heads).to(part.dtype), t, part, edit.cut, "from")
                 if edit.source is not None
                 else torch.full_like(part, float(edit.value or 0.0)))  # fmt: skip
    elif edit.op == "mul":
        delta = (float(edit.value if edit.value is not None else 1.0) - 1.0) * part
    else:  # zero
        delta = -part
    product = (delta.double() * g_part.double()).expand(part.shape)
    return product.reshape(part.shape[0], -1).sum(dim=1) if product.dim() > 1 else product


def _product(
    edit: Edit, main: dict[Key, torch.Tensor], grad: dict[Key, torch.Tensor], source: dict[Key, torch.Tensor],
    products: dict[Any, torch.Tensor],
) -> torch.Tensor | None:  # fmt: skip
    """``(source - main) · gradient`` over the edit's whole site (kept in ``products``), for an indexed patch from
    a source of the site's shape; None for any other edit."""
    if edit.op not in ("set", "patch") or edit.source is None or edit.cut is None:
        return None
    key = (edit.site, edit.source, edit.heads)
    if key not in products:
        t, src = _viewed(main[edit.site].detach(), edit.heads), _viewed(source[edit.source], edit.heads)
        if src.shape != t.shape:
            return None
        products[key] = (src.to(t.dtype) - t).double() * _viewed(grad[edit.site], edit.heads).double()
    return products[key]


def _leading_ints(index: tuple[Any, ...], shape: torch.Size) -> tuple[int, ...] | None:
    """The integers of an index ``(:, i, j)`` that keeps every example and picks leading positions inside
    ``shape`` (negative from the end); None for any other index (slices, ``...``, out of range), cut the
    general way (which names the cell when it does not fit)."""
    if len(index) < 2 or len(index) >= len(shape) or index[0] != slice(None):
        return None
    lead = index[1:]
    for i, size in zip(lead, shape[1:], strict=False):
        if type(i) is not int or not -size <= i < size:
            return None
    return lead


def _viewed(tensor: torch.Tensor, heads: int | None) -> torch.Tensor:
    """The tensor as the edit's op sees it: ``[..., heads, d_head]`` for an @heads site, else as it is."""
    return tensor if heads is None else tensor.unflatten(-1, (heads, -1))


def attribute_batch(
    model: nn.Module, sites: dict[Key, Site], edits: list[list[Edit]], run: Callable[[], Any],
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
    main, grad = _gradients(model, sites, run, score)
    if steps is not None:  # integrated gradients: each edited site's gradient along the way to the source
        if run_source is None:
            raise ConfigError("study.method: integrated_gradients interpolates towards the source run; give a source")
        for key in {e.site for cell in edits for e in cell}:
            grad[key] = _integrated(model, sites, key, run, score, main[key].detach(), source[key], steps)
    return _estimates(edits, main, grad, source)


def _estimates(
    edits: list[list[Edit]], main: dict[Key, torch.Tensor], grad: dict[Key, torch.Tensor],
    source: dict[Key, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """Every cell's estimate, ``[cells, examples]``: the cells that read one summed product at leading integers
    (a layer × position grid) in one gather per product, the others one by one."""
    products: dict[Any, torch.Tensor] = {}
    found: list[torch.Tensor | None] = [None] * len(edits)
    gathers: dict[tuple[Any, ...], tuple[torch.Tensor, list[int], list[tuple[int, ...]]]] = {}
    for c, cell in enumerate(edits):
        product = _product(cell[0], main, grad, source, products) if len(cell) == 1 else None
        lead = _leading_ints(cell[0].cut, product.shape) if product is not None else None  # type: ignore[arg-type]
        if product is None or lead is None:
            found[c] = _cell_estimate(cell, main, grad, source, products)  # names the cell when it does not fit
            continue
        key = (cell[0].site, cell[0].source, cell[0].heads, len(lead))
        if key not in gathers:  # the site's product summed over every dim after the leading ones, once
            gathers[key] = (product.flatten(len(lead) + 1).sum(-1), [], [])
        gathers[key][1].append(c)
        gathers[key][2].append(lead)
    for summed, cells, leads in gathers.values():
        at = torch.tensor(leads, device=summed.device).T  # one row of indices per leading dim
        pick: tuple[Any, ...] = (slice(None), *at)
        for c, column in zip(cells, summed[pick].T, strict=True):
            found[c] = column
    return torch.stack(found)  # type: ignore[arg-type]


def _cell_estimate(
    cell: list[Edit], main: dict[Key, torch.Tensor], grad: dict[Key, torch.Tensor], source: dict[Key, torch.Tensor],
    products: dict[Any, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The sum of a cell's edits' estimates (most cells make one edit)."""
    total = checked_estimate(cell[0], main, grad, source, products)
    for edit in cell[1:]:
        total = total + checked_estimate(edit, main, grad, source, products)
    return total


def _gradients(
    model: nn.Module, sites: dict[Key, Site], run: Callable[[], Any], score: Callable[[Any], torch.Tensor],
) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:  # fmt: skip
    """One forward and backward of the unmodified model: each site's tensor and the metric's gradient there."""
    main: dict[Key, torch.Tensor] = {}

    def keep(key: Key, value: torch.Tensor) -> torch.Tensor:
        if value.requires_grad:
            value.retain_grad()
            return value
        return value.detach().requires_grad_(value.is_floating_point())

    _backward(model, record(sites, main, keep), run, score)
    grad = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in main.items()}
    return main, grad


def _backward(
    model: nn.Module, handles: list[Any], run: Callable[[], Any], score: Callable[[Any], torch.Tensor]
) -> None:
    """One forward with ``handles``' hooks and the backward of the metric's sum; hooks removed, no gradient kept."""
    try:
        with torch.enable_grad():
            score(run()).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)


def _at_point(point: torch.Tensor, key: Key, value: torch.Tensor) -> torch.Tensor:
    return point


def _integrated(
    model: nn.Module, sites: dict[Key, Site], key: Key, run: Callable[[], Any], score: Callable[[Any], torch.Tensor],
    main: torch.Tensor, source: torch.Tensor, steps: int,
) -> torch.Tensor:  # fmt: skip
    """The metric's gradient at ``key`` averaged over ``steps`` midpoints from the main to the source activation."""
    total = torch.zeros_like(main, dtype=torch.float64)
    for k in range(steps):
        alpha = (k + 0.5) / steps
        point = (main + alpha * (source.to(main.dtype).expand(main.shape) - main)).requires_grad_(True)
        held: dict[Key, torch.Tensor] = {}
        _backward(model, record({key: sites[key]}, held, partial(_at_point, point)), run, score)
        if point.grad is not None:
            total += point.grad.double()
    return (total / steps).to(main.dtype)
