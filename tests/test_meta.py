"""Plans without weights: ``device=meta`` builds the model on the meta device; init and add_parameter apply there."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import surgery  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from surgery.models.hf import llama_meta  # noqa: E402
from tests.exact_runs import prepared  # noqa: E402

SMALL = ("model.num_hidden_layers=3", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=100")  # fmt: skip
SMALL_KW = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip


def test_plan_on_meta_never_materialises_weights() -> None:
    job = prepared(
        "+model=llama_meta", *SMALL, "mode=plan", "device=meta",
        '+actions.a={kind:modify_output,select:"model.layers.*.mlp",op:zero}',
        "+actions.b={kind:init,type:Linear,param:weight,method:normal}",
        "+actions.c={kind:modify_output,select:model.layers.1.mlp,op:set,value:1.0,index:'[:, 0]'}",
    )  # fmt: skip
    tensors = list(job.model.parameters()) + list(job.model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert job.inputs[0].is_meta and job.inputs[0].shape == (1, 16)
    by_name = {s["action"]: s for s in job.plan.to_dict()}
    assert len(by_name["a"]["matched"]) == 3
    assert len(by_name["b"]["tensors"]) == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head


def test_gpt2_built_on_meta_for_a_plan() -> None:
    job = prepared("+model=gpt2_tiny", "mode=plan", "device=meta", "+actions=ablate_mlp")
    assert all(p.is_meta for p in job.model.parameters())
    assert [s["matched"] for s in job.plan.to_dict()] == [["transformer.h.0.mlp", "transformer.h.1.mlp"]]


def test_modules_mode_on_meta_lists_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    from hydra import compose, initialize_config_dir

    from surgery.app.prepare import prepare
    from surgery.core.paths import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["+model=llama_meta", *SMALL, "mode=modules", "device=meta"])
    assert prepare(cfg) is None
    table = capsys.readouterr().out
    assert "model.layers.2.mlp.down_proj" in table and "weight[64, 128]" in table


def test_init_and_add_parameter_apply_on_meta_and_undo() -> None:
    model = llama_meta(**SMALL_KW)
    before = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    actions = {
        "i": {"kind": "init", "type": "Linear", "param": "weight", "method": "kaiming_normal"},
        "o": {"kind": "init", "select": "model.norm", "param": "weight", "method": "orthogonal", "allow_empty": True,
              "enabled": False},
        "g": {"kind": "add_parameter", "select": "model.layers.*.mlp", "name": "gate", "shape": [64],
              "init": {"method": "normal", "std": 0.1}},
    }  # fmt: skip
    surgery_ = surgery.apply(model, actions)
    for i in range(3):
        gate = model.get_submodule(f"model.layers.{i}.mlp").gate
        assert gate.is_meta and gate.shape == (64,) and gate.dtype == torch.float32
    assert all(p.is_meta for p in model.parameters())
    surgery_.remove()
    assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == before
    assert not hasattr(model.get_submodule("model.layers.0.mlp"), "gate")


def test_a_meta_model_is_refused_off_meta() -> None:
    with pytest.raises(ConfigError, match="builds on the meta device.*use device=meta with mode=plan"):
        prepared("+model=llama_meta", *SMALL, "mode=plan", "+actions=ablate_mlp")
