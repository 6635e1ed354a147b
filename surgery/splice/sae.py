"""Running a loaded SAE: ``encode`` and ``decode``, in SAELens's order of operations (so results match it bit for bit).

encode: cast to the SAE's dtype, normalize (``normalize_activations``), subtract ``b_dec`` (``apply_b_dec_to_input``),
``x @ W_enc + b_enc``, then the activation: ReLU; JumpReLU ``relu(h) * (h > relu(threshold))`` (transcoders compare
with the threshold itself); TopK keeps the k largest (ReLU'd) pre-activations. decode: ``f @ W_dec + b_dec``, then
undo the normalization (not for transcoders), plus ``x @ W_skip.T`` for skip transcoders.
"""

from __future__ import annotations

from typing import Any

import torch

from surgery.splice.formats import SpliceWeights

LN_EPS = 1e-5  # SAELens's layer_norm normalization


def normalize_in(w: SpliceWeights, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``x`` normalized as ``normalize_activations`` says, and what ``normalize_out`` needs to undo it."""
    if w.normalize == "constant_norm_rescale":
        coeff = (w.d_in**0.5) / x.norm(dim=-1, keepdim=True)
        return x * coeff, coeff
    if w.normalize == "layer_norm":
        mu = x.mean(dim=-1, keepdim=True)
        x = x - mu
        std = x.std(dim=-1, keepdim=True)
        return x / (std + LN_EPS), (mu, std)
    return x, None  # none, and expected_average_only_in as SAELens loads it from disk (nothing at run time)


def normalize_out(w: SpliceWeights, y: torch.Tensor, state: Any) -> torch.Tensor:
    """Undo ``normalize_in`` on a reconstruction (SAEs only: a transcoder writes another site)."""
    if state is None or w.transcoder:
        return y
    if w.normalize == "constant_norm_rescale":
        return y / state
    mu, std = state
    return y * std + mu


def encode(w: SpliceWeights, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Feature activations of ``x`` ([..., d_in] -> [..., d_sae]) and the normalization state for ``decode``."""
    sae_in = x.to(w.W_enc.dtype)
    sae_in, state = normalize_in(w, sae_in)
    if w.apply_b_dec_to_input:
        sae_in = sae_in - w.b_dec
    hidden_pre = sae_in @ w.W_enc + w.b_enc
    if w.activation == "relu":
        return torch.relu(hidden_pre), state
    if w.activation == "jumprelu":
        assert w.threshold is not None
        threshold = w.threshold.relu() if w.jump_relu_of_threshold else w.threshold
        return torch.relu(hidden_pre) * (hidden_pre > threshold).to(hidden_pre.dtype), state
    if w.rescale_acts_by_decoder_norm:
        hidden_pre = hidden_pre * w.W_dec.norm(dim=-1)
    values, indices = torch.topk(hidden_pre, k=int(w.k or 0), dim=-1, sorted=False)
    acts = torch.zeros_like(hidden_pre)
    acts.scatter_(-1, indices, values.relu())
    return acts, state


def decode(w: SpliceWeights, acts: torch.Tensor, state: Any, x: torch.Tensor | None = None) -> torch.Tensor:
    """The reconstruction of features ``acts`` ([..., d_sae] -> [..., d_out]); ``x`` for a skip transcoder."""
    if w.activation == "topk" and w.rescale_acts_by_decoder_norm:
        acts = acts * (1 / w.W_dec.norm(dim=-1))
    out = normalize_out(w, acts @ w.W_dec + w.b_dec, state)
    if w.W_skip is not None and x is not None:
        out = out + x.to(w.W_enc.dtype) @ w.W_skip.T
    return out
