"""capture_grad and modify_grad: what mutation testing found nothing watching.

Gradients are compared bit for bit with the same hook written in plain PyTorch on an identical model; refusals
and hook failures word for word; the plan table as printed; hooks counted per action.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError, NoMatchError
from tests.conftest import fully_shard_one_rank


class Pair(nn.Module):
    """Two inputs, two outputs, and a float attribute an expression can read as ``module.k``."""

    def __init__(self) -> None:
        super().__init__()
        self.k = 3.0

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * b, a + b


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.pair = nn.Linear(4, 3), nn.Linear(4, 3), Pair()
        self.l1.k = 0.5  # read by an expression on l1's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = self.pair(self.l1(x), self.l2(x))
        return (p * 2.0 + q * 5.0).sum()


def x_in() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 20).reshape(5, 4)


def grads(model: nn.Module, passes: int = 1) -> list[list[torch.Tensor]]:
    """The parameter gradients after each of ``passes`` forward+backward passes (zeroed between)."""
    out = []
    for _ in range(passes):
        model.zero_grad(set_to_none=True)
        model(x_in()).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(map(torch.equal, x, y)) for x, y in zip(a, b))


def by_hand(register: Callable[[Net], Any], passes: int = 1) -> list[list[torch.Tensor]]:
    """The same hook in plain PyTorch on an identical model."""
    model = Net()
    register(model)
    return grads(model, passes)


def with_surgery(recipe: dict[str, Any], passes: int = 1) -> list[list[torch.Tensor]]:
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with surgery.apply(model, recipe, verify=True):
        got = grads(model, passes)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model.pair._backward_hooks and not model.pair._backward_pre_hooks
    assert all(not p._backward_hooks for p in model.parameters())
    return got


# ---------------------------------------------------------------- modify_grad equals the plain hook


def test_modify_grad_item_changes_only_that_grad_input_with_the_module_it_hooks() -> None:
    recipe = {"g": {"kind": "modify_grad", "select": "pair", "item": 1, "op": "expr", "expr": "grad * module.k"}}
    want = by_hand(lambda m: m.pair.register_full_backward_hook(lambda mod, gi, go: (gi[0], gi[1] * mod.k)))
    assert same(with_surgery(recipe), want)
    assert not same(want, by_hand(lambda m: None))


def test_modify_grad_item_on_grad_output_changes_only_that_output_before_the_modules_backward() -> None:
    recipe = {
        "g": {"kind": "modify_grad", "select": "pair", "what": "grad_output", "item": 0, "op": "expr",
              "expr": "grad * module.k"}
    }  # fmt: skip
    want = by_hand(lambda m: m.pair.register_full_backward_pre_hook(lambda mod, go: (go[0] * mod.k, go[1])))
    assert same(with_surgery(recipe), want)


def test_modify_grad_on_a_parameter_hands_the_expression_its_module() -> None:
    recipe = {"g": {"kind": "modify_grad", "select": "l1", "param": "weight", "op": "expr", "expr": "grad * module.k"}}
    want = by_hand(lambda m: m.l1.weight.register_hook(lambda g: g * 0.5))
    assert same(with_surgery(recipe), want)


@pytest.mark.parametrize(
    ("action", "register"),
    [
        (
            {"select": "l1", "param": "weight", "op": "mul", "value": 0.0},
            lambda m, gate: m.l1.weight.register_hook(lambda g: g * 0.0 if gate() else g),
        ),
        (
            {"select": "pair", "op": "mul", "value": 0.0},
            lambda m, gate: m.pair.register_full_backward_hook(
                lambda mod, gi, go: tuple(g * 0.0 for g in gi) if gate() else gi
            ),
        ),
        (
            {"select": "pair", "what": "grad_output", "op": "mul", "value": 0.0},
            lambda m, gate: m.pair.register_full_backward_pre_hook(
                lambda mod, go: tuple(g * 0.0 for g in go) if gate() else go
            ),
        ),
    ],
    ids=["param", "grad_input", "grad_output"],
)
def test_modify_grad_calls_acts_on_the_selected_backward_call_only(action: dict[str, Any], register: Any) -> None:
    seen = [0]

    def second() -> bool:
        seen[0] += 1
        return seen[0] == 2

    want = by_hand(lambda m: register(m, second), passes=3)
    assert same(with_surgery({"g": {"kind": "modify_grad", "calls": [1], **action}}, passes=3), want)


# ---------------------------------------------------------------- capture_grad records what the plain hook sees


def test_capture_grad_calls_records_the_selected_backward_call_only() -> None:
    model = Net()
    recipe = {
        "p": {"kind": "capture_grad", "select": "l1", "param": "weight", "calls": [1]},
        "o": {"kind": "capture_grad", "select": "pair", "what": "grad_output", "calls": [1]},
        "i": {"kind": "capture_grad", "select": "pair", "calls": [1]},
    }
    with surgery.apply(model, recipe, verify=True) as s:
        per_pass = grads(model, passes=3)
        p, o, i = (s.captures[a][k].calls for a, k in (("p", "l1.weight"), ("o", "pair"), ("i", "pair")))
    assert (len(p), len(o), len(i)) == (1, 1, 1)
    assert torch.equal(p[0].grad, per_pass[1][0])
    assert torch.equal(o[0].grad_output[0], torch.full((5, 3), 2.0))
    assert torch.equal(i[0].grad_output[1], torch.full((5, 3), 5.0))


def test_capture_grad_keeps_none_for_an_input_that_needs_no_gradient() -> None:
    model = Net()
    with surgery.apply(model, {"c": {"kind": "capture_grad", "select": "l1"}}) as s:
        grads(model)
        (call,) = s.captures["c"]["l1"].calls
    assert call.grad_input == (None,)
    assert len(call.grad_output) == 1 and torch.equal(call.grad_output[0], 2.0 * model.l2(x_in()).detach() + 5.0)


def test_capture_grad_of_grad_output_hooks_every_selected_module() -> None:
    model = Net()
    with surgery.apply(model, {"c": {"kind": "capture_grad", "select": "l*", "what": "grad_output"}}) as s:
        grads(model)
        assert sorted(s.captures["c"]) == ["l1", "l2"]
        assert [len(s.captures["c"][k].calls) for k in ("l1", "l2")] == [1, 1]


def test_plot_marks_the_capture_for_plotting() -> None:
    model = Net()
    recipe = {
        "m": {"kind": "capture_grad", "select": "l1", "plot": True},
        "p": {"kind": "capture_grad", "select": "l1", "param": "weight", "plot": True},
        "n": {"kind": "capture_grad", "select": "l2"},
    }
    with surgery.apply(model, recipe) as s:
        assert s.plotted == {"m", "p"}


# ---------------------------------------------------------------- the plan, hook counts, refusals


def table(plan: surgery.Plan) -> list[str]:
    """The plan's rows without the rule under the header."""
    return [line.rstrip() for line in str(plan).splitlines() if set(line) != {"-"}]


