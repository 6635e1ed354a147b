"""The logit lens: a site's output read through the model's own final norm and unembedding (no weights reloaded).

``LogitLens`` is the ``fn`` a ``capture`` with ``lens: logit`` records: ``unembed(final_norm(x))`` of item 0 of
each call's output, with the model's own output scaling (T5's tied-embedding rescale, Gemma's final logit
softcap), so the lens of the last block's output is the model's logits. ``top_tokens`` decodes the K most likely
tokens per position for the report.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from surgery.arch.sitemap import SiteMap
from surgery.core.callables import OWN_TRANSFORMS
from surgery.core.select import ModuleIndex
from surgery.core.structure import get_item
from surgery.errors import ConfigError


class LogitLens:
    """``fn(module, inputs, output)`` giving the logits of the output's item 0: final norm, unembedding."""

    def __init__(self, norm: nn.Module | None, unembed: nn.Module, scale: float | None, softcap: float | None,
                 text: str) -> None:  # fmt: skip
        self.norm, self.unembed, self.scale, self.softcap, self.text = norm, unembed, scale, softcap, text

    @classmethod
    def of(cls, sites: SiteMap, index: ModuleIndex, selected: list[str], where: str) -> LogitLens:
        """The lens of this model, or a ConfigError saying what it lacks."""
        if "unembed" in sites.absent:
            why = sites.absent["unembed"]
            raise ConfigError(f"{where}.lens: this model ({sites.family}) has no unembedding: {why}")
        position = {name: i for i, name in enumerate(index.names)}
        norms = sites.model_level.get("final_norm", [])
        if len(sites.stacks) > 1:  # an encoder-decoder: the decoder's norm and head; encoder blocks have no lens
            decoder = [s for s in sites.stacks if s.role == "decoder"]
            prefix = decoder[0].parent + "." if decoder else ""
            outside = [n for n in selected if prefix and not n.startswith(prefix)]
            if not decoder or outside or not selected:
                what = repr(outside[0]) if outside else "a module selected by name"
                raise ConfigError(
                    f"{where}.lens: reads the decoder's unembedding; {what} may not be in the decoder:"
                    " select @decoder.SITE"
                )
            norms = [n for n in norms if n.startswith(prefix)]
        norm = index.modules[position[norms[0]]] if norms else None
        unembed = index.modules[position[sites.model_level["unembed"][0]]]
        shown = " → ".join([*norms[:1], sites.model_level["unembed"][0]])
        return cls(norm, unembed, sites.lens.get("scale"), sites.lens.get("softcap"), shown)

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> torch.Tensor:
        x = get_item(output, 0)
        if self.norm is not None:
            x = self.norm.forward(x)  # forward, not __call__: the lens must not fire hooks on the norm
        if self.scale is not None:
            x = x * self.scale
        logits = self.unembed.forward(x)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def __repr__(self) -> str:
        return f"logit lens ({self.text})"


OWN_TRANSFORMS.add(LogitLens)  # built by surgery from a config, never named by one: safe mode admits it


def top_tokens(logits: torch.Tensor, k: int, decode: Any) -> list[list[list[str]]]:
    """The ``k`` most likely tokens per example and position, decoded one by one: ``[batch][position][k]``."""
    flat = logits.detach().float()
    if flat.dim() == 2:
        flat = flat.unsqueeze(0)
    ids = flat.topk(min(k, flat.shape[-1]), dim=-1).indices.tolist()
    return [[[decode(i) for i in pos] for pos in row] for row in ids]


def lens_report(actions: dict[str, Any], captures: dict[str, torch.Tensor], tokenizer: Any) -> dict[str, Any]:
    """``{action: {"top": K, "tokens": {module: [position][K] tokens of example 0}}}`` for each ``lens`` capture
    with ``top`` (report.json's ``lens``, report.md's "Logit lens" table); empty without a tokenizer."""
    out: dict[str, Any] = {}
    if tokenizer is None:
        return out
    for name, node in actions.items():
        if not isinstance(node, dict) or node.get("lens") is None or not node.get("top"):
            continue
        k, prefix = int(node["top"]), f"{name}/"
        rows = {}
        for key, logits in captures.items():
            if key.startswith(prefix) and key.endswith("/output"):
                module = key[len(prefix) : -len("/output")]
                rows[module] = top_tokens(logits, k, lambda i: tokenizer.decode([i]))[0]
        out[name] = {"top": k, "tokens": rows}
    return out
