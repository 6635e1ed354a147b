"""The seeds' exercise, declared in YAML-shaped dicts and compared with the hand-written hooks."""

from __future__ import annotations

import torch
from torch import nn

import surgery
from surgery.models.functions import Functions
from tests.conftest import Snapshot


def test_capture_x1_x2_and_output_of_a_two_input_module(functions: Functions, x12) -> None:
    x1, x2 = x12
    answer: list[torch.Tensor] = []
    handles = [
        functions.ab.register_forward_pre_hook(lambda m, inputs: answer.extend(inputs)),
        functions.ab.register_forward_hook(lambda m, inputs, output: answer.append(output)),
    ]
    functions(x1, x2)
    for h in handles:
        h.remove()

    with surgery.apply(functions, {"cap": {"kind": "capture", "select": "ab", "what": ["input", "output"]}}) as s:
        functions(x1, x2)
    rec = s.captures["cap"]["ab"]
    assert len(rec.calls) == 1
    got = [*rec.input, rec.output]
    assert all(torch.equal(a, b) for a, b in zip(got, answer, strict=True))
    # by hand: a(x1) + b(x2) = (x1 + 2) + (x2 - 1)
    assert torch.equal(rec.output, torch.tensor([[5.0], [7.0]]))


def test_output_plus_five(functions: Functions, x12) -> None:
    hand = Functions()
    for m in hand.modules():
        if type(m).__name__.startswith("Function_"):
            m.register_forward_hook(lambda m, i, o: o + 5)
    expected = hand(*x12)
    with surgery.apply(functions, "add_five"):
        got = functions(*x12)
    assert torch.equal(got, expected)
    # by hand for x1=1, x2=3: a = 8, b = 7, c = 15*3+5 = 50, d = 50/2+5 = 30
    assert got[0].item() == 30.0


def test_grad_input_grad_output_and_w_grad(functions: Functions, x12) -> None:
    def backward(model: nn.Module) -> None:
        x1, x2 = (x.clone().requires_grad_(True) for x in x12)
        model(x1, x2).sum().backward()

    hand = Functions()
    answer: list[torch.Tensor] = []
    hand.ab.register_full_backward_hook(lambda m, gi, go: answer.extend([*gi, go[0]]))
    w_grads: list[torch.Tensor] = []
    hand.ab.a.W.register_hook(lambda g: w_grads.append(g))
    backward(hand)

    actions = {
        "grads": {"kind": "capture_grad", "select": "ab"},
        "w_grad": {"kind": "capture_grad", "select": "ab.a", "param": "W"},
    }
    with surgery.apply(functions, actions) as s:
        backward(functions)
    rec = s.captures["grads"]["ab"]
    assert all(torch.equal(a, b) for a, b in zip([*rec.grad_input, rec.grad_output[0]], answer, strict=True))
    assert torch.equal(s.captures["w_grad"]["ab.a.W"].grad, w_grads[0])
    # by hand: d out / d ab = W_c / W_d = 1.5 for each of the 2 rows; dW_a sums them
    assert torch.equal(rec.grad_output[0], torch.full((2, 1), 1.5))
    assert torch.equal(s.captures["w_grad"]["ab.a.W"].grad, torch.tensor([3.0]))


def test_function_linear_matches_the_hand_written_apply_passes(functions: Functions, x12) -> None:
    hand = Functions()

    def is_function(m: nn.Module) -> bool:
        return type(m).__name__.split("_")[0] == "Function"

    @torch.no_grad()
    def weight_initialization(m: nn.Module) -> None:
        if is_function(m):
            m.W.fill_(1.0)

    def add_bias(m: nn.Module) -> None:
        if is_function(m):
            m.b = nn.Parameter(torch.ones(1))

    def linear_transformation(m: nn.Module) -> None:
        if is_function(m):
            m.register_forward_hook(lambda mod, inputs, output: inputs[0] * mod.W + mod.b)

    hand.apply(weight_initialization).apply(add_bias).apply(linear_transformation)
    expected = hand(*x12)

    before = Snapshot.of(functions)
    with surgery.apply(functions, "function_linear"):
        got = functions(*x12)
        assert sorted(k for k in functions.state_dict() if k.endswith(".b")) == ["ab.a.b", "ab.b.b", "cd.c.b", "cd.d.b"]
    assert torch.equal(got, expected)
    x1, x2 = x12
    assert torch.equal(got, x1 + x2 + 4)  # every Function is x + 1: (x1+1) + (x2+1), then +1, +1
    before.assert_same(functions)


def test_init_ones_is_the_seeds_apply_exercise(functions: Functions, x12) -> None:
    with surgery.apply(functions, "init_ones"):
        assert all(p.item() == 1.0 for p in functions.parameters())
        x1, x2 = x12
        assert torch.equal(functions(x1, x2), (x1 + 1) + (x2 - 1))
    assert [p.item() for p in functions.parameters()] == [2.0, 1.0, 3.0, 2.0]