RECIPE = {
    "c": {"kind": "capture_grad", "select": "l1", "what": "grad_output"},
    "i": {"kind": "capture_grad", "select": "l1", "what": "grad_input"},
    "b": {"kind": "capture_grad", "select": "l*"},
    "p": {"kind": "capture_grad", "select": "l*", "param": "*"},
    "d": {"kind": "modify_grad", "select": "pair", "op": "mul", "value": 1.0},
    "o": {"kind": "modify_grad", "select": "l*", "what": "grad_output", "op": "mul", "value": 1.0},
    "e": {"kind": "modify_grad", "select": "l*", "param": "weight", "op": "mul", "value": 1.0},
}


def test_the_plan_names_each_mechanism_and_what_it_matched() -> None:
    plan = surgery.plan(Net(), RECIPE)
    assert table(plan)[:8] == [
        "action  kind          mechanism               n  matched",
        "c       capture_grad  full backward pre-hook  1  l1",
        "i       capture_grad  full backward hook      1  l1",
        "b       capture_grad  full backward hook      2  l1, l2",
        "p       capture_grad  tensor hook             4  l1.weight, l1.bias, l2.weight, l2.bias",
        "d       modify_grad   full backward hook      1  pair",
        "o       modify_grad   full backward pre-hook  2  l1, l2",
        "e       modify_grad   tensor hook             2  l1.weight, l2.weight",
    ]
    rows = [(d["action"], d["kind"], d["matched"], d["tensors"]) for d in plan.to_dict()]
    assert rows == [
        ("c", "capture_grad", ["l1"], []),
        ("i", "capture_grad", ["l1"], []),
        ("b", "capture_grad", ["l1", "l2"], []),
        ("p", "capture_grad", ["l1", "l2"], ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]),
        ("d", "modify_grad", ["pair"], []),
        ("o", "modify_grad", ["l1", "l2"], []),
        ("e", "modify_grad", ["l1", "l2"], ["l1.weight", "l2.weight"]),
    ]
    assert [step.config.kind for step in plan.steps] == [a["kind"] for a in RECIPE.values()]


