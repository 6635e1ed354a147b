"""docs/training.md's LoRA recipe (``kind: lora``): trained with transformers.Trainer and
SurgeryTrainerCallback(save_added={path, format: peft}), equal to PEFT's LoRA trained the same way, bit for bit; the
adapter it writes loads in ``PeftModel.from_pretrained`` and back with ``init: {from: DIR}`` to PEFT's logits.
scripts/setup installs peft, so this runs in the suite."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from safetensors.torch import load_file

import surgery

transformers = pytest.importorskip("transformers")

R, ALPHA = 2, 4
SITES = "transformer.h.*.attn.c_attn"


def lora_recipe(start: Path | None = None) -> dict[str, Any]:
    """The recipe of docs/training.md: freeze the model, then a LoRA (from a PEFT adapter directory if given)."""
    lora = {"kind": "lora", "select": SITES, **({"init": {"from": str(start)}} if start else {"r": R, "alpha": ALPHA})}
    return {"freeze": {"kind": "freeze", "param": "*"}, "lora": lora}


def gpt2() -> Any:
    from tests.lm_helpers import tiny_gpt2

    return tiny_gpt2(20, 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def train(model: Any, tmp_path: Path, callbacks: list) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 20, (8, 6), generator=g)
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, train_sampling_strategy="sequential",
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks).train()


def test_the_lora_recipe_trains_saves_and_loads_back_equal_to_peft(tmp_path: Path) -> None:
    from surgery.integrations.hf import SurgeryTrainerCallback

    base = gpt2()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    theirs = peft.get_peft_model(theirs, config)
    theirs.save_pretrained(tmp_path / "start")  # PEFT's random A and zero B, so both start equal

    saved = tmp_path / "trained"
    callback = SurgeryTrainerCallback(lora_recipe(tmp_path / "start"), save_added={"path": saved, "format": "peft"})
    train(ours, tmp_path / "ours", [callback])
    train(theirs, tmp_path / "theirs", [])
    adapter = load_file(saved / "adapter_model.safetensors")
    for i, layer in enumerate(theirs.base_model.model.transformer.h):
        site = layer.attn.c_attn
        key = f"base_model.model.transformer.h.{i}.attn.c_attn"
        assert torch.equal(adapter[f"{key}.lora_A.weight"], site.lora_A["default"].weight)
        assert torch.equal(adapter[f"{key}.lora_B.weight"], site.lora_B["default"].weight)
        assert not torch.equal(site.lora_B["default"].weight, torch.zeros_like(site.lora_B["default"].weight))
    assert torch.equal(ours.transformer.wte.weight, base.transformer.wte.weight)  # frozen, and the model restored
    assert not any("lora" in name for name, _ in ours.named_parameters())

    ids = torch.randint(2, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), saved)(input_ids=ids).logits
        # PEFT computes with the tensors as read from the file, whose alignment may change float results on some CPUs
        torch.testing.assert_close(loaded, expected, atol=1e-6, rtol=0)
        with surgery.apply(ours, lora_recipe(saved)):
            assert torch.equal(ours(ids).logits, expected)
