"""Each kind computes the numbers a user would check by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.core.schema import INIT_METHODS
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


def noise_calls(x: torch.Tensor, calls: int = 3, seed: int = 3, name: str = "n", **extra: object) -> list:
    """The outputs of ``calls`` forwards of an identity with noise (std 2) on its output, in one apply."""
    model = nn.Sequential(nn.Identity())
    action = {name: {"kind": "modify_output", "select": "0", "op": "noise", "std": 2.0, **extra}}
    with surgery.apply(model, action, seed=seed):
        return [model(x) for _ in range(calls)]


def test_noise_is_seeded_per_run() -> None:
    x = torch.zeros(1, 1000)
    a, b = noise_calls(x), noise_calls(x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))  # every apply starts the stream from the seed again
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])  # new noise on every call
    assert not torch.equal(noise_calls(x, seed=4)[0], a[0])
    assert not torch.equal(noise_calls(x, name="m")[0], a[0])  # each action has its own stream
    assert 1.8 < a[0].std().item() < 2.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_noise_has_mean_zero_and_the_configured_std(dtype: torch.dtype) -> None:
    (out,) = noise_calls(torch.zeros(1000, 1000, dtype=dtype), calls=1)
    assert out.dtype == dtype
    values = out.double()
    assert abs(values.mean().item()) < 2e-3 * 2.0
    assert abs(values.std().item() - 2.0) < 3e-3 * 2.0
    assert abs((values**4).mean().item() / 2.0**4 - 3.0) < 0.03  # Gaussian tails, not just the right variance


def test_noise_on_an_index_slice_leaves_the_rest() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    a, b = noise_calls(x, calls=2, index="[:, 1:3]")
    for out in (a, b):
        assert torch.equal(out[:, [0, 3]], x[:, [0, 3]])
        assert not torch.isclose(out[:, 1:3], x[:, 1:3]).any()
    assert not torch.equal(a, b)
    assert torch.equal(noise_calls(x, calls=1, index="[:, 1:3]")[0], a)


def test_noise_refuses_an_integer_tensor() -> None:
    with pytest.raises(surgery.ActionError, match=r"actions\.n\.op on module '0': noise needs a floating-point"):
        noise_calls(torch.zeros(2, 3, dtype=torch.int64), calls=1)


def test_the_noise_hash_on_tensors_matches_python_ints() -> None:
    """Eager calls derive the per-call key in Python, compiled calls on a tensor: the bits must agree."""
    from surgery.actions.noise import mix_, mix_int

    values = [0, 1, 2**63 - 1, -(2**63), -1, 0x0123456789ABCDEF, -0x5555555555555555]
    assert mix_(torch.tensor(values, dtype=torch.int64)).tolist() == [mix_int(v) for v in values]


def test_noise_under_torch_compile_equals_eager_call_by_call_without_recompiling() -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    action = {"n": {"kind": "modify_output", "type": "Linear", "op": "noise", "std": 0.5}}
    with torch.no_grad():
        with surgery.apply(model, action):
            want = [model(x) for _ in range(5)]
        torch._dynamo.reset()
        counters.clear()
        with surgery.apply(model, action):
            try:
                compiled = torch.compile(model, backend="aot_eager")
                got = [compiled(x) for _ in range(4)]
                got.append(model(x))  # an eager call continues the same stream
                graphs = counters["stats"]["unique_graphs"]
            finally:
                torch._dynamo.reset()  # before removing: no compiled graph is left to ignore the removal
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert graphs == 1  # the call counter is a tensor: no recompile per call


def test_noise_applied_under_inference_mode_still_runs_outside_it() -> None:
    model = nn.Sequential(nn.Identity())
    with torch.inference_mode():
        s = surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 1.0}})
    try:
        a, b = model(torch.zeros(3)), model(torch.zeros(3))
    finally:
        s.remove()
    assert not torch.equal(a, b)


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
