"""All-or-nothing apply, errors from hooks, and exact removal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError
from tests.conftest import Snapshot, TinyNet


class Exploding(nn.Module):
    """A module whose attribute access fails, to break an apply pass half way."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))


def test_a_failing_step_undoes_every_earlier_step(tiny: TinyNet, monkeypatch: pytest.MonkeyPatch) -> None:
    before = Snapshot.of(tiny)
    actions = {
        "w": {"kind": "init", "select": "conv", "param": "weight", "method": "zeros"},
        "p": {"kind": "add_parameter", "select": "fc", "name": "gate", "shape": [3]},
        "cap": {"kind": "capture", "type": ["Conv2d", "Linear"]},
        "boom": {"kind": "add_buffer", "select": "norm", "name": "extra", "shape": [2]},
    }
    plan = surgery.plan(tiny, actions)

    def fail(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(nn.Module, "register_buffer", fail)
    with pytest.raises(ActionError, match=r"actions\.boom: failed on 'norm': RuntimeError: disk on fire\. Nothing"):
        surgery.apply(tiny, plan)
    monkeypatch.undo()
    before.assert_same(tiny)
    assert not hasattr(tiny.fc, "gate")


def test_a_hook_that_raises_names_action_and_module_and_stays_removable(tiny: TinyNet, x_img) -> None:
    before = Snapshot.of(tiny)
    s = surgery.apply(tiny, {"bad": {"kind": "replace_forward", "select": "pool", "expr": "x.reshape(7, 5)"}})
    with pytest.raises(ActionError, match=r"actions\.bad\.expr on module 'pool': 'x\.reshape\(7, 5\)' failed: shape"):
        tiny(x_img)
    s.remove()
    before.assert_same(tiny)


def test_remove_is_idempotent_and_restores_changed_weights_bit_for_bit(tiny: TinyNet) -> None:
    tiny.conv.weight.data[0, 0, 0, 0] = float("nan")  # NaN must survive the round trip too
    before = Snapshot.of(tiny)
    s = surgery.apply(tiny, {"w": {"kind": "init", "param": "*", "method": "normal"}})
    assert not torch.isnan(tiny.conv.weight).any()
    s.remove()
    s.remove()
    after = Snapshot.of(tiny)
    assert torch.isnan(after.state["conv.weight"][0, 0, 0, 0])
    nan_free = {k: torch.nan_to_num(v) for k, v in before.state.items()}
    assert all(torch.equal(torch.nan_to_num(after.state[k]), v) for k, v in nan_free.items())


def test_actions_on_one_module_run_in_plan_order() -> None:
    model = nn.Sequential(nn.Identity())
    actions = {
        "double": {"kind": "modify_output", "select": "0", "op": "mul", "value": 2},
        "plus_one": {"kind": "modify_output", "select": "0", "op": "add", "value": 1},
    }
    with surgery.apply(model, actions):
        assert model(torch.tensor([3.0])).item() == 7.0  # (3 * 2) + 1


def test_wrapped_models_use_the_same_recipe(tiny: TinyNet, x_img) -> None:
    class DistributedDataParallel(nn.Module):  # named like DDP: its `module.` prefix is ignored
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    wrapped = DistributedDataParallel(tiny)
    plan = surgery.plan(wrapped, {"c": {"kind": "capture", "select": "conv"}})
    assert plan.to_dict()[0]["matched"] == ["conv"] and plan.to_dict()[0]["matched_real"] == ["module.conv"]
    assert "conv [module.conv]" in str(plan)
    with surgery.apply(wrapped, plan) as s:
        wrapped(x_img)
    assert s.captures["c"]["conv"].output.shape == (2, 4, 6, 6)


def test_plan_accepts_a_name_a_yaml_path_a_dict_and_a_dictconfig(tmp_path, functions) -> None:
    from omegaconf import OmegaConf

    from surgery.core.paths import config_dir

    as_dict = dict(OmegaConf.to_container(OmegaConf.load(config_dir() / "actions" / "function_linear.yaml")))
    path = tmp_path / "mine.yaml"
    path.write_text(OmegaConf.to_yaml(as_dict))
    tables = {
        str(surgery.plan(functions, source))
        for source in ("function_linear", str(path), path, as_dict, OmegaConf.create(as_dict))
    }
    assert len(tables) == 1
    assert "linear  replace_forward  forward hook  4  ab.a, ab.b, cd.c, cd.d" in tables.pop()


def test_plan_warns_about_overlaps_in_order_and_a_partly_matched_repeated_structure() -> None:
    from surgery.models.mlp import MLP

    model = MLP(depth=12)
    plan = surgery.plan(
        model,
        {
            "first": {"kind": "capture", "select": "layers.[0-9].fc"},  # the classic miss: 10 and 11
            "second": {"kind": "modify_output", "select": "layers.0.fc", "op": "mul", "value": 2},
            "chosen": {"kind": "capture", "select": "layers.[01].act"},  # 2 of 12: clearly deliberate
        },
    )
    assert plan.warnings == [
        "layers.0.fc: first → second (hooks run in this order)",
        "actions.first: matches 10 of the 12 modules like 'layers.*.fc'; not layers.10.fc, layers.11.fc. Intended?",
    ]
    assert str(plan).endswith("not layers.10.fc, layers.11.fc. Intended?")
    assert surgery.plan(model, {"all": {"kind": "capture", "select": "layers.*.fc"}}).warnings == []


def test_partial_structure_warning_sees_number_segments_at_the_top_and_ignores_digits_inside_names() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)], nn.Sequential(nn.Linear(2, 2)))
    model.add_module("x1", nn.Linear(2, 2))  # 'x1' is not a number segment: its own family of one
    plan = surgery.plan(model, {"a": {"kind": "capture", "select": "[0-9]", "type": "Linear"}})
    assert plan.warnings == ["actions.a: matches 10 of the 12 modules like '*'; not 10, 11. Intended?"]


def test_surgery_on_a_compiled_model_warns_and_a_reset_makes_it_count(tiny: TinyNet, x_img) -> None:
    from surgery.errors import CompiledModelWarning

    compiled = torch.compile(tiny, backend="aot_eager")
    before = compiled(x_img)
    action = {"z": {"kind": "modify_output", "select": "fc", "op": "zero"}}
    with pytest.warns(CompiledModelWarning, match="ignores this change"):
        s = surgery.apply(compiled, action)
    stale = compiled(x_img)  # torch silently keeps the graph compiled without the hook
    torch._dynamo.reset()
    fresh = compiled(x_img)
    with pytest.warns(CompiledModelWarning):
        s.remove()
    torch._dynamo.reset()
    assert torch.equal(stale, before) and torch.equal(fresh, torch.zeros_like(fresh))
    assert torch.equal(compiled(x_img), before)


def test_no_warning_on_a_plain_model(tiny: TinyNet, recwarn: pytest.WarningsRecorder) -> None:
    with surgery.apply(tiny, "linearize"):
        pass
    assert not [w for w in recwarn if "torch.compile" in str(w.message)]


@pytest.mark.parametrize("expr", ["x * 2 + 1", "x * module.weight + module.bias"])
def test_expressions_under_torch_compile_equal_eager(expr: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    with surgery.apply(model, {"r": {"kind": "replace_forward", "type": "LayerNorm", "expr": expr}}):
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")(x)
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)
