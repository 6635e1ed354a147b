"""What every kind shares (surgery/actions/base.py), seen through the public API: exact refusals at plan time,
the plan's tensor names, the seeded generator rule, and the one-line error a failing hook raises."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError, NoMatchError, SurgeryError


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def x_of() -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(1))


def refusal(model: nn.Module, actions: dict[str, Any], error: type[Exception] = ConfigError) -> str:
    with pytest.raises(error) as caught:
        surgery.plan(model, actions)
    return str(caught.value)


# tensors_of: param names, globs, no match


def test_a_param_with_a_dot_is_refused_naming_the_select_and_param_to_use() -> None:
    got = refusal(Two(), {"i": {"kind": "init", "select": "a", "param": "x.lin.weight", "method": "zeros"}})
    assert got == (
        "actions.i.param: 'x.lin.weight': a tensor name has no '.'; pick the submodule with select"
        " (e.g. select: ...x.lin, param: weight)"
    )


def test_a_param_matching_nothing_lists_the_closest_names_or_none() -> None:
    got = refusal(Two(), {"i": {"kind": "init", "select": ["a", "b"], "param": "bia", "method": "zeros"}}, NoMatchError)
    assert got == (
        "actions.i.param: 'bia' matched no parameter of the 2 selected module(s). Closest parameter names: bias."
        " Set allow_empty: true if that is expected."
    )
    model = nn.Module()
    model.p = nn.Module()
    model.p.w_in, model.p.w_out = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    got = refusal(model, {"i": {"kind": "init", "select": "p", "param": "w", "method": "zeros"}}, NoMatchError)
    assert got == (
        "actions.i.param: 'w' matched no parameter of the 1 selected module(s). Closest parameter names: w_in, w_out."
        " Set allow_empty: true if that is expected."
    )
    got = refusal(Two(), {"i": {"kind": "init", "select": "act", "param": "weight", "method": "zeros"}}, NoMatchError)
    assert got == (
        "actions.i.param: 'weight' matched no parameter of the 1 selected module(s). Set allow_empty: true if that"
        " is expected."
    )


def test_a_bad_param_glob_names_the_key() -> None:
    got = refusal(Two(), {"i": {"kind": "init", "select": "a", "param": "[", "method": "zeros"}})
    assert got.startswith("actions.i.param: ")


def test_the_plan_lists_full_tensor_names() -> None:
    plan = surgery.plan(Two(), {"i": {"kind": "init", "select": ["a", "b"], "param": "weight", "method": "zeros"}})
    assert plan.to_dict()[0]["tensors"] == ["a.weight", "b.weight"]


# check_grad_hooks: a frozen parameter, even after an added one


def test_a_gradient_hook_on_a_frozen_parameter_is_refused_even_after_an_added_one() -> None:
    model = Two()
    model.b.weight.requires_grad_(False)
    actions = {
        "add": {"kind": "add_parameter", "select": "a", "name": "scale", "shape": [3]},
        "g": {"kind": "capture_grad", "select": ["a", "b"], "param": "*"},
    }
    got = refusal(model, actions)
    assert got == (
        "actions.g.param: b.weight does not have requires_grad (frozen by the model or an earlier action), so no"
        " gradient hook can be registered on it; unfreeze it first or leave it out"
    )


# check_module_reads: what an expression may read from module


def test_an_expression_may_read_parameters_buffers_and_numbers_and_every_name_is_checked() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3))
    model.eval()
    plan = surgery.plan(model, {"r": {"kind": "replace_forward", "select": "0", "expr": "x - module.running_mean"}})
    assert plan.to_dict()[0]["matched"] == ["0"]
    got = refusal(model, {"r": {"kind": "replace_forward", "select": "0", "expr": "x * module.eps + module.zz"}})
    assert got.startswith("actions.r.expr: module.zz: '0' (BatchNorm1d) has no parameter, buffer or number 'zz'.")
    assert got.endswith(" Its tensors: weight, bias, running_mean, running_var, num_batches_tracked")
    got = refusal(model, {"r": {"kind": "replace_forward", "select": "0", "expr": "x + module.bias + module.zz"}})
    assert got.startswith("actions.r.expr: module.zz: '0' (BatchNorm1d) has no parameter")
    got = refusal(nn.Sequential(nn.ReLU()), {"r": {"kind": "replace_forward", "select": "0", "expr": "x * module.w"}})
    assert got == "actions.r.expr: module.w: '0' (ReLU) has no parameter, buffer or number 'w'. Its tensors: none"


# generator_for: the documented rule, and meta tensors draw nothing


def test_a_seeded_init_draws_from_the_documented_generator() -> None:
    model = Two()
    with surgery.apply(model, {"i": {"kind": "init", "select": "a", "param": "weight", "method": "normal"}}, seed=7):
        got = model.a.weight.detach().clone()
    digest = hashlib.sha256(b"7/i").digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    assert torch.equal(got, torch.nn.init.normal_(torch.empty(3, 3), generator=gen))


def test_a_seeded_init_on_meta_tensors_needs_no_meta_generator() -> None:
    with torch.device("meta"):
        model = Two()
    with surgery.apply(model, {"i": {"kind": "init", "select": "a", "param": "weight", "method": "normal"}}):
        assert model.a.weight.device.type == "meta"


# hook_failed: one line naming the action (and key) and the module


def raising(error: Exception) -> Any:
    def fn(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        raise error

    return fn


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (RuntimeError(), "actions.c on module 'a': RuntimeError: "),
        (ValueError("  first: line\nsecond"), "actions.c on module 'a': ValueError: first: line"),
        (SurgeryError("oops: bad"), "actions.c on module 'a': oops: bad"),
        (SurgeryError("actions.c.item: bad"), "actions.c.item on module 'a': bad"),
        (SurgeryError("actions.c went wrong"), "actions.c on module 'a': actions.c went wrong"),
    ],
)
def test_a_failing_hook_raises_one_line_naming_the_action_and_module(error: Exception, message: str) -> None:
    model = Two()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "a", "fn": raising(error)}}):
        with pytest.raises(ActionError) as caught:
            model(x_of())
    assert str(caught.value) == message


def test_add_parameter_like_a_buffer_takes_the_buffers_shape_and_dtype() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3))
    with surgery.apply(model, {"p": {"kind": "add_parameter", "select": "0", "name": "s", "like": "running_var"}}):
        assert model[0].s.shape == (3,) and model[0].s.dtype == model[0].running_var.dtype
    assert not hasattr(model[0], "s")
