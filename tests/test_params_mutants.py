"""add_parameter, add_buffer, freeze and unfreeze: what mutation testing found nothing watching.

Each test states a user-visible promise: the plan's table, the exact refusal, the seeded values of a new
tensor (against ``nn.init`` with the same generator), where a new tensor lives, and the model after undo.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import surgery
from surgery.actions.base import generator_for
from surgery.errors import ActionError, ConfigError, NoMatchError
from tests.conftest import fully_shard_one_rank


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def table(plan: surgery.Plan) -> list[str]:
    """The plan's rows without the rule under the header."""
    return [line.rstrip() for line in str(plan).splitlines() if set(line) != {"-"}]


# ---------------------------------------------------------------- the plan says what each step adds or flips


def test_the_plan_table_and_dict_name_each_added_tensor_and_each_flipped_flag() -> None:
    model = mlp()
    plan = surgery.plan(
        model,
        {
            "a": {"kind": "add_parameter", "select": "0", "name": "g", "shape": [3]},
            "b": {"kind": "add_buffer", "select": "2", "name": "bb", "like": "weight"},
            "f": {"kind": "freeze", "select": "0", "param": "*"},
            "u": {"kind": "unfreeze", "select": "2", "param": "bias"},
        },
    )
    assert table(plan) == [
        "action  kind           mechanism   n  matched",
        "a       add_parameter  apply pass  1  0.g",
        "b       add_buffer     apply pass  1  2.bb",
        "f       freeze         apply pass  3  0.weight, 0.bias, 0.g",
        "u       unfreeze       apply pass  1  2.bias",
    ]
    rows = [(d["action"], d["kind"], d["mechanism"], d["matched"], d["tensors"]) for d in plan.to_dict()]
    assert rows == [
        ("a", "add_parameter", "apply pass", ["0"], ["0.g"]),
        ("b", "add_buffer", "apply pass", ["2"], ["2.bb"]),
        ("f", "freeze", "apply pass", ["0"], ["0.weight", "0.bias", "0.g"]),
        ("u", "unfreeze", "apply pass", ["2"], ["2.bias"]),
    ]
    with surgery.apply(model, plan) as s:
        assert [step.config.name for step in s.plan.steps[:2]] == ["g", "bb"]
        assert [step.config.param for step in s.plan.steps[2:]] == ["*", "bias"]
        assert model[2].bb.shape == (2, 3) and not model[0].g.requires_grad and model[2].bias.requires_grad
    assert not hasattr(model[0], "g") and not hasattr(model[2], "bb") and model[0].weight.requires_grad


# ---------------------------------------------------------------- refusals, word for word


def test_a_taken_name_is_refused_naming_the_module_and_its_class() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(mlp(), {"a": {"kind": "add_parameter", "select": "0", "name": "weight", "shape": [3]}})
    assert str(info.value) == (
        "actions.a.name: module '0' (Linear) already has an attribute 'weight'; choose another name"
    )


def test_an_init_that_does_not_fit_names_the_new_tensor() -> None:
    action = {"kind": "add_parameter", "select": "0", "name": "g", "shape": [3], "init": {"method": "xavier_uniform"}}
    with pytest.raises(ConfigError) as info:
        surgery.plan(mlp(), {"a": action})
    assert str(info.value) == (
        "actions.a.init.method (0.g): method 'xavier_uniform' needs a tensor of 2 or more dims, this one has shape"
        " [3]; use normal, uniform, constant, zeros or ones"
    )


def test_like_on_a_module_with_no_tensors_says_it_has_none() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(mlp(), {"a": {"kind": "add_parameter", "select": "1", "name": "g", "like": "weight"}})
    assert str(info.value) == "actions.a.like: module '1' has no parameter or buffer 'weight'; it has: none"


@pytest.fixture
def sharded(gloo_group: None) -> nn.Module:
    """A two-layer MLP under ``fully_shard`` (the root only) on a CPU mesh of one rank."""
    return fully_shard_one_rank(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))


def test_add_parameter_on_an_fsdp2_model_is_refused_word_for_word(sharded: nn.Module) -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(sharded, {"b": {"kind": "add_parameter", "select": "2", "name": "extra", "shape": [2]}})
    assert str(info.value) == (
        "actions.b: '2' is in a model sharded by FSDP2: a parameter added now is not one FSDP shards, gathers or"
        " reduces, so ranks would train it apart; add it before fully_shard"
    )


# ---------------------------------------------------------------- a tensor larger than the device's memory

PAGE = 1000  # a pretend machine with 1000 bytes of memory: os.sysconf is what the size check reads


def _tiny_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.sysconf
    fake = {"SC_PAGE_SIZE": PAGE, "SC_PHYS_PAGES": 1}
    monkeypatch.setattr(os, "sysconf", lambda name: fake[name] if name in fake else real(name))


@pytest.mark.parametrize(
    ("elements", "count", "size"),
    [
        (251, "251", "1004 B"),
        (256, "256", "1.0 KB"),
        (512, "512", "2.0 KB"),
        (384, "384", "1.5 KB"),
        (384 * 1024, "393,216", "1.5 MB"),
        (384 * 1024**2, "402,653,184", "1.5 GB"),
        (384 * 1024**3, "412,316,860,416", "1.5 TB"),
        (384 * 1024**4, "422,212,465,065,984", "1.5 PB"),
        (512 * 1024**5, "576,460,752,303,423,488", "2048.0 PB"),
    ],
)
def test_a_shape_larger_than_memory_is_refused_in_readable_units(
    monkeypatch: pytest.MonkeyPatch, elements: int, count: str, size: str
) -> None:
    _tiny_machine(monkeypatch)
    with pytest.raises(ConfigError) as info:
        surgery.plan(mlp(), {"a": {"kind": "add_parameter", "select": "0", "name": "g", "shape": [elements]}})
    assert str(info.value) == (
        f"actions.a.shape: [{elements}] is {count} elements of float32 ({size}), more than all the memory of cpu"
        " (1000 B); check the sizes"
    )


