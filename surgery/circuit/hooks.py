"""The hooks a circuit pass puts on the model: read the senders, read or change each receiver's input.

Every hook is a plain PyTorch hook whose handle is removed when the ``hooked`` block ends. Values are kept
as ``[batch, positions, d_model]`` whatever shape a module works in (OPT's MLP runs on ``[batch*positions,
d_model]``); a change is reshaped back to the receiver's own input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from surgery.actions.base import KeyedError, input_at, with_input
from surgery.circuit.graph import Graph
from surgery.core.structure import get_item
from surgery.errors import ConfigError

Change = Callable[[int, torch.Tensor], torch.Tensor | None]  # (receiver, input) -> new input or None


class Senders:
    """What one forward's senders wrote: the embed, each block's attention and MLP outputs (or heads' inputs)."""

    def __init__(self) -> None:
        self.embed: torch.Tensor | None = None
        self.attn: dict[int, torch.Tensor] = {}  # block -> attention output (blocks) or heads [B, P, H, d_head]
        self.mlp: dict[int, torch.Tensor] = {}

    def shape(self) -> torch.Size:
        """``[batch, positions, d_model]`` of the stream."""
        if self.embed is None:
            raise ConfigError("study.method: the model's first block never ran; a circuit needs its input")
        return self.embed.shape

    def stacked(self, graph: Graph) -> torch.Tensor:
        """Every sender's value as ``[senders, batch, positions, d_model]`` (a head: its slice of the projection)."""
        parts = [self.embed_value()[None]]
        for layer in range(graph.layers):
            if graph.nodes == "heads":
                parts.append(torch.einsum("bphk,hkd->hbpd", self.attn[layer], graph.head_weights(layer).detach()))
            else:
                parts.append(self.attn[layer][None])
            parts.append(self.mlp[layer][None])
        return torch.cat(parts)

    def embed_value(self) -> torch.Tensor:
        """The stream entering block 0."""
        self.shape()
        assert self.embed is not None
        return self.embed


def _stream(value: torch.Tensor, like: torch.Size) -> torch.Tensor:
    """``value`` as ``[batch, positions, d_model]`` (a module that flattens positions gives it back flat)."""
    return value if value.shape == like else value.reshape(like)


@contextmanager
def hooked(
    graph: Graph, senders: Senders | None = None, embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    change: Change | None = None, detach: bool = True,
) -> Iterator[None]:  # fmt: skip
    """Hooks for one forward: ``senders`` receives what each sender writes (detached unless ``detach`` is False);
    ``embed`` replaces the stream entering block 0; ``change`` gives a receiver's new input."""
    handles: list[Any] = []

    def first_block(m: nn.Module, args: Any, kwargs: Any) -> Any:
        try:
            holder, at = input_at(args, kwargs, "hidden_states", 0)
        except KeyedError as e:
            raise ConfigError(f"study.method: the first block's input is not where a circuit reads it: {e}") from None
        value = holder[at]
        new = embed(value) if embed is not None else value
        if senders is not None:
            senders.embed = new.detach() if detach else new
        if new is value:
            return None
        return with_input(args, kwargs, at, new)

    handles.append(graph.embed_at.register_forward_pre_hook(first_block, with_kwargs=True))
    if senders is not None:
        keep = (lambda t: t.detach()) if detach else (lambda t: t)
        for layer in range(graph.layers):
            if graph.nodes == "heads":
                handles.append(graph.heads_at[layer].register_forward_pre_hook(
                    lambda m, args, layer=layer: senders.attn.__setitem__(
                        layer, keep(args[0]).reshape(*senders.shape()[:2], graph.heads, graph.d_head))))  # fmt: skip
            else:
                handles.append(graph.attn_out[layer].register_forward_hook(
                    lambda m, a, out, layer=layer: senders.attn.__setitem__(
                        layer, _stream(keep(get_item(out, 0)), senders.shape()))))  # fmt: skip
            handles.append(graph.mlp_out[layer].register_forward_hook(
                lambda m, a, out, layer=layer: senders.mlp.__setitem__(
                    layer, _stream(keep(get_item(out, 0)), senders.shape()))))  # fmt: skip
    if change is not None:
        for r, module in enumerate(graph.reads):

            def read(m: nn.Module, args: Any, kwargs: Any, r: int = r) -> Any:
                holder, at = input_at(args, kwargs, 0, 0)
                new = change(r, holder[at])
                if new is None:
                    return None
                return with_input(args, kwargs, at, new)

            handles.append(module.register_forward_pre_hook(read, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
