"""Cells sharing one forward by replicating rows (``batch_cells``).

With ``k`` cells per forward each example is repeated ``k`` times in a row (``repeat_interleave``),
so cell ``j`` owns rows ``j::k`` whatever the batch size, and each of its ops is cut to those rows
by prefixing its ``index`` (``"[:, 3]"`` becomes ``"[j::k, 3]"``). That is exact when every changing
action acts per example row: ``modify_input``/``modify_output`` with ``add``, ``mul``, ``set``,
``zero``, ``clamp``, ``noise``, ``mean_ablate`` or a patch ``from: {capture}``, on a model whose rows do
not mix (eval mode). Anything else runs one cell per forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

ROW_OPS = ("add", "mul", "set", "zero", "clamp", "noise", "mean_ablate", "patch")
ROW_KINDS = ("modify_input", "modify_output")
AUTO_ROWS = 64  # batch_cells: auto replicates up to about this many rows per forward


def why_not_rowwise(actions: Mapping[str, Any], sourced: bool = False) -> str | None:
    """Why a cell's actions cannot share forwards by rows, or None when they can.

    ``sourced``: with a source pass, which cells share only when no changing action acts in it.
    """
    from surgery.core.steps import KINDS

    for name, node in actions.items():
        if not isinstance(node, Mapping) or not node.get("enabled", True):
            continue
        kind = str(node.get("kind"))
        if kind in KINDS and KINDS.get(kind).observes:
            continue
        where = f"actions.{name}"
        if kind not in ROW_KINDS:
            return f"{where} ({kind}) does not act per example row"
        if node.get("op") not in ROW_OPS or node.get("function") is not None:
            return f"{where}: op {node.get('op')} does not act per example row"
        source = node.get("from")
        if source is not None and not (isinstance(source, Mapping) and "capture" in source):
            return f"{where}.from: a file or tensor source is shaped for one copy of the rows"
        if _first_part(node.get("index")) not in (None, ":"):
            return f"{where}.index: its first subscript picks rows ({node.get('index')!r})"
        if sourced and source is None and node.get("passes", "both") != "main":
            return f"{where} changes the source pass too, so each cell runs its own (passes: main keeps it out)"
    return None


def _first_part(index: str | None) -> str | None:
    """The first subscript of an index text (``"[:, 3]"`` → ``":"``), or None without an index."""
    if index is None:
        return None
    text = index.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return text
    depth = 0
    for i, char in enumerate(text[1:-1]):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            return text[1 : i + 1].strip()
    return text[1:-1].strip()


def restricted(actions: dict[str, Any], j: int, k: int) -> dict[str, Any]:
    """``actions`` with every changing action's op cut to rows ``j::k`` (see :func:`why_not_rowwise`)."""
    out = dict(actions)
    for name, node in actions.items():
        if not isinstance(node, Mapping) or str(node.get("kind")) not in ROW_KINDS:
            continue
        index = node.get("index")
        body = index.strip()[1:-1] if isinstance(index, str) else ""
        rest = body.split(",", 1)[1].strip() if "," in body else ""
        out[name] = {**node, "index": f"[{j}::{k}{', ' + rest if rest else ''}]"}
    return out


def cells_per_forward(wanted: Any, cells: int, rows: int, why: str | None) -> int:
    """How many cells share a forward: ``wanted`` (``auto`` or a number) where the plan allows it."""
    if wanted == "auto":  # as many as AUTO_ROWS allows, in as few forwards, spread evenly (no forward mostly empty)
        most = 1 if why is not None else max(1, min(cells, AUTO_ROWS // max(rows, 1)))
        return -(-cells // -(-cells // most))
    if wanted > 1 and why is not None:
        from surgery.errors import ConfigError

        raise ConfigError(f"study.batch_cells: {wanted} cells cannot share a forward: {why}; use batch_cells: 1")
    return min(int(wanted), cells)


def interleave(tensors: tuple[torch.Tensor, ...], k: int) -> tuple[torch.Tensor, ...]:
    """Each example repeated ``k`` times in a row."""
    return tuple(t.repeat_interleave(k, dim=0) for t in tensors)
