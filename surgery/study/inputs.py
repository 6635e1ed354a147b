"""A study's inputs (positional or keyword tensors, examples along dim 0) and the logits of an output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from surgery.core.structure import find_logits
from surgery.errors import ConfigError
from surgery.lm.text import IGNORE
from surgery.study.rows import interleave


@dataclass
class Inputs:
    """A study's inputs: positional tensors or keyword tensors, all with examples along dim 0."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]

    @classmethod
    def of(cls, given: Any, where: str) -> Inputs:
        """A tensor (token ids or any input) or a dict of keyword tensors."""
        if isinstance(given, torch.Tensor):
            return cls((given,), {})
        if isinstance(given, Mapping) and given and all(isinstance(v, torch.Tensor) for v in given.values()):
            return cls((), {str(k): v for k, v in given.items()})
        raise ConfigError(f"{where}: a tensor (e.g. token ids [examples, positions]) or a dict of tensors")

    @property
    def examples(self) -> int:
        """How many examples (the size of dim 0)."""
        first = (*self.args, *self.kwargs.values())[0]
        return int(first.shape[0]) if first.dim() else 1

    def rows(self, start: int, stop: int) -> Inputs:
        """Examples ``start:stop``; a one-example input serves every row range."""
        if self.examples == 1:
            return self
        return Inputs(tuple(t[start:stop] for t in self.args), {k: v[start:stop] for k, v in self.kwargs.items()})

    def repeated(self, n: int) -> Inputs:
        """A one-example input as ``n`` copies of it."""
        return Inputs(tuple(t.expand(n, *t.shape[1:]) for t in self.args),
                      {k: v.expand(n, *v.shape[1:]) for k, v in self.kwargs.items()})  # fmt: skip

    def interleaved(self, k: int) -> Inputs:
        """Each example repeated ``k`` times in a row: cell ``j`` of a shared forward owns rows ``j::k``."""
        return Inputs(interleave(self.args, k), dict(zip(self.kwargs, interleave(tuple(self.kwargs.values()), k),
                                                         strict=True)))  # fmt: skip

    def run(self, model: nn.Module) -> Any:
        """The model's output on these inputs."""
        return model(*self.args, **self.kwargs)

    def token_ids(self) -> torch.Tensor | None:
        """The token ids, when these inputs are token ids (an integer tensor ``[examples, positions]``)."""
        ids = self.kwargs.get("input_ids", self.args[0] if self.args else None)
        if ids is None or ids.dim() != 2 or ids.is_floating_point():
            return None
        return ids

    def positions(self) -> int | None:
        """How many positions token ids have (what a grid's ``all`` means), or None for other inputs."""
        ids = self.token_ids()
        return None if ids is None else int(ids.shape[1])

    def text_labels(self) -> torch.Tensor | None:
        """Token ids with -100 at padding (``attention_mask`` 0): what text metrics score against."""
        ids = self.token_ids()
        if ids is None:
            return None
        mask = self.kwargs.get("attention_mask")
        return ids if mask is None else ids.masked_fill(mask == 0, IGNORE)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: the tensor itself, ``.logits``, or the first tensor of a tuple."""
    found = find_logits(output)
    if found is None:
        raise ConfigError(f"study: the model's output ({type(output).__name__}) holds no logits tensor to score")
    return found
