"""``kind: lora`` against PEFT itself, on GPT-2 (``Conv1D``) and a Llama (``nn.Linear``): an adapter saved with
``save_added(DIR, format="peft")`` loads in ``PeftModel.from_pretrained`` to the same logits, and an adapter PEFT saved
loads with ``init: {from: DIR}`` to PEFT's logits, bit for bit (the same operations in the same order; PEFT's own
load within 1e-6: it computes with the tensors as read from the file).
scripts/setup installs peft (``pip install 'surgery[compare]'``), so these run in the suite."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

import surgery
from tests.arch_zoo import build

SITES = {
    "gpt2": ["transformer.h.*.attn.c_attn", "transformer.h.*.*.c_proj"],  # PEFT's c_proj: attn.c_proj and mlp.c_proj
    "llama": ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.v_proj", "model.layers.*.mlp.down_proj"],
}
PEFT_TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "v_proj", "down_proj"]}  # fmt: skip
IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module]:
    return request.param, build(request.param)


def randomize_b(tensors: Any) -> None:
    """B starts at zero (both here and in PEFT): random values make the adapter count."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, tensor in tensors:
            if "lora_B" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.1)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_saved_with_format_peft_loads_in_peft_to_the_same_logits(family: Any, tmp_path: Path) -> None:
    name, base = family
    model = copy.deepcopy(base)
    recipe = {"lora": {"kind": "lora", "select": SITES[name], "r": 2, "alpha": 4, "dropout": 0.1}}
    with surgery.apply(model, recipe) as s:
        randomize_b(s.added_state_dict().items())
        ours = logits(model)
        s.save_added(tmp_path / "adapter", format="peft")
    assert not torch.equal(ours, logits(base))  # the adapter changes the logits, and left the model as it was
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    assert theirs.peft_config["default"].lora_dropout == 0.1 and theirs.peft_config["default"].task_type == "CAUSAL_LM"
    # PEFT computes with the tensors as it read them from the file, whose alignment may change float results on some
    # CPUs: within 1e-6 (surgery reads into owned copies: bit for bit in the next test)
    torch.testing.assert_close(logits(theirs), ours, atol=1e-6, rtol=0)


def loaded_from_peft(family: Any, directory: Path, **config: Any) -> dict[str, dict[str, Any]]:
    """PEFT's adapter of ``config`` (B random) saved, then read with ``init: {from}``: the same logits bit for bit;
    each module's settings as the recipe read them."""
    name, base = family
    config = {"target_modules": PEFT_TARGETS[name], "fan_in_fan_out": name == "gpt2", **config}
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config)).eval()
    randomize_b(theirs.named_parameters())
    theirs.save_pretrained(directory)
    model = copy.deepcopy(base)
    recipe = {"lora": {"kind": "lora", "select": SITES[name], "init": {"from": str(directory)}}}
    with surgery.apply(model, recipe) as s:
        assert torch.equal(logits(model), logits(theirs))
        return dict(s.plan.steps[0].live)


def test_an_adapter_peft_saved_loads_with_init_from(family: Any, tmp_path: Path) -> None:
    live = loaded_from_peft(family, tmp_path / "peft", r=3, lora_alpha=5, lora_dropout=0.05)
    assert {(s["r"], s["dropout"]) for s in live.values()} == {(3, 0.05)}


def test_loras_of_different_ranks_save_as_one_adapter_with_patterns(family: Any, tmp_path: Path) -> None:
    """The most common (r, alpha) is the adapter's; the other modules go to rank_pattern / alpha_pattern."""
    name, base = family
    first, *rest = SITES[name]
    model = copy.deepcopy(base)
    recipe = {"wide": {"kind": "lora", "select": first, "r": 4, "alpha": 3},
              "thin": {"kind": "lora", "select": rest, "r": 2, "alpha": 4}}  # fmt: skip
    with surgery.apply(model, recipe) as s:
        randomize_b(s.added_state_dict().items())
        ours = logits(model)
        s.save_added(tmp_path / "adapter", format="peft")
        wide = [t.name for t in s.plan.steps[0].targets]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (2, 4)
    assert config["rank_pattern"] == {re.escape(m): 4 for m in wide} and set(config["alpha_pattern"].values()) == {3}
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(theirs), ours, atol=1e-6, rtol=0)


def test_an_adapter_with_patterns_peft_saved_loads_with_init_from(family: Any, tmp_path: Path) -> None:
    first = PEFT_TARGETS[family[0]][0]  # its modules: r 4 and alpha 7 by a pattern keyed by the name's end
    live = loaded_from_peft(family, tmp_path / "peft", r=2, lora_alpha=3, rank_pattern={first: 4},
                            alpha_pattern={first: 7})  # fmt: skip
    ranks = {module: (s["r"], s["alpha"]) for module, s in live.items()}
    assert {v for m, v in ranks.items() if m.endswith("." + first)} == {(4, 7.0)}
    assert {v for m, v in ranks.items() if not m.endswith("." + first)} == {(2, 3.0)}
