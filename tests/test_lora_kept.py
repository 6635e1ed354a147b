"""docs/training.md's LoRA recipe: trained with transformers.Trainer and SurgeryTrainerCallback(save_added=...), saved,
loaded back with init: {from: {file}}; equal to PEFT's LoRA trained the same way, bit for bit (skipped where peft
is not installed: it installs with --no-deps beside torch 2.13)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import surgery

transformers = pytest.importorskip("transformers")

R, ALPHA = 2, 4
SITES = "transformer.h.*.attn.c_attn"


def lora_recipe(a_init: dict | None, added: str | None = None) -> dict[str, Any]:
    """The recipe of docs/training.md: freeze the model, add A [r, in] and B [out, r], add B(A(x)) * alpha / r."""
    a = {"from": {"file": added}} if added else {"from": {"file": a_init["file"]}} if a_init else {}
    b = {"from": {"file": added}} if added else {"method": "zeros"}
    return {
        "freeze": {"kind": "freeze", "param": "*"},
        "lora_A": {"kind": "add_parameter", "select": SITES, "name": "lora_A", **({} if a else {"shape": [R, 32]}),
                   "init": a or {"method": "kaiming_uniform", "a": 5**0.5}},
        "lora_B": {"kind": "add_parameter", "select": SITES, "name": "lora_B", **({} if added else {"shape": [96, R]}),
                   "init": b},
        "lora": {"kind": "replace_forward", "select": SITES,
                 "expr": f"output + linear(linear(x, module.lora_A), module.lora_B) * {ALPHA / R}"},
    }  # fmt: skip


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
    peft = pytest.importorskip("peft")
    from surgery.integrations.hf import SurgeryTrainerCallback

    base = gpt2()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    theirs = peft.get_peft_model(theirs, config)
    layers = theirs.base_model.model.transformer.h
    a_init = {f"transformer.h.{i}.attn.c_attn.lora_A": layer.attn.c_attn.lora_A["default"].weight.detach().clone()
              for i, layer in enumerate(layers)}  # fmt: skip
    save_file(a_init, str(tmp_path / "a_init.safetensors"))  # PEFT's random A, so both start equal

    added = tmp_path / "lora.safetensors"
    callback = SurgeryTrainerCallback(lora_recipe({"file": str(tmp_path / "a_init.safetensors")}), save_added=added)
    train(ours, tmp_path / "ours", [callback])
    train(theirs, tmp_path / "theirs", [])
    saved = load_file(str(added))
    for i, layer in enumerate(layers):
        site = layer.attn.c_attn
        assert torch.equal(saved[f"transformer.h.{i}.attn.c_attn.lora_A"], site.lora_A["default"].weight)
        assert torch.equal(saved[f"transformer.h.{i}.attn.c_attn.lora_B"], site.lora_B["default"].weight)
    assert torch.equal(ours.transformer.wte.weight, base.transformer.wte.weight)  # frozen, and the model restored

    ids = torch.randint(2, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), surgery.apply(ours, lora_recipe(None, added=str(added))):
        loaded = ours(ids).logits
    with torch.no_grad():
        assert torch.equal(loaded, theirs(input_ids=ids).logits)
