"""Two actions on one module: the contract is that both apply, in plan order (docs/behaviour.md).

Hooks fire in registration order, apply passes run in plan order, so a later action sees what
an earlier one made; removing the surgery undoes both. Only a true clash (two tensors of one
name) is refused, at plan time (``same_name_added_twice`` in the corpus).
"""

from __future__ import annotations

import torch
from torch import nn

import surgery
from tests.conftest import Snapshot


def linear() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2))


X = torch.tensor([[1.0, -2.0]])


def test_two_replace_forwards_the_later_one_wins() -> None:
    model = linear()
    before, plain = Snapshot.of(model), model(X).detach()
    actions = {
        "first": {"kind": "replace_forward", "select": "0", "fn": "identity"},
        "second": {"kind": "replace_forward", "select": "0", "expr": "output * 10"},
    }
    with surgery.apply(model, actions):
        # the second sees the first's result as `output`: identity(x) * 10
        assert torch.equal(model(X), X * 10)
    before.assert_same(model)
    assert torch.equal(model(X), plain)


def test_replace_forward_then_modify_output_modifies_the_replacement() -> None:
    model = linear()
    actions = {
        "zero": {"kind": "replace_forward", "select": "0", "fn": "zero"},
        "plus": {"kind": "modify_output", "select": "0", "op": "add", "value": 3},
    }
    with surgery.apply(model, actions):
        assert torch.equal(model(X), torch.full((1, 2), 3.0))


def test_modify_input_twice_runs_in_plan_order() -> None:
    model = nn.Sequential(nn.Identity())
    actions = {
        "double": {"kind": "modify_input", "select": "0", "op": "mul", "value": 2},
        "plus_one": {"kind": "modify_input", "select": "0", "op": "add", "value": 1},
    }
    with surgery.apply(model, actions):
        assert torch.equal(model(X), X * 2 + 1)


def test_capture_sees_what_the_actions_before_it_made() -> None:
    model = nn.Sequential(nn.Identity())
    actions = {
        "before": {"kind": "capture", "select": "0"},
        "double": {"kind": "modify_output", "select": "0", "op": "mul", "value": 2},
        "after": {"kind": "capture", "select": "0"},
    }
    with surgery.apply(model, actions) as s:
        model(X)
    assert torch.equal(s.captures["before"]["0"].output, X)
    assert torch.equal(s.captures["after"]["0"].output, X * 2)


def test_modify_grad_twice_runs_in_plan_order_on_modules_and_parameters() -> None:
    model = linear()
    x = X.clone().requires_grad_(True)
    model(x).sum().backward()
    plain_input, plain_weight = x.grad.clone(), model[0].weight.grad.clone()
    x.grad = None
    model.zero_grad()
    actions = {
        "double": {"kind": "modify_grad", "select": "0", "op": "mul", "value": 2},
        "plus_one": {"kind": "modify_grad", "select": "0", "op": "add", "value": 1},
        "w_double": {"kind": "modify_grad", "select": "0", "param": "weight", "op": "mul", "value": 2},
        "w_plus_one": {"kind": "modify_grad", "select": "0", "param": "weight", "op": "add", "value": 1},
    }
    with surgery.apply(model, actions):
        model(x).sum().backward()
    assert torch.allclose(x.grad, plain_input * 2 + 1)
    assert torch.allclose(model[0].weight.grad, plain_weight * 2 + 1)


def test_init_twice_the_later_value_stays_and_remove_restores_the_original() -> None:
    model = linear()
    before = Snapshot.of(model)
    actions = {
        "ones": {"kind": "init", "select": "0", "param": "weight", "method": "ones"},
        "twos": {"kind": "init", "select": "0", "param": "weight", "method": "constant", "value": 2.0},
    }
    with surgery.apply(model, actions):
        assert torch.equal(model[0].weight, torch.full((2, 2), 2.0))
    before.assert_same(model)


def test_freeze_then_unfreeze_ends_unfrozen_and_remove_restores_each_flag() -> None:
    model = linear()
    model[0].bias.requires_grad_(False)
    before = Snapshot.of(model)
    actions = {
        "freeze": {"kind": "freeze", "select": "0"},
        "unfreeze": {"kind": "unfreeze", "select": "0", "param": "weight"},
    }
    with surgery.apply(model, actions):
        assert model[0].weight.requires_grad and not model[0].bias.requires_grad
    before.assert_same(model)


def test_replace_module_twice_replaces_the_replacement_and_remove_puts_the_original_back() -> None:
    model = linear()
    original = model[0]
    actions = {
        "gelu": {"kind": "replace_module", "select": "0", "with": {"_target_": "torch.nn.GELU"}},
        "tanh": {"kind": "replace_module", "select": "0", "with": {"_target_": "torch.nn.Tanh"}},
    }
    with surgery.apply(model, actions):
        assert isinstance(model[0], nn.Tanh)
    assert model[0] is original


def test_an_action_uses_what_an_earlier_one_added() -> None:
    model = linear()
    before = Snapshot.of(model)
    actions = {
        "add": {"kind": "add_parameter", "select": "0", "name": "gate", "shape": [2]},
        "fill": {"kind": "init", "select": "0", "param": "gate", "method": "constant", "value": 0.5},
        "use": {"kind": "modify_output", "select": "0", "op": "expr", "expr": "output * module.gate"},
    }
    with surgery.apply(model, actions):
        assert torch.allclose(model(X), linear()(X) * 0.5)
    before.assert_same(model)
    assert not hasattr(model[0], "gate")
