"""Splices against SAELens itself: an SAE saved by SAELens's ``save_model`` and spliced by surgery gives exactly what
SAELens's own forward gives (skipped where ``sae-lens`` is not installed; it installs beside torch 2.13 CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import surgery

sae_lens = pytest.importorskip("sae_lens")

D, S = 16, 48


def saved(kind: str, directory: Path, **cfg: Any) -> Any:
    """A SAELens SAE of ``kind`` with random weights (a random threshold for JumpReLU), saved to ``directory``."""
    from sae_lens.saes.transcoder import Transcoder, TranscoderConfig

    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "transcoder": (Transcoder, TranscoderConfig),
    }
    cls, config = classes[kind]
    torch.manual_seed(0)
    sae = cls(config(d_in=D, d_sae=S, **cfg))
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name != "threshold" else 0.1))
        if kind == "jumprelu":
            sae.threshold.abs_()
    sae.save_model(directory)
    return sae.eval()


CASES = [
    ("standard", {}),
    ("standard", {"apply_b_dec_to_input": False}),
    ("standard", {"normalize_activations": "constant_norm_rescale"}),
    ("standard", {"normalize_activations": "layer_norm"}),
    ("jumprelu", {}),
    ("topk", {"k": 6}),
    ("topk", {"k": 6, "rescale_acts_by_decoder_norm": True}),
    ("transcoder", {"d_out": D, "apply_b_dec_to_input": False}),
]


@pytest.mark.parametrize(("kind", "cfg"), CASES, ids=[f"{k}-{'-'.join(c) or 'plain'}" for k, c in CASES])
def test_a_splice_equals_saelens_forward(tmp_path: Path, kind: str, cfg: dict) -> None:
    sae = saved(kind, tmp_path / "sae", **cfg)
    model = nn.Sequential(nn.Linear(D, D))
    x = torch.randn(3, 5, D)
    action = {"kind": "splice", "select": "0", "module": {"path": str(tmp_path / "sae")}, "capture": True}
    if kind == "transcoder":
        action["read"] = "input"
    with torch.no_grad(), surgery.apply(model, {"sae": action}) as s:
        got = model(x)
        features = s.captures["sae"]["0"].features
    with torch.no_grad():
        read = x if kind == "transcoder" else model(x)
        assert torch.equal(got, sae(read))
        assert torch.equal(features, sae.encode(read))


def test_error_term_and_a_feature_edit_equal_saelens_use_error_term(tmp_path: Path) -> None:
    sae = saved("jumprelu", tmp_path / "sae")
    with pytest.warns(DeprecationWarning):  # SAELens 6 prefers HookedSAETransformer.add_sae(..., use_error_term=True)
        sae.use_error_term = True
    sae.hook_sae_acts_post.register_forward_hook(lambda m, a, o: o.index_fill(-1, torch.tensor([1, 7]), 0.0))
    model = nn.Sequential(nn.Linear(D, D))
    x = torch.randn(3, 5, D)
    action = {"kind": "splice", "select": "0", "module": {"path": str(tmp_path / "sae")}, "error_term": True,
              "features": {"index": [1, 7], "op": "zero"}}  # fmt: skip
    with torch.no_grad(), surgery.apply(model, {"sae": action}):
        got = model(x)
    with torch.no_grad():
        assert torch.equal(got, sae(model(x)))
