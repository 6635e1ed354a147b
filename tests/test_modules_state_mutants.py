"""replace_module and on_load, pinned where the mutation run found nothing watching.

replace_module: the new module takes the old one's dtype, device and mode (a bias-free Linear has one
tensor to take them from), the plan table names it, a stale plan names the module it failed on.
on_load: which tensors are forgiven (root-level ones too, none with ignore_added: false), the hooks counted
for the on_load action in every order, and the errors of a failing hook or registration word for word.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError
from tests.conftest import Snapshot

LINEAR_3_4 = {"_target_": "torch.nn.Linear", "in_features": 3, "out_features": 4, "bias": False}
SWAP = {"swap": {"kind": "replace_module", "select": "0", "with": LINEAR_3_4}}


def net() -> nn.Sequential:
    """A seeded bias-free Linear, a ReLU and a Linear: the first has exactly one tensor."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4, bias=False), nn.ReLU(), nn.Linear(4, 2))


# ---------------------------------------------------------------- replace_module


def test_the_new_module_takes_the_old_ones_dtype_and_mode_and_remove_puts_the_old_one_back() -> None:
    model = net().double().eval()
    old, before = model[0], Snapshot.of(model)
    x = torch.randn(5, 3, dtype=torch.float64)
    with surgery.apply(model, SWAP):
        new = model[0]
        assert type(new) is nn.Linear and new is not old and new.bias is None
        assert new.weight.dtype == torch.float64 and not new.training
        got = model(x)
    assert torch.equal(got, model[2](torch.relu(x @ new.weight.T)))
    assert model[0] is old
    before.assert_same(model)


def test_the_new_module_takes_the_old_ones_device() -> None:
    model = net().to("meta")
    with surgery.apply(model, SWAP):
        assert model[0].weight.device == torch.device("meta")
    assert model[0].weight.device == torch.device("meta")


def test_the_plan_table_names_both_kinds() -> None:
    actions = {
        **SWAP,
        "add": {"kind": "add_parameter", "select": "2", "name": "g", "shape": [2]},
        "load": {"kind": "on_load", "rename": {"old.*": "2.*"}},
    }
    plan = surgery.plan(net(), actions)
    assert str(plan).splitlines() == [
        "action  kind            mechanism        n  matched",
        "-" * 51,
        "swap    replace_module  apply pass       1  0",
        "add     add_parameter   apply pass       1  2.g",
        "load    on_load         state-dict hook  1  <root>",
    ]
    assert [(s["action"], s["kind"], s["mechanism"], s["matched"]) for s in plan.to_dict()] == [
        ("swap", "replace_module", "apply pass", ["0"]),
        ("add", "add_parameter", "apply pass", ["2"]),
        ("load", "on_load", "state-dict hook", ["<root>"]),
    ]


class Block(nn.Module):
    """Named children (a Sequential renumbers its children when one is deleted)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(3, 4), nn.ReLU()


def test_a_plan_whose_module_is_gone_names_the_module_it_failed_on() -> None:
    model = Block()
    tanh = {"_target_": "torch.nn.Tanh"}
    plan = surgery.plan(model, {"swap": {"kind": "replace_module", "select": "act", "with": tanh}})
    del model.act  # the model changed after the plan was compiled
    before = Snapshot.of(model)
    with pytest.raises(ActionError) as info:
        surgery.apply(model, plan)
    assert str(info.value) == (
        "actions.swap: failed on 'act': KeyError: \"Block has no child module 'act'\". Nothing was changed."
    )
    before.assert_same(model)


# ---------------------------------------------------------------- on_load


def checkpoint(model: nn.Module) -> dict[str, torch.Tensor]:
    """Fresh values for every entry of the model's state dict (what a saved original model holds)."""
    return {k: torch.randn_like(v) for k, v in model.state_dict().items()}


def test_a_tensor_added_to_the_root_is_forgiven() -> None:
    model = net()
    ckpt, before = checkpoint(model), Snapshot.of(model)
    actions = {
        "add": {"kind": "add_parameter", "select": "<root>", "name": "g", "shape": [2]},
        "load": {"kind": "on_load"},
    }
    with surgery.apply(model, actions) as s:
        result = s.load_state_dict(ckpt, strict=True)
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ckpt.items())
        assert torch.equal(model.g, torch.zeros(2))
    before.assert_same(model)


def test_ignore_added_false_leaves_the_added_tensor_missing_as_plain_pytorch_does() -> None:
    model = net()
    ckpt = checkpoint(model)
    plain = net()
    plain[2].register_parameter("g", nn.Parameter(torch.zeros(2)))
    with pytest.raises(RuntimeError) as expected:
        plain.load_state_dict(ckpt, strict=True)
    actions = {
        "add": {"kind": "add_parameter", "select": "2", "name": "g", "shape": [2]},
        "load": {"kind": "on_load", "rename": {"old.*": "2.*"}, "ignore_added": False},
    }
    with surgery.apply(model, actions) as s:
        with pytest.raises(RuntimeError) as got:
            s.load_state_dict(ckpt, strict=True)
    assert str(got.value) == str(expected.value)
    assert 'Missing key(s) in state_dict: "2.g"' in str(got.value)


ADD: dict[str, Any] = {"kind": "add_parameter", "select": "0", "name": "g", "shape": [4]}


@pytest.mark.parametrize(
    ("actions", "hooks"),
    [
        ({"add": ADD, "load": {"kind": "on_load"}}, {"load": 1}),  # the post-hook only
        ({"load": {"kind": "on_load"}, "add": ADD}, {"load": 1}),
        ({"add": ADD, "load": {"kind": "on_load", "rename": {"old.*": "0.*"}}}, {"load": 2}),  # pre and post
        ({"load": {"kind": "on_load", "rename": {"old.*": "0.*"}, "ignore_added": False}, "add": ADD}, {"load": 1}),
    ],
)
def test_the_hooks_are_counted_for_the_on_load_action(actions: dict[str, Any], hooks: dict[str, int]) -> None:
    model = net()
    with surgery.apply(model, actions) as s:
        assert s.hook_count == hooks


def test_a_failing_rename_hook_names_the_action_and_the_module() -> None:
    model = net()
    ckpt: dict[Any, torch.Tensor] = {0: torch.zeros(1), **checkpoint(model)}  # a key that is no string
    with surgery.apply(model, {"load": {"kind": "on_load", "rename": {"old.*": "0.*"}}}):
        with pytest.raises(ActionError) as info:
            model.load_state_dict(ckpt)
    assert (
        str(info.value) == "actions.load on module '<root>': AttributeError: 'int' object has no attribute 'startswith'"
    )
    assert isinstance(info.value.__cause__, AttributeError)


@pytest.mark.parametrize(
    ("register", "select", "where"),
    [("register_load_state_dict_pre_hook", "2", "2"), ("register_load_state_dict_post_hook", "<root>", "<root>")],
)
def test_a_failing_registration_names_the_module(
    register: str, select: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: nn.Module, hook: Any) -> None:
        raise RuntimeError("cannot hook")

    model = net()
    actions = {"add": ADD, "load": {"kind": "on_load", "select": select, "rename": {"old": "w"}}}
    plan, before = surgery.plan(model, actions), Snapshot.of(model)
    monkeypatch.setattr(nn.Module, register, refuse)  # as a torch call that fails would
    with pytest.raises(ActionError) as info:
        surgery.apply(model, plan)
    monkeypatch.undo()
    assert str(info.value) == f"actions.load: failed on {where!r}: RuntimeError: cannot hook. Nothing was changed."
    before.assert_same(model)
