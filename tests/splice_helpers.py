"""Sparse autoencoders for the splice tests: written to disk by hand (SAELens's saved format or a plain file), and
the same SAEs run by hand in plain PyTorch, as a researcher would write the hook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def sae_tensors(d_in: int, d_sae: int, seed: int = 0, d_out: int | None = None, threshold: bool = False) -> dict:
    """Random SAE weights (some features active on typical inputs), float32."""
    g = torch.Generator().manual_seed(seed)
    d_out = d_in if d_out is None else d_out
    tensors = {
        "W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1,
        "W_dec": torch.randn(d_sae, d_out, generator=g) / d_sae**0.5,
        "b_dec": torch.randn(d_out, generator=g) * 0.1,
    }
    if threshold:
        tensors["threshold"] = torch.rand(d_sae, generator=g) * 0.3
    return tensors


def write_saelens(directory: Path, tensors: dict, **cfg: Any) -> Path:
    """A SAELens-format directory: cfg.json + sae_weights.safetensors (what SAE.save_model writes)."""
    directory.mkdir(parents=True, exist_ok=True)
    d_in, d_sae = tensors["W_enc"].shape
    config = {"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
              "apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none",
              "metadata": {"sae_lens_version": "6.5.0", "hook_name": "blocks.1.hook_resid_post"}, **cfg}  # fmt: skip
    (directory / "cfg.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "sae_weights.safetensors"))
    return directory


def write_plain(path: Path, tensors: dict) -> Path:
    """A plain .safetensors file with W_enc, b_enc, W_dec, b_dec (+ threshold)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def hand_encode(t: dict, x: torch.Tensor, arch: str = "standard", k: int | None = None, b_dec_in: bool = True,
                normalize: str = "none", rescale: bool = False) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """An SAE encoder written out by hand, in SAELens's order of operations."""
    state = None
    if normalize == "constant_norm_rescale":
        state = (x.shape[-1] ** 0.5) / x.norm(dim=-1, keepdim=True)
        x = x * state
    elif normalize == "layer_norm":
        mu = x.mean(dim=-1, keepdim=True)
        x = x - mu
        std = x.std(dim=-1, keepdim=True)
        x = x / (std + 1e-5)
        state = (mu, std)
    if b_dec_in:
        x = x - t["b_dec"]
    pre = x @ t["W_enc"] + t["b_enc"]
    if arch == "jumprelu":
        return torch.relu(pre) * (pre > t["threshold"].relu()).float(), state
    if arch == "topk":
        if rescale:
            pre = pre * t["W_dec"].norm(dim=-1)
        vals, idx = pre.topk(k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, idx, vals.relu()), state
    return torch.relu(pre), state


def hand_decode(t: dict, f: torch.Tensor, state: Any = None, normalize: str = "none", rescale: bool = False) -> Any:
    """The decoder, by hand."""
    if rescale:
        f = f * (1 / t["W_dec"].norm(dim=-1))
    y = f @ t["W_dec"] + t["b_dec"]
    if normalize == "constant_norm_rescale":
        y = y / state
    elif normalize == "layer_norm":
        y = y * state[1] + state[0]
    return y
