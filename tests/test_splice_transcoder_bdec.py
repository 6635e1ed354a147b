"""A plain .safetensors transcoder never subtracts b_dec from its input, as SAELens's transcoders (issue 39).

``read: input, at: output`` reads one side and writes the other: ``b_dec`` is the output's bias. Before, a
file whose input and output have the same width was treated as an SAE and ``b_dec`` was subtracted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import surgery


def test_a_same_width_transcoder_file_decodes_without_subtracting_b_dec(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    w = {"W_enc": torch.randn(4, 6), "b_enc": torch.randn(6), "W_dec": torch.randn(6, 4), "b_dec": torch.randn(4)}
    save_file(w, str(tmp_path / "tc.safetensors"))
    x = torch.randn(3, 4)
    action = {"tc": {"kind": "splice", "select": "0", "read": "input", "at": "output",
                     "module": {"path": str(tmp_path / "tc.safetensors")}}}  # fmt: skip
    with torch.no_grad(), surgery.apply(model, action):
        got = model(x)
    with torch.no_grad():
        by_hand = model[2](model[1](torch.relu(x @ w["W_enc"] + w["b_enc"]) @ w["W_dec"] + w["b_dec"]))
    assert torch.equal(got, by_hand)
    subtract = {"tc": {**action["tc"], "apply_b_dec_to_input": True}}  # asked for: still possible
    with torch.no_grad(), surgery.apply(model, subtract):
        asked = model(x)
    with torch.no_grad():
        want = model[2](model[1](torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) @ w["W_dec"] + w["b_dec"]))
    assert torch.equal(asked, want)
