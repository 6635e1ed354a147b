"""Each cell's attribution estimate from the passes' activations and gradients: ``Σ delta · gradient`` over
the part its edit changes (``estimate``), and a layer × position grid read in one gather per site.

The cells of a patching grid patch one site at leading integer positions (``index: "[:, {pos}]"``) from a
source of the site's shape: planned once per study (``EditedCells``), such cells read one product per
site, ``(source - main) · gradient`` summed over the dims after the leading ones, in one gather; every
other cell (and a grid whose positions fall outside the site on this input) is estimated one by one,
which names the cell when its index does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from surgery.actions.base import KeyedError
from surgery.actions.sources import onto
from surgery.errors import ConfigError
from surgery.study.edits import Edit, Key

Tensors = dict[Key, torch.Tensor]


Index = slice | torch.Tensor  # a run of positions as a slice where it is one (a basic index: cheaper)


class Gather(NamedTuple):
    """Cells reading one site's product at leading integers: which cells, their positions, the positions' range."""

    edit: Edit  # the first cell's: the site, source and heads every cell of the gather shares
    cells: list[int]
    leads: tuple[Index, ...]  # per leading dim, every cell's position there (one dim: a slice where it is a run)
    bounds: tuple[tuple[int, int], ...]  # per leading dim, the smallest and largest position


@dataclass
class EditedCells:
    """Every cell's edits, and which cells read one summed product per site in one gather (planned once)."""

    edits: list[list[Edit]]
    gathers: list[Gather] = field(init=False)
    rest: list[int] = field(init=False)  # cells estimated one by one

    def __post_init__(self) -> None:
        groups: dict[tuple[Any, ...], tuple[Edit, list[int], list[tuple[int, ...]]]] = {}
        self.rest = []
        for c, cell in enumerate(self.edits):
            edit = cell[0]
            lead = _leading_ints(edit) if len(cell) == 1 else None
            if lead is None:
                self.rest.append(c)
                continue
            key = (edit.site, edit.source, edit.heads, len(lead))
            if key not in groups:
                groups[key] = (edit, [], [])
            groups[key][1].append(c)
            groups[key][2].append(lead)
        self.gathers = []
        for edit, cells, leads in groups.values():
            dims = list(zip(*leads, strict=True))
            leads_by_dim = (_index(dims[0]),) if len(dims) == 1 else tuple(torch.tensor(d) for d in dims)
            self.gathers.append(Gather(edit, cells, leads_by_dim, tuple((min(d), max(d)) for d in dims)))

    def estimates(self, main: Tensors, grad: Tensors, source: Tensors) -> torch.Tensor:
        """Every cell's estimate, ``[cells, examples]`` (float64)."""
        products: dict[Any, torch.Tensor] = {}
        parts: list[tuple[list[int], torch.Tensor]] = []
        one_by_one = list(self.rest)
        for gather in self.gathers:
            picked = _gathered(gather, main, grad, source, products)
            if picked is None:  # positions outside this input's site, or a source of another shape
                one_by_one += gather.cells
            else:
                parts.append((gather.cells, picked))
        if one_by_one:
            one_by_one.sort()
            each = [_cell_estimate(self.edits[c], main, grad, source, products) for c in one_by_one]
            parts.append((one_by_one, torch.stack(each)))
        if [c for cells, _ in parts for c in cells] == list(range(len(self.edits))):
            return torch.cat([values for _, values in parts])  # the usual grid: the parts in cell order
        first = parts[0][1]
        out = torch.empty((len(self.edits), first.shape[1]), dtype=first.dtype, device=first.device)
        for cells, values in parts:
            out[cells] = values
        return out


def _index(values: tuple[int, ...]) -> Index:
    """Positions as a slice where they step evenly upwards from 0 or more, else as an index tensor."""
    step = values[1] - values[0] if len(values) > 1 else 1
    if values[0] >= 0 and step > 0 and values == tuple(range(values[0], values[-1] + 1, step)):
        return slice(values[0], values[-1] + 1, step)
    return torch.tensor(values)


def _leading_ints(edit: Edit) -> tuple[int, ...] | None:
    """The integers of an index ``(:, i, j)`` that keeps every example and picks leading positions, for a patch
    from a source; None for any other edit (cut the general way)."""
    index = edit.cut
    if edit.op not in ("set", "patch") or edit.source is None or index is None:
        return None
    if len(index) < 2 or index[0] != slice(None) or any(type(i) is not int for i in index[1:]):
        return None
    return tuple(index[1:])


def _gathered(
    gather: Gather, main: Tensors, grad: Tensors, source: Tensors, products: dict[Any, torch.Tensor]
) -> torch.Tensor | None:
    """The gather's cells' estimates, ``[cells, examples]``: the site's product summed over every dim after the
    leading ones, picked at each cell's positions; None where a position or the source's shape does not fit."""
    product = _product(gather.edit, main, grad, source, products)
    dims = len(gather.leads)
    if product is None or dims + 1 >= product.dim():
        return None
    if not all(-size <= low and high < size for (low, high), size in zip(gather.bounds, product.shape[1:])):
        return None
    summed = product.flatten(dims + 1).sum(-1)
    leads = [i if isinstance(i, slice) else i.to(summed.device) for i in gather.leads]
    return summed[(slice(None), *leads)].T


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


def _viewed(tensor: torch.Tensor, heads: int | None) -> torch.Tensor:
    """The tensor as the edit's op sees it: ``[..., heads, d_head]`` for an @heads site, else as it is."""
    return tensor if heads is None else tensor.unflatten(-1, (heads, -1))


def _cell_estimate(
    cell: list[Edit], main: dict[Key, torch.Tensor], grad: dict[Key, torch.Tensor], source: dict[Key, torch.Tensor],
    products: dict[Any, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The sum of a cell's edits' estimates (most cells make one edit)."""
    total = checked_estimate(cell[0], main, grad, source, products)
    for edit in cell[1:]:
        total = total + checked_estimate(edit, main, grad, source, products)
    return total
