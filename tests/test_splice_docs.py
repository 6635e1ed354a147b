"""Every YAML block of docs/splices.md plans and runs on the built-in tiny GPT-2, with the SAE directories it names
written here (SAELens format), and its Python blocks' names exist (tests/test_doc_names.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import surgery
from surgery.models.hf import gpt2_tiny
from tests.splice_helpers import sae_tensors, write_saelens

DOC = Path(__file__).resolve().parents[1] / "docs" / "splices.md"
BLOCKS = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def in_sae_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_saelens(tmp_path / "my_sae", sae_tensors(32, 64))
    for i in range(2):
        write_saelens(tmp_path / "saes" / f"transformer.h.{i}", sae_tensors(32, 64, seed=i))
    write_saelens(tmp_path / "transcoder", sae_tensors(32, 64, seed=9), architecture="transcoder", d_out=32,
                  apply_b_dec_to_input=False)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("block", BLOCKS, ids=[b.split(":")[0] for b in BLOCKS])
def test_each_documented_splice_runs(block: str, in_sae_dir: Path) -> None:
    config: dict[str, Any] = yaml.safe_load(block)
    model = gpt2_tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    if "study" in config:
        grid = {"feature": "0:3"}  # the documented grid, shorter
        result = surgery.study(model, config["actions"], grid, ids, [{"logit": {"token": 3}}])
        assert result.values["logit"].shape == (3, 2)
        return
    with torch.no_grad(), surgery.apply(model, config, example_inputs=(ids,)) as s:
        model(ids)
        for action, node in config.items():
            if node.get("capture"):
                assert s.captures[action]
