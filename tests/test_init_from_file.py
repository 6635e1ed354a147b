"""Tensors from files fill added and existing parameters (``init: {from: {file, key}}``, ``from: {file, key}``), and
trained add-ons are kept: ``Surgery.added_state_dict``/``save_added`` round-trip through ``init.from``; the training
callbacks write ``save_added`` before removing the surgery (also when the fit is interrupted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import surgery
from surgery.core.tensors import is_owned
from surgery.errors import ConfigError
from tests.conftest import Snapshot


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


LORA = {  # a LoRA on both Linears: down (zeros-initialised B, as PEFT) and up, as surgery actions
    "lora_A": {"kind": "add_parameter", "type": "Linear", "name": "lora_A", "shape": [2, 1],
               "init": {"method": "normal", "std": 0.1}},
    "lora_B": {"kind": "add_parameter", "type": "Linear", "name": "lora_B", "shape": [1, 1],
               "init": {"method": "zeros"}},
}  # fmt: skip


def test_add_parameter_from_a_file_is_an_owned_copy_checked_at_plan_time(tmp_path: Path) -> None:
    model = mlp()
    value = torch.randn(6, 4)
    save_file({"0.delta": value, "other": torch.ones(3)}, str(tmp_path / "t.safetensors"))
    recipe = {"d": {"kind": "add_parameter", "select": "0", "name": "delta",
                    "init": {"from": {"file": str(tmp_path / "t.safetensors")}}}}  # fmt: skip
    plan = surgery.plan(model, recipe)
    for _ in range(2):  # a trained (changed) parameter never leaks into the next apply: each apply copies
        with surgery.apply(model, plan):
            delta = model[0].delta
            assert isinstance(delta, nn.Parameter) and torch.equal(delta, value) and is_owned(delta)
            with torch.no_grad():
                delta.add_(1.0)
    assert not hasattr(model[0], "delta")
    keyed = {"d": {**recipe["d"], "select": "*", "type": "Linear", "name": "w", "init": {"from": {
        "file": str(tmp_path / "t.safetensors"), "key": "{name}.delta"}}}}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        surgery.plan(model, keyed)
    assert str(info.value).startswith(
        f"actions.d.init.from.key: '2.delta' is not in {str(tmp_path / 't.safetensors')!r}."
    )


def test_init_from_a_file_equals_copying_the_weight_and_remove_restores(tmp_path: Path) -> None:
    model, ref = mlp(), mlp()
    before = Snapshot.of(model)
    w = torch.randn(3, 6)
    save_file({"head": w}, str(tmp_path / "w.safetensors"))
    recipe = {"w": {"kind": "init", "select": "2", "param": "weight",
                    "from": {"file": str(tmp_path / "w.safetensors"), "key": "head"}}}  # fmt: skip
    x = torch.randn(5, 4)
    with torch.no_grad():
        ref[2].weight.copy_(w)
        with surgery.apply(model, recipe):
            assert torch.equal(model(x), ref(x))
    before.assert_same(model)


@pytest.mark.parametrize(
    ("tensor", "recipe_extra", "message"),
    [
        (
            torch.randn(5, 4),
            {},
            "actions.d.init.from: the key for 0.delta in {f!r} has shape [5, 4], but the tensor it fills is [6, 4]",
        ),
        (
            torch.randn(6, 4, dtype=torch.float64),
            {},
            "actions.d.init.from: the key for 0.delta in {f!r} is float64, but"
            " the tensor it fills is float32; convert the file (no silent cast)",
        ),
        (
            torch.randn(6, 4),
            {"init": {"from": {"file": "F", "key": "nope"}}},
            "actions.d.init.from.key: 'nope' is not in {f!r}. Its keys: 0.delta",
        ),
        (
            torch.randn(6, 4),
            {"init": {"from": {"file": "F"}, "method": "zeros"}},
            "actions.d.init.method: the tensor comes from a file (from); drop method",
        ),
    ],
    ids=["shape", "dtype", "key", "both"],
)
def test_bad_files_are_refused_before_the_model_is_touched(tmp_path: Path, tensor, recipe_extra, message) -> None:
    model = mlp()
    before = Snapshot.of(model)
    f = str(tmp_path / "t.safetensors")
    save_file({"0.delta": tensor}, f)
    recipe: dict[str, Any] = {"kind": "add_parameter", "select": "0", "name": "delta", "shape": [6, 4],
                              "init": {"from": {"file": f}}}  # fmt: skip
    if "init" in recipe_extra:
        recipe["init"] = {k: ({**v, "file": f} if k == "from" else v) for k, v in recipe_extra["init"].items()}
    with pytest.raises(ConfigError) as info:
        surgery.plan(model, {"d": recipe})
    assert str(info.value) == message.format(f=f)
    before.assert_same(model)


def test_added_state_dict_and_save_added_round_trip_through_init_from(tmp_path: Path) -> None:
    model = mlp()
    x = torch.randn(5, 4)
    lora = {**LORA, "lora": {"kind": "replace_forward", "type": "Linear",
                             "expr": "linear(x, module.weight, module.bias) + (x[..., :2] @ module.lora_A @ module.lora_B).sum(-1, keepdim=True)"}}  # fmt: skip # noqa: E501
    with surgery.apply(model, lora) as s:
        with torch.no_grad():
            for m in (model[0], model[2]):
                m.lora_B.fill_(0.5)  # as if trained
        trained = model(x)
        added = s.added_state_dict()
        assert sorted(added) == ["0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"]
        s.save_added(tmp_path / "adapters" / "lora.safetensors")
    saved = load_file(str(tmp_path / "adapters" / "lora.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in added.items())
    back = {
        "lora_A": {"kind": "add_parameter", "type": "Linear", "name": "lora_A",
                   "init": {"from": {"file": str(tmp_path / "adapters" / "lora.safetensors")}}},
        "lora_B": {"kind": "add_parameter", "type": "Linear", "name": "lora_B",
                   "init": {"from": {"file": str(tmp_path / "adapters" / "lora.safetensors")}}},
        "lora": lora["lora"],
    }  # fmt: skip
    with surgery.apply(model, back):
        assert torch.equal(model(x), trained)


def test_the_trainer_callback_saves_added_tensors_before_removing(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from surgery.integrations.hf import SurgeryTrainerCallback
    from tests.test_integrations import RECIPE, HFRegressor, by_hand, hf_trainer

    model = HFRegressor()
    path = tmp_path / "added.safetensors"
    callback = SurgeryTrainerCallback(RECIPE, save_added=str(path))
    hf_trainer(tmp_path, model, [callback]).train()
    saved = load_file(str(path))
    assert list(saved) == ["net.2.extra"] and not hasattr(model.net[2], "extra")  # written, then removed
    assert torch.equal(saved["net.2.extra"], by_hand()["extra"].detach())  # the trained values
    with pytest.raises(ConfigError, match=r"SurgeryTrainerCallback.save_added: a path"):
        SurgeryTrainerCallback(RECIPE, save_added=3)


def test_an_interrupted_lightning_fit_still_saves_the_added_tensors(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from surgery.integrations.lightning import SurgeryCallback

    model = mlp()
    path = tmp_path / "added.safetensors"
    callback = SurgeryCallback(LORA, save_added=str(path))
    callback._run.apply(model)  # what setup does; then the fit is interrupted
    trainer = object()
    callback._trainer = trainer  # type: ignore[assignment]
    callback.on_exception(trainer, model, KeyboardInterrupt())  # type: ignore[arg-type]
    assert sorted(load_file(str(path))) == ["0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"]
    assert not hasattr(model[0], "lora_A")


def test_the_cli_refuses_a_key_missing_from_an_init_file_with_exit_2(tmp_path: Path) -> None:
    from tests.test_cli import cli

    save_file({"other": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    (tmp_path / "conf" / "actions").mkdir(parents=True)
    (tmp_path / "conf" / "actions" / "load.yaml").write_text(
        "w: {kind: init, select: head, param: weight, from: {file: w.safetensors}}\n"
    )
    result = cli("+model=mlp", "+actions=load", "--config-dir", str(tmp_path / "conf"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: actions.w.from.key: 'head.weight' (the default key: the filled tensor's full name) is not in"
        " 'w.safetensors'. Its keys: other"
    )
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").glob("*/*/report.json"))