def test_hooks_are_counted_per_action() -> None:
    model = Net()
    with surgery.apply(model, RECIPE) as s:
        assert s.hook_count == {"c": 1, "i": 1, "b": 2, "p": 4, "d": 1, "o": 2, "e": 2}


def test_a_parameter_frozen_between_plan_and_apply_fails_naming_it_and_changes_nothing() -> None:
    model = Net()
    plan = surgery.plan(model, {"e": {"kind": "modify_grad", "select": "l*", "param": "*", "op": "zero"}})
    model.l2.bias.requires_grad_(False)
    with pytest.raises(ActionError) as info:
        surgery.apply(model, plan)
    assert str(info.value) == (
        "actions.e: failed on 'l2.bias': RuntimeError: cannot register a hook on a tensor that doesn't require"
        " gradient. Nothing was changed."
    )
    assert all(not p._backward_hooks for p in model.parameters())


def test_prepend_with_param_is_refused_for_capture_grad_word_for_word() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(Net(), {"a": {"kind": "capture_grad", "select": "l1", "param": "weight", "prepend": True}})
    assert str(info.value) == (
        "actions.a.prepend: a parameter's tensor hooks always run in the order registered; drop prepend when param"
        " is set"
    )


@pytest.mark.parametrize("kind", ["capture_grad", "modify_grad"])
def test_a_param_matching_nothing_is_refused_unless_allow_empty(kind: str) -> None:
    action = {"kind": kind, "select": "l1", "param": "nomatch", **({"op": "zero"} if kind == "modify_grad" else {})}
    with pytest.raises(NoMatchError) as info:
        surgery.plan(Net(), {"a": action})
    assert str(info.value) == (
        "actions.a.param: 'nomatch' matched no parameter of the 1 selected module(s). Closest parameter names: bias,"
        " weight. Set allow_empty: true if that is expected."
    )
    plan = surgery.plan(Net(), {"a": {**action, "allow_empty": True}})
    assert plan.to_dict()[0]["tensors"] == []


def test_safe_mode_refuses_a_gradient_fn_outside_the_allowlist() -> None:
    action = {"kind": "modify_grad", "select": "l1", "op": "fn", "fn": "torch.serialization:load"}
    with pytest.raises(ConfigError, match=r"^actions\.a\.fn: 'torch.serialization:load' is not on the safe-mode"):
        surgery.plan(Net(), {"a": action}, safe=True)