def test_a_shape_exactly_the_memory_size_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    _tiny_machine(monkeypatch)
    plan = surgery.plan(mlp(), {"a": {"kind": "add_buffer", "select": "0", "name": "g", "shape": [PAGE // 4]}})
    assert [d["tensors"] for d in plan.to_dict()] == [["0.g"]]


def test_memory_of_a_cuda_device_is_its_total_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: the CUDA query is what a CUDA model's size check reads, so it is faked with its argument checked."""
    from types import SimpleNamespace

    from surgery.actions.params import _memory_of

    asked: list[torch.device] = []
    fake = lambda device: asked.append(device) or SimpleNamespace(total_memory=12345.0)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake)
    assert _memory_of(torch.device("cuda", 1)) == 12345
    assert asked == [torch.device("cuda", 1)]
    assert _memory_of(torch.device("meta")) is None


# ---------------------------------------------------------------- where the new tensor lives and what it holds


def test_a_module_without_floating_tensors_takes_the_models_dtype() -> None:
    model = mlp().double()
    with surgery.apply(model, {"a": {"kind": "add_parameter", "select": "1", "name": "g", "shape": [3]}}):
        assert model[1].g.dtype == torch.float64 and torch.equal(model[1].g, torch.zeros(3, dtype=torch.float64))


def test_a_model_without_floating_tensors_gets_the_default_dtype_on_cpu() -> None:
    model = nn.Sequential(nn.ReLU())
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    with surgery.apply(model, {"a": {"kind": "add_parameter", "select": "0", "name": "g", "shape": [3]}}):
        g = model[0].g
        assert (g.dtype, g.device, g.requires_grad) == (torch.get_default_dtype(), torch.device("cpu"), True)
        assert torch.equal(g, torch.zeros(3))
    assert not hasattr(model[0], "g")


def test_a_meta_model_gets_a_meta_tensor() -> None:
    model = nn.Linear(4, 3, device="meta")
    action = {"kind": "add_parameter", "select": "<root>", "name": "g", "shape": [3], "init": {"method": "normal"}}
    with surgery.apply(model, {"a": action}):
        assert model.g.device == torch.device("meta") and model.g.shape == (3,)


def test_random_init_draws_from_the_actions_seeded_generator_module_after_module() -> None:
    model = mlp()
    action = {"kind": "add_parameter", "select": "*", "name": "g", "shape": [2, 3], "init": {"method": "normal"}}
    with surgery.apply(model, {"a": action}, seed=7):
        got = [model[i].g.detach().clone() for i in (0, 1, 2)]
    gen = generator_for(7, "a", torch.device("cpu"))
    want = [nn.init.normal_(torch.empty(2, 3), 0.0, 1.0, generator=gen) for _ in range(3)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with surgery.apply(model, {"a": action}, seed=8):
        assert not torch.equal(model[0].g, got[0])
    with surgery.apply(model, {"b": action}, seed=7):
        assert not torch.equal(model[0].g, got[0])


def test_add_parameter_with_requires_grad_false_does_not_train() -> None:
    model = mlp()
    action = {"kind": "add_parameter", "select": "0", "name": "g", "shape": [3], "requires_grad": False}
    with surgery.apply(model, {"a": action}):
        assert isinstance(model[0].g, nn.Parameter) and not model[0].g.requires_grad


def test_a_name_taken_between_plan_and_apply_fails_naming_the_module_and_changes_nothing() -> None:
    model = mlp()
    plan = surgery.plan(
        model,
        {
            "f": {"kind": "freeze", "select": "2", "param": "*"},
            "a": {"kind": "add_parameter", "select": "0", "name": "g", "shape": [3]},
        },
    )
    model[0].g = 5
    with pytest.raises(ActionError) as info:
        surgery.apply(model, plan)
    assert str(info.value) == (
        "actions.a: failed on '0': KeyError: \"attribute 'g' already exists\". Nothing was changed."
    )
    assert model[0].g == 5 and model[2].weight.requires_grad


# ---------------------------------------------------------------- freeze / unfreeze


def test_freeze_matching_nothing_is_refused_unless_allow_empty() -> None:
    action = {"kind": "freeze", "select": "1", "param": "*"}
    with pytest.raises(NoMatchError, match=r"^actions\.f\.param: '\*' matched no parameter of the 1 selected"):
        surgery.plan(mlp(), {"f": action})
    plan = surgery.plan(mlp(), {"f": {**action, "allow_empty": True}})
    assert table(plan)[1] == "f       freeze  apply pass  0  -"


def test_a_gradient_hook_on_a_parameter_unfrozen_by_an_earlier_action_is_planned() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    recipe = {
        "u": {"kind": "unfreeze", "select": "0", "param": "weight"},
        "g": {"kind": "modify_grad", "select": "0", "param": "weight", "op": "mul", "value": 2.0},
    }
    x = torch.randn(5, 4)
    with surgery.apply(model, recipe):
        model(x).sum().backward()
        got = model[0].weight.grad.clone()
    assert not model[0].weight.requires_grad
    ref = mlp()
    ref(x).sum().backward()
    assert torch.equal(got, ref[0].weight.grad * 2.0)
