"""A splice's captured features in ``report.html``: per spliced site, the features that fired hardest and the
tokens they fired on (``capture: true`` on a ``kind: splice`` action; with ``features_top`` the K kept per
position). Only the first call (batch 0) is read, labelled by its examples' tokens when the input was text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from surgery.report.page import escape

FEATURES_SHOWN = 12
TOKENS_SHOWN = 5
CONTEXT = 4  # tokens shown before the one a feature fired on
KEY = re.compile(r"(?P<site>.+)/features(?P<part>\.values|\.indices)?(?:/(?P<call>\d+))?")


def feature_sites(captures: Mapping[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``ACTION/MODULE`` → (activations, indices or None) of the first call, from flat capture keys."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in captures.items():
        match = KEY.fullmatch(key)
        if match is None or match["call"] not in (None, "0") or not isinstance(tensor, torch.Tensor):
            continue
        found.setdefault(match["site"], {})[match["part"] or ""] = tensor
    sites: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for site, parts in found.items():
        if "" in parts:
            sites[site] = (parts[""], None)
        elif ".values" in parts and ".indices" in parts:
            sites[site] = (parts[".values"], parts[".indices"])
    return sites


def top_features(acts: torch.Tensor, indices: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """The features with the largest activation, each with its top (example, position, value) and how often it fired.

    ``acts`` is ``[examples, positions, features]`` (or ``[examples, features]``), or with ``indices`` the
    K kept values per position and which features they are.
    """
    values = acts.detach().float().cpu()
    values = values.unsqueeze(1) if values.dim() == 2 else values.reshape(values.shape[0], -1, values.shape[-1])
    examples, positions = values.shape[0], values.shape[1]
    if indices is None:
        flat = values.reshape(-1, values.shape[-1])  # [examples * positions, features]
        feature = torch.arange(flat.shape[1]).expand_as(flat)
    else:
        flat = values.reshape(-1, values.shape[-1])
        feature = indices.detach().cpu().long().reshape(flat.shape)
    count = int(feature.max()) + 1 if feature.numel() else 0
    where = torch.arange(flat.shape[0]).unsqueeze(1).expand_as(flat).reshape(-1)
    v, f = flat.reshape(-1), feature.reshape(-1)
    peak = torch.full((count,), -torch.inf).scatter_reduce(0, f, v, "amax")
    fired = torch.zeros(count).scatter_add(0, f, (v > 0).float())
    chosen = [int(i) for i in torch.argsort(peak, descending=True)[:FEATURES_SHOWN] if peak[i] > 0]
    rows = []
    for i in chosen:
        mine = f == i
        order = torch.argsort(v[mine], descending=True)[:TOKENS_SHOWN]
        at, val = where[mine][order], v[mine][order]
        tops = [(int(a) // positions, int(a) % positions, float(x)) for a, x in zip(at, val) if x > 0]
        rows.append({"feature": i, "max": float(peak[i]), "fired": float(fired[i]) / (examples * positions),
                     "top": tops})  # fmt: skip
    return rows


def splice_html(captures: Mapping[str, Any] | None, tokens: Sequence[Sequence[str]] | None) -> str:
    """Per spliced site: its top features, how often each fired, and the tokens (with context) it fired on most."""
    if not captures:
        return ""
    parts = []
    for site, (acts, indices) in feature_sites(captures).items():
        rows = []
        for row in top_features(acts, indices):
            shown = "".join(f"<li>{_context(tokens, e, p)} <span class=\"num\">{x:.4g}</span></li>"
                            for e, p, x in row["top"])  # fmt: skip
            numbers = "".join(f'<td class="num">{v}</td>' for v in (row["feature"], f"{row['max']:.4g}",
                                                                      f"{row['fired']:.1%}"))  # fmt: skip
            rows.append(f'<tr>{numbers}<td><ol class="tokens">{shown}</ol></td></tr>')
        if not rows:
            continue
        head = "".join(f"<th>{h}</th>" for h in ("feature", "max", "fired at", "top activations"))
        parts.append(f"<h3>{escape(site)}</h3><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}"
                     "</tbody></table>")  # fmt: skip
    return "\n".join(parts)


def _context(tokens: Sequence[Sequence[str]] | None, example: int, position: int) -> str:
    """The token a feature fired on, marked, after up to ``CONTEXT`` tokens before it; or where, without tokens."""
    if tokens is None or example >= len(tokens) or position >= len(tokens[example]):
        return escape(f"example {example}, position {position}")
    before = "".join(tokens[example][max(0, position - CONTEXT) : position])
    return (f'<code>{escape(before)}<mark>{escape(tokens[example][position])}</mark></code>'
            f' <span class="where">{escape(f"ex {example}, pos {position}")}</span>')  # fmt: skip
