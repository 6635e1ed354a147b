"""The ``study:`` block of a circuit study (SPEC §21): ``method: edges | eap | eap_ig``, checked before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

METHODS = ("edges", "eap", "eap_ig")  # a study block with one of these methods is a circuit study


@dataclass
class CircuitConfig:
    """``study:`` keys of a circuit study; metrics are required."""

    method: str = "eap"  # edges (exact edge patching) | eap (attribution) | eap_ig (integrated gradients, steps: N)
    nodes: str = "blocks"  # blocks: embed, attn.L, mlp.L, logits | heads: embed, head.L.H, mlp.L, logits
    metrics: Any = MISSING  # per-example metrics, as a study's: [{logit_diff: {correct, wrong}}, {prob: {token}}, ...]
    steps: Any = None  # eap_ig only: points from the main run's embeddings to the source's
    top_edges: Any = None  # a list of edge counts: each pruned circuit's faithfulness (null: none)
    verify_top: Any = None  # eap / eap_ig: the K top edges run exactly, with Pearson and Spearman
    batch_size: Any = None  # examples per forward (null: all)
    batch_cells: Any = "auto"  # edges sharing one forward by replicated rows (method: edges, verify_top)
    plot_top: int = 20  # edges drawn in plots/circuit.png
