"""A model's computational graph as senders, receivers and the edges between them (SPEC §21).

The residual stream of a pre-norm decoder is a sum: every branch's input is the embedding plus the outputs
of the branches before it. A *sender* is one term of that sum: ``embed`` (the stream entering block 0,
position embeddings included), ``attn.L`` (what block L's attention writes to the stream), ``head.L.H``
(head H's share of it: its slice of the attention's output projection) or ``mlp.L``. A *receiver* is one
branch's private copy of the stream: ``attn.L`` (``@attn_in``), ``mlp.L`` (``@mlp_in``) or ``logits``
(``@unembed_in``). An edge joins a sender to every receiver after it; with a parallel residual (GPT-NeoX)
block L's MLP reads the block input, so ``attn.L -> mlp.L`` is no edge.

Edges are numbered receiver by receiver, senders in model order inside each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from surgery.arch.sites import site_map
from surgery.errors import ConfigError

NODES = ("blocks", "heads")
FAMILIES = ("gpt2", "gpt_neox", "opt", "llama", "gemma2")  # pre-norm decoders (docs/architectures.md)
NO_HEAD_SLICE = {
    "gemma2": "Gemma2/3 norm the attention's output after its projection (post_attention_layernorm), so a head's"
    " share of what reaches the stream is not a slice of the projection"
}


@dataclass(frozen=True)
class Node:
    """One sender or receiver: its name (``attn.3``, ``head.1.2``), kind, block and head, and its place in order."""

    name: str
    kind: str  # embed | attn | head | mlp | logits
    layer: int  # -1 for embed; the number of blocks for logits
    head: int | None = None
    stage: int = 0  # senders: where they write; receivers: they read every sender of a smaller stage


@dataclass
class Graph:
    """The senders, receivers and edges of one model, and the modules each node is read or changed at."""

    family: str
    nodes: str  # blocks | heads
    senders: list[Node]
    receivers: list[Node]
    sender: torch.Tensor  # [edges] the sender index of each edge
    receiver: torch.Tensor  # [edges] the receiver index of each edge
    embed_at: nn.Module  # block 0: its input hidden_states is the embed sender
    attn_out: list[nn.Module]  # per block: output item 0 is what the attention writes
    mlp_out: list[nn.Module]
    heads_at: list[nn.Module]  # per block: the output projection, whose input holds the heads side by side
    reads: list[nn.Module]  # per receiver: the norm whose input item 0 is the receiver's input
    heads: int = 0
    d_head: int = 0

    @property
    def layers(self) -> int:
        """How many blocks the model has."""
        return len(self.attn_out)

    @property
    def edges(self) -> list[tuple[str, str]]:
        """(sender, receiver) names of every edge, in edge order."""
        return [(self.senders[s].name, self.receivers[r].name)
                for s, r in zip(self.sender.tolist(), self.receiver.tolist(), strict=True)]  # fmt: skip

    def upstream(self) -> torch.Tensor:
        """``[receivers, senders]``: whether an edge joins them."""
        mask = torch.zeros(len(self.receivers), len(self.senders), dtype=torch.bool)
        mask[self.receiver, self.sender] = True
        return mask

    def head_weights(self, layer: int) -> torch.Tensor:
        """Block ``layer``'s projection as ``[heads, d_head, d_model]`` (no bias): head H writes ``z_H @ W[H]``."""
        return projection_matrix(self.heads_at[layer]).reshape(self.heads, self.d_head, -1)


def projection_matrix(module: nn.Module) -> torch.Tensor:
    """The ``[in, out]`` matrix of a linear projection (``nn.Linear``, or GPT-2's transposed ``Conv1D``)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor):
        return weight.t()
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        return weight
    raise ConfigError(f"study.nodes: heads: the attention's output projection is a {type(module).__name__}, not a"
                      " linear layer whose input slices into heads; use nodes: blocks")  # fmt: skip


def build_graph(model: nn.Module, nodes: str = "blocks") -> Graph:
    """The circuit graph of ``model`` with ``nodes`` (blocks or heads); refused for a family without one."""
    if nodes not in NODES:
        raise ConfigError(f"study.nodes: {nodes!r} is not one of {', '.join(NODES)}")
    sites = site_map(model)
    family = sites.family.split(":")[0]
    if family not in FAMILIES or len(sites.stacks) != 1:
        raise ConfigError(f"study.method: circuits need a pre-norm decoder ({', '.join(FAMILIES)}); this model is"
                          f" {sites.family}")  # fmt: skip
    for site in ("attn_in", "mlp_in", "unembed_in", "attn_out", "mlp_out"):
        if site in sites.absent:
            raise ConfigError(f"study.method: circuits read each branch's own input, and this model ({sites.family})"
                              f" has no @{site}: {sites.absent[site]}")  # fmt: skip
    if nodes == "heads" and (family in NO_HEAD_SLICE or "heads" in sites.absent):
        why = NO_HEAD_SLICE.get(family) or sites.absent["heads"]
        raise ConfigError(f"study.nodes: heads on {sites.family}: {why}; use nodes: blocks")
    get = model.get_submodule
    blocks = sites.names("blocks")
    layers = len(blocks)
    parallel = bool(getattr(get(blocks[0]), "use_parallel_residual", False))
    senders = [Node("embed", "embed", -1)]
    receivers: list[Node] = []
    for layer in range(layers):
        if nodes == "heads":
            senders += [Node(f"head.{layer}.{h}", "head", layer, h, 2 * layer + 1) for h in range(sites.heads or 0)]
        else:
            senders.append(Node(f"attn.{layer}", "attn", layer, None, 2 * layer + 1))
        senders.append(Node(f"mlp.{layer}", "mlp", layer, None, 2 * layer + 2))
        receivers.append(Node(f"attn.{layer}", "attn", layer, None, 2 * layer + 1))
        receivers.append(Node(f"mlp.{layer}", "mlp", layer, None, 2 * layer + (1 if parallel else 2)))
    receivers.append(Node("logits", "logits", layers, None, 2 * layers + 1))
    pairs = [(s, r) for r, got in enumerate(receivers) for s, gives in enumerate(senders) if gives.stage < got.stage]
    reads = [get(n) for pair in zip(sites.names("attn_in"), sites.names("mlp_in"), strict=True) for n in pair]
    graph = Graph(
        family=sites.family, nodes=nodes, senders=senders, receivers=receivers,
        sender=torch.tensor([s for s, _ in pairs]), receiver=torch.tensor([r for _, r in pairs]),
        embed_at=get(blocks[0]), attn_out=[get(n) for n in sites.names("attn_out")],
        mlp_out=[get(n) for n in sites.names("mlp_out")],
        heads_at=[get(n) for n in sites.names("heads")] if nodes == "heads" else [],
        reads=[*reads, get(sites.names("unembed_in")[0])], heads=sites.heads or 0, d_head=sites.d_head or 0,
    )  # fmt: skip
    if nodes == "heads":
        graph.head_weights(0)  # a projection that is no linear layer is refused here, before any pass
    return graph