def test_gradient_noise_is_seeded_by_the_run_seed_and_the_action_name() -> None:
    def noisy(name: str, seed: int) -> list[list[torch.Tensor]]:
        model = Net()
        action = {"kind": "modify_grad", "select": "l1", "param": "weight", "op": "noise", "std": 1.0}
        with surgery.apply(model, {name: action}, seed=seed):
            return grads(model)

    first = noisy("a", 7)
    assert same(noisy("a", 7), first)
    assert not same(noisy("a", 8), first)
    assert not same(noisy("b", 7), first)


# ---------------------------------------------------------------- a hook that fails says where, word for word

FAILING = [
    ({"select": "pair", "op": "expr", "expr": "grad.reshape(7, 5)"}, "module 'pair'"),
    ({"select": "pair", "what": "grad_output", "op": "expr", "expr": "grad.reshape(7, 5)"}, "module 'pair'"),
    ({"select": "l1", "param": "weight", "op": "expr", "expr": "grad.reshape(7, 5)"}, "parameter 'l1.weight'"),
]


@pytest.mark.parametrize(("action", "where"), FAILING, ids=["grad_input", "grad_output", "param"])
def test_a_failing_gradient_op_names_the_action_key_and_place(action: dict[str, Any], where: str) -> None:
    model = Net()
    size = 12 if "param" in action else 15
    with surgery.apply(model, {"bad": {"kind": "modify_grad", **action}}), pytest.raises(ActionError) as info:
        grads(model)
    assert str(info.value) == (
        f"actions.bad.expr on {where}: 'grad.reshape(7, 5)' failed: shape '[7, 5]' is invalid for input of size {size}"
    )


@pytest.mark.parametrize(("action", "where"), FAILING, ids=["grad_input", "grad_output", "param"])
def test_a_gradient_op_failing_outside_an_expression_names_the_error_type(action: dict[str, Any], where: str) -> None:
    action = {**action, "op": "fn", "fn": "torch.linalg:cholesky"}
    del action["expr"]
    model = Net()
    with surgery.apply(model, {"bad": {"kind": "modify_grad", **action}}), pytest.raises(ActionError) as info:
        grads(model)
    assert str(info.value).startswith(f"actions.bad on {where}: ")
    assert "Error: " in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- FSDP2: the hook goes on the unsharded parameter


@pytest.fixture
def sharded(gloo_group: None) -> nn.Module:
    """Net under ``fully_shard`` (the root only) on a CPU mesh of one rank."""
    return fully_shard_one_rank(Net())


def test_gradient_hooks_on_an_fsdp2_model_see_and_change_the_whole_gradient(sharded: nn.Module) -> None:
    recipe = {
        "c": {"kind": "capture_grad", "select": "l1", "param": "weight"},
        "g": {"kind": "modify_grad", "select": "l2", "param": "weight", "op": "mul", "value": 0.0},
    }
    plain = Net()
    plain(x_in()).backward()
    with surgery.apply(sharded, recipe) as s:
        sharded(x_in()).backward()
        (call,) = s.captures["c"]["l1.weight"].calls
    assert torch.equal(call.grad, plain.l1.weight.grad)
    assert torch.equal(sharded.l2.weight.grad.full_tensor(), torch.zeros(3, 4))


@pytest.mark.parametrize("kind", ["capture_grad", "modify_grad"])
def test_a_module_with_an_old_style_backward_hook_fails_at_apply_naming_it_and_changes_nothing(kind: str) -> None:
    """PyTorch refuses a full backward hook next to ``register_backward_hook``; the first module's hook is undone."""
    model = Net()
    model.l2.register_backward_hook(lambda *a: None)
    action = {"kind": kind, "select": "l*", **({"op": "zero"} if kind == "modify_grad" else {})}
    with pytest.raises(ActionError) as info:
        surgery.apply(model, {"c": action})
    assert str(info.value) == (
        "actions.c: failed on 'l2': RuntimeError: Cannot use both regular backward hooks and full backward hooks on"
        " a single Module. Please use only one of them. Nothing was changed."
    )
    assert not model.l1._backward_hooks and model.l1._is_full_backward_hook is None
