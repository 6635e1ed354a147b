"""``kind: lora`` without PEFT itself: its checks, dropout, and the PEFT adapter directory it writes and reads
(``save_added(DIR, format="peft")``, ``init: {from: DIR}``), each refusal one line naming the key.
tests/test_lora_peft.py checks the same files against PEFT's own ``PeftModel``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import surgery
from surgery.errors import ConfigError


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


X = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))


def lora(**keys: Any) -> dict[str, Any]:
    return {"l": {"kind": "lora", "select": ["fc1", "fc2"], "r": 2, "alpha": 4, **keys}}


def randomized(s: surgery.Surgery) -> None:
    """B starts at zero: give it values so the adapter changes the output."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in s.added_state_dict().items():
            if name.endswith("lora_B"):
                tensor.copy_(torch.randn(tensor.shape, generator=g))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"r": None}, "actions.l.r: give the rank"),
        ({"alpha": None}, "actions.l.alpha: give alpha"),
        ({"r": 0}, "actions.l.r: the rank is a whole number >= 1"),
        ({"dropout": 1.0}, "actions.l.dropout: a probability in [0, 1)"),
        ({"select": "act"}, "actions.l.select: 'act' is a ReLU; lora adapts nn.Linear and transformers' Conv1D"),
        ({"init": {"from": 3}}, "actions.l.init.from: a PEFT adapter directory"),
    ],
)
def test_a_bad_lora_is_refused_naming_the_key(keys: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(mlp(), lora(**keys))
    assert str(info.value).startswith(message), str(info.value)


def test_two_loras_on_one_module_are_refused() -> None:
    recipe = {**lora(), "again": {"kind": "lora", "select": "fc1", "r": 1, "alpha": 1}}
    with pytest.raises(ConfigError, match=r"^actions.again.select: 'fc1' already has 'lora_A'"):
        surgery.plan(mlp(), recipe)


def test_dropout_acts_in_train_mode_only_as_f_dropout() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    with surgery.apply(model, lora(dropout=0.25)) as s:
        randomized(s)
        pairs = {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in (("fc1", model.fc1), ("fc2",
                 model.fc2))}  # fmt: skip
        for name, (a, b) in pairs.items():
            ref.get_submodule(name).register_forward_hook(
                lambda m, args, out, a=a, b=b: (
                    out + F.linear(F.linear(F.dropout(args[0], 0.25, m.training), a), b) * 2.0
                )
            )
        for train in (True, False):
            model.train(train)
            ref.train(train)
            torch.manual_seed(7)
            got = model(X)
            torch.manual_seed(7)
            assert torch.equal(got, ref(X))
        assert not torch.equal(model.train()(X), model.eval()(X))


def test_saved_as_peft_and_read_back_gives_the_same_output(tmp_path: Path) -> None:
    model = mlp()
    with surgery.apply(model, lora()) as s:
        randomized(s)
        expected = model(X).detach()
        s.save_added(tmp_path / "adapter", format="peft")
        added = {k: v.clone() for k, v in s.added_state_dict().items()}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                   "fan_in_fan_out", "bias", "task_type")} == {
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["fc1", "fc2"],
        "fan_in_fan_out": False, "bias": "none", "task_type": None}  # fmt: skip
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {k: torch.equal(v, added[k[len("base_model.model.") : -len(".weight")]]) for k, v in tensors.items()} == {
        f"base_model.model.{m}.{w}.weight": True for m in ("fc1", "fc2") for w in ("lora_A", "lora_B")
    }
    back = {"l": {"kind": "lora", "select": ["fc1", "fc2"], "init": {"from": str(tmp_path / "adapter")}}}
    with surgery.apply(model, back):
        assert torch.equal(model(X), expected)


