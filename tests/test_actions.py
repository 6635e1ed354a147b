"""Each kind computes the numbers a user would check by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.schema import INIT_METHODS
from tests.conftest import PairOut, TinyNet, run_both


def lin(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


# ---------------------------------------------------------------- init


@pytest.mark.parametrize("method", INIT_METHODS)
def test_every_init_method_fills_a_tensor_it_fits(method: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 3))  # 4-D weight: every method applies (dirac too)
    extra = {"value": 0.25} if method == "constant" else {}
    target = "weight"
    if method == "eye":
        model = nn.Sequential(nn.Linear(3, 3))
    with surgery.apply(model, {"i": {"kind": "init", "select": "0", "param": target, "method": method, **extra}}):
        w = model[0].weight.detach().clone()
    assert torch.isfinite(w).all()
    if method == "constant":
        assert torch.equal(w, torch.full_like(w, 0.25))
    if method == "ones":
        assert torch.equal(w, torch.ones_like(w))
    if method == "eye":
        assert torch.equal(w, torch.eye(3))


def test_init_is_seeded_and_matches_nn_init_with_the_same_generator() -> None:
    a, b = lin(1), lin(2)
    action = {"i": {"kind": "init", "select": "<root>", "param": "weight", "method": "normal", "std": 0.5}}
    with surgery.apply(a, action, seed=7):
        wa = a.weight.detach().clone()
    with surgery.apply(b, action, seed=7):
        wb = b.weight.detach().clone()
    assert torch.equal(wa, wb)
    with surgery.apply(b, action, seed=8):
        assert not torch.equal(b.weight, wa)
    from surgery.actions.base import generator_for

    expected = torch.empty(3, 4)
    nn.init.normal_(expected, 0.0, 0.5, generator=generator_for(7, "i", torch.device("cpu")))
    assert torch.equal(wa, expected)


def test_init_refuses_a_method_that_does_not_fit_before_touching_anything() -> None:
    model = lin()
    with pytest.raises(
        surgery.ConfigError,
        match=r"actions\.i\.method \(bias\): .*xavier_uniform.*2 or more dims, this one has shape \[3\]",
    ):
        surgery.plan(model, {"i": {"kind": "init", "select": "<root>", "param": "*", "method": "xavier_uniform"}})


def test_init_on_a_parameter_added_by_an_earlier_action() -> None:
    model = lin()
    actions = {
        "add": {"kind": "add_parameter", "select": "<root>", "name": "gate", "shape": [3]},
        "fill": {"kind": "init", "select": "<root>", "param": "gate", "method": "constant", "value": 2.0},
    }
    with surgery.apply(model, actions):
        assert torch.equal(model.gate, torch.full((3,), 2.0))
    assert not hasattr(model, "gate")


# ---------------------------------------------------------------- params


def test_add_parameter_like_takes_shape_dtype_and_trains() -> None:
    model = lin().double()
    with surgery.apply(model, {"p": {"kind": "add_parameter", "select": "<root>", "name": "w2", "like": "weight"}}):
        assert model.w2.shape == (3, 4) and model.w2.dtype == torch.float64
        assert isinstance(model.w2, nn.Parameter) and model.w2.requires_grad
        assert "w2" in dict(model.named_parameters())
        assert torch.equal(model.w2, torch.zeros(3, 4, dtype=torch.float64))  # init defaults to zeros
    assert "w2" not in dict(model.named_parameters())


def test_add_buffer_persistent_or_not() -> None:
    model = lin()
    actions = {
        "keep": {"kind": "add_buffer", "select": "<root>", "name": "kept", "shape": [2]},
        "drop": {"kind": "add_buffer", "select": "<root>", "name": "dropped", "shape": [2], "persistent": False},
    }
    with surgery.apply(model, actions):
        keys = set(model.state_dict())
        assert "kept" in keys and "dropped" not in keys and hasattr(model, "dropped")
    assert set(model.state_dict()) == {"weight", "bias"}


def test_freeze_stops_gradients_and_unfreeze_restores() -> None:
    model = nn.Sequential(lin(), nn.ReLU(), nn.Linear(3, 2))
    with surgery.apply(model, {"f": {"kind": "freeze", "select": "0", "param": "*"}}):
        model(torch.randn(5, 4)).sum().backward()
        assert model[0].weight.grad is None and model[2].weight.grad is not None
    assert model[0].weight.requires_grad


# ---------------------------------------------------------------- forward


def test_replace_forward_builtins() -> None:
    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]])
    model = nn.Sequential(nn.ReLU())
    with surgery.apply(model, {"r": {"kind": "replace_forward", "type": "ReLU", "fn": "identity"}}):
        assert torch.equal(model(x), x)
    with surgery.apply(model, {"r": {"kind": "replace_forward", "type": "ReLU", "fn": "zero"}}):
        assert torch.equal(model(x), torch.zeros_like(x))
    linear = lin()
    with surgery.apply(linear, {"r": {"kind": "replace_forward", "select": "<root>", "fn": "linear"}}):
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))


def test_replace_forward_on_an_inplace_module_sees_the_input_unchanged() -> None:
    x = torch.tensor([[-1.0, 2.0]])
    model = nn.Sequential(nn.Identity(), nn.ReLU(inplace=True))
    with surgery.apply(model, {"r": {"kind": "replace_forward", "type": "ReLU", "expr": "x * 10"}}):
        assert torch.equal(model(x.clone()), torch.tensor([[-10.0, 20.0]]))


@pytest.mark.parametrize(
    ("op", "extra", "expected"),
    [
        ("add", {"value": 1.5}, [[0.5, 3.5, -1.5, 5.5]]),
        ("mul", {"value": -2}, [[2.0, -4.0, 6.0, -8.0]]),
        ("set", {"value": 7}, [[7.0, 7.0, 7.0, 7.0]]),
        ("zero", {}, [[0.0, 0.0, 0.0, 0.0]]),
        ("clamp", {"min": -1, "max": 3}, [[-1.0, 2.0, -1.0, 3.0]]),
        ("clamp", {"max": 0}, [[-1.0, 0.0, -3.0, 0.0]]),
        ("mean_ablate", {"dim": 1}, [[0.5, 0.5, 0.5, 0.5]]),
        ("expr", {"expr": "output ** 2"}, [[1.0, 4.0, 9.0, 16.0]]),
        ("add", {"value": 100, "index": "[:, 1:3]"}, [[-1.0, 102.0, 97.0, 4.0]]),
    ],
)
def test_modify_output_ops(op: str, extra: dict, expected: list) -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]])
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "0", "op": op, **extra}}):
        assert torch.equal(model(x), torch.tensor(expected))


def test_noise_is_seeded_per_run() -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.zeros(1, 1000)
    action = {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 2.0}}
    with surgery.apply(model, action, seed=3):
        a = model(x)
    with surgery.apply(model, action, seed=3):
        b = model(x)
    assert torch.equal(a, b)
    assert 1.8 < a.std().item() < 2.2


def test_item_picks_a_tuple_element_and_a_plain_tensor_passes_through() -> None:
    torch.manual_seed(0)
    model = PairOut()
    x = torch.randn(2, 4)
    y, y2 = model(x)
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "<root>", "item": 1, "op": "zero"}}):
        a, b = model(x)
    assert torch.equal(a, y) and torch.equal(b, torch.zeros_like(y2))
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "lin", "item": 1, "op": "zero"}}):
        a, b = model(x)  # lin returns a plain tensor: item does not apply, the tensor is zeroed
    assert torch.equal(a, torch.zeros_like(y))


def test_modify_input_changes_what_forward_sees(functions, x12) -> None:
    x1, x2 = x12
    with surgery.apply(functions, {"m": {"kind": "modify_input", "select": "ab", "item": 1, "op": "set", "value": 0}}):
        out = functions(x1, x2)
    assert torch.equal(out, ((x1 + 2) + (0 - 1)) * 3 / 2)


# ---------------------------------------------------------------- capture, grads, log


def test_capture_records_every_call_in_order() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, shared)
    x = torch.randn(1, 2)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "0", "what": ["input", "output"]}}) as s:
        out = model(x)
    rec = s.captures["c"]["0"]
    assert len(rec.calls) == 2  # a shared module is called twice
    assert torch.equal(rec.calls[0].input[0], x)
    assert torch.equal(rec.output, out) and rec.calls[0].output is not rec.calls[1].output
    assert not rec.output.requires_grad


def test_modify_grad_on_module_grad_input_and_on_param_grad() -> None:
    model = lin()
    x = torch.randn(5, 4)

    def grads(actions: dict) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        xi = x.clone().requires_grad_(True)
        with surgery.apply(model, actions):
            model(xi).sum().backward()
        return xi.grad, model.weight.grad.clone()

    gx, gw = grads({})
    gx2, gw2 = grads({"g": {"kind": "modify_grad", "select": "<root>", "op": "mul", "value": 3}})
    assert torch.allclose(gx2, 3 * gx) and torch.equal(gw2, gw)  # grad_input scaled, weights untouched
    gx3, gw3 = grads(
        {"g": {"kind": "modify_grad", "select": "<root>", "param": "weight", "op": "clip_norm", "max_norm": 1.0}}
    )
    assert torch.equal(gx3, gx)
    assert torch.allclose(gw3, gw / (gw.norm() + 1e-6)) and gw3.norm() <= 1.0
    _, gw4 = grads(
        {"g": {"kind": "modify_grad", "select": "<root>", "param": "weight", "op": "clip_value", "value": 0.1}}
    )
    assert torch.equal(gw4, gw.clamp(-0.1, 0.1))


def test_capture_grad_matches_autograd(tiny: TinyNet, x_img: torch.Tensor) -> None:
    with surgery.apply(tiny, {"g": {"kind": "capture_grad", "select": "fc", "param": "weight"}}) as s:
        run_both(tiny, x_img)
    assert torch.equal(s.captures["g"]["fc.weight"].grad, tiny.fc.weight.grad)


def test_log_prints_name_shapes_and_stats(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(lin())
    with surgery.apply(model, {"show": {"kind": "log", "type": "Linear"}}):
        model(torch.ones(2, 4))
    line = capsys.readouterr().out.strip()
    assert line.startswith("[show] 0 (Linear): in ((2, 4) mean=1")
    assert "-> out (2, 3) mean=" in line


def test_disabled_action_is_planned_but_not_applied() -> None:
    model = nn.Sequential(nn.Identity())
    plan = surgery.plan(model, {"m": {"kind": "modify_output", "select": "0", "op": "zero", "enabled": False}})
    assert "(disabled)" in str(plan)
    with surgery.apply(model, plan) as s:
        assert torch.equal(model(torch.ones(1, 2)), torch.ones(1, 2))
        assert s.hook_count == {}