def adapter(directory: Path, config: dict | None = None, tensors: dict | None = None) -> str:
    """A PEFT adapter directory written by hand: r 2, alpha 4 on fc1 and fc2, unless told otherwise."""
    directory.mkdir()
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["fc1", "fc2"]}
    (directory / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    shapes = {"fc1": (6, 8), "fc2": (8, 4)}
    made = {f"base_model.model.{m}.{w}.weight": torch.ones((2, i) if w == "lora_A" else (o, 2))
            for m, (i, o) in shapes.items() for w in ("lora_A", "lora_B")}  # fmt: skip
    save_file(
        {k: v for k, v in {**made, **(tensors or {})}.items() if v is not None}, directory / "adapter_model.safetensors"
    )
    return str(directory)


@pytest.mark.parametrize(
    ("config", "tensors", "keys", "message"),
    [
        ({}, {}, {"r": 3}, "actions.l.r: 3 contradicts the adapter"),
        (
            {"r": 3},
            {},
            {},
            "actions.l.init.from: base_model.model.fc1.lora_A.weight in {dir!r} has shape [2, 6], but"
            " 'fc1' at r=3 needs [3, 6]",
        ),
        (
            {},
            {"base_model.model.fc2.lora_A.weight": None},
            {},
            "actions.l.init.from: {dir!r} has no base_model.model.fc2.lora_A.weight for the selected",
        ),
        ({}, {}, {"select": "fc1"}, "actions.l.select: the adapter {dir!r} also adapts 'fc2'"),
        ({"use_dora": True}, {}, {}, "actions.l.init.from: {cfg!r} has use_dora True"),
        ({"peft_type": "IA3"}, {}, {}, "actions.l.init.from: {cfg!r} has peft_type 'IA3'"),
        ({}, {"base_model.model.fc1.lora_embedding_A": torch.ones(2)}, {}, "actions.l.init.from: {st!r} holds"),
        (
            {"rank_pattern": {"fc(1|2)": 3}},
            {},
            {},
            "actions.l.init.from: {cfg!r} has rank_pattern key 'fc(1|2)', a regular expression kind: lora does not",
        ),
        (
            {"rank_pattern": {"fc2": 3}},
            {},
            {},
            "actions.l.init.from: base_model.model.fc2.lora_A.weight in {dir!r} has shape [2, 8], but 'fc2' at r=3",
        ),
        ({"alpha_pattern": {"fc2": 8}}, {}, {"alpha": 4}, "actions.l.alpha: 4.0 contradicts the adapter"),
    ],
    ids=["r", "shape", "missing", "unselected", "dora", "ia3", "other-key", "regex", "pattern-shape", "pattern-alpha"],
)
def test_an_adapter_that_does_not_fit_is_refused_in_one_line(
    tmp_path: Path, config: dict, tensors: dict, keys: dict, message: str
) -> None:
    path = adapter(tmp_path / "a", config, tensors)
    recipe = {"l": {"kind": "lora", "select": ["fc1", "fc2"], "init": {"from": path}, **keys}}
    with pytest.raises(ConfigError) as info:
        surgery.plan(mlp(), recipe)
    real = Path(path).resolve()
    expected = message.format(
        dir=path, cfg=str(real / "adapter_config.json"), st=str(real / "adapter_model.safetensors")
    )
    assert str(info.value).startswith(expected) and "\n" not in str(info.value), str(info.value)


def test_a_directory_without_the_adapter_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    recipe = {"l": {"kind": "lora", "select": "fc1", "init": {"from": str(tmp_path / "a")}}}
    with pytest.raises(ConfigError, match=r"^actions.l.init.from: .* has no adapter_config.json"):
        surgery.plan(mlp(), recipe)


def test_format_peft_refuses_what_an_adapter_cannot_hold(tmp_path: Path) -> None:
    model = mlp()
    with surgery.apply(model, {"b": {"kind": "add_parameter", "select": "fc1", "name": "s", "shape": [1]}}) as s:
        with pytest.raises(ConfigError, match=r"^save_added.format: peft writes kind: lora actions"):
            s.save_added(tmp_path / "a", format="peft")
        with pytest.raises(ConfigError, match=r"^save_added.format: unknown save_added format 'pef'. Did you mean"):
            s.save_added(tmp_path / "a", format="pef")
    two = {**lora(select="fc1"), "m": {"kind": "lora", "select": "fc2", "r": 2, "alpha": 4, "dropout": 0.1}}
    with surgery.apply(model, two) as s, pytest.raises(ConfigError, match=r"one lora_dropout, but these lora actions"):
        s.save_added(tmp_path / "a", format="peft")
    mixed = {**lora(select="fc1"), "b": {"kind": "add_parameter", "select": "fc1", "name": "s", "shape": [1]}}
    with surgery.apply(model, mixed) as s, pytest.raises(ConfigError, match=r"the recipe adds 'fc1.s' too"):
        s.save_added(tmp_path / "a", format="peft")
    assert not (tmp_path / "a").exists()


def test_the_training_callbacks_check_save_added_when_made() -> None:
    from surgery.integrations.training import TrainingSurgery

    for bad, message in [
        ({"path": "x", "format": "pef"}, "Cb.save_added.format: unknown save_added format 'pef'"),
        ({"path": "x", "fmt": "peft"}, "Cb.save_added.fmt: unknown key"),
        ({"format": "peft"}, "Cb.save_added.path: a file or directory"),
        (3, "Cb.save_added: a path"),
    ]:
        with pytest.raises(ConfigError) as info:
            TrainingSurgery("capture", "Cb", bad)
        assert str(info.value).startswith(message), str(info.value)
    assert TrainingSurgery("capture", "Cb", {"path": "d", "format": "peft"}).save_added == ("d", "peft")
