"""``calls:`` (which calls of a module), ``prepend:``, ``what: grad_output`` and ``kwargs``, each against the same
thing written with plain PyTorch hooks, bit for bit, and removed exactly."""

from __future__ import annotations

import timeit

import pytest
import torch
from torch import nn

import surgery
from surgery.core.calls import CallCounter, gated, parse_calls
from surgery.errors import ConfigError


class Twice(nn.Module):
    """One Linear called twice per forward (weight sharing, as in a recurrent or tied model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def test_calls_list_changes_only_the_second_call() -> None:
    model, x = Twice(), _x()
    lin = model.lin
    expected = lin(torch.relu(lin(x))) + 1.0
    recipe = {"a": {"kind": "modify_output", "select": "lin", "op": "add", "value": 1.0, "calls": [1]}}
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)
        # counted per module from apply: a second forward is calls 2 and 3, none selected
        assert torch.equal(model(x), lin(torch.relu(lin(x))))


def test_reset_calls_counts_from_zero_again() -> None:
    model, x = Twice(), _x()
    expected = model.lin(torch.relu(model.lin(x) * 2))
    recipe = {"a": {"kind": "modify_output", "select": "lin", "op": "mul", "value": 2.0, "calls": ":1"}}
    with surgery.apply(model, recipe) as s:
        assert torch.equal(model(x), expected)
        s.reset_calls()
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize(("calls", "picked"), [("1:", [1, 2, 3]), ("::2", [0, 2]), (":2", [0, 1]), ([3, 0], [0, 3])])
def test_calls_on_capture_keeps_the_selected_calls(calls: object, picked: list[int]) -> None:
    model, x = Twice(), _x()
    outputs: list[torch.Tensor] = []
    handle = model.lin.register_forward_hook(lambda m, a, o: outputs.append(o.detach()))
    model(x), model(x)
    handle.remove()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "calls": calls}}, verify=True) as s:
        model(x), model(x)
        got = [c.output for c in s.captures["c"]["lin"].calls]
    assert len(got) == len(picked) and all(torch.equal(g, outputs[i]) for g, i in zip(got, picked))


@pytest.mark.parametrize(
    ("calls", "fragment"),
    [
        ("5:5", "can never match"),
        ("3:1", "can never match"),
        ("::0", "step must be positive"),
        ("-1:", "negative"),
        ([], "at least one"),
        ("a", "is not a slice"),
        (True, "is not a call number"),
    ],
)
def test_calls_refused_at_plan_time(calls: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=r"^actions\.c\.calls: .*" + fragment):
        surgery.plan(Twice(), {"c": {"kind": "capture", "select": "lin", "calls": calls}})


def test_calls_on_every_hook_kind_removes_exactly() -> None:
    model, x = Twice(), _x()
    recipe = {
        "log": {"kind": "log", "select": "lin", "calls": [0]},
        "rf": {"kind": "replace_forward", "select": "lin", "fn": "identity", "calls": [5]},
        "mi": {"kind": "modify_input", "select": "lin", "op": "mul", "value": 1.0, "calls": "1:"},
        "cg": {"kind": "capture_grad", "select": "lin", "calls": [0]},
        "mg": {"kind": "modify_grad", "select": "lin", "op": "mul", "value": 1.0, "calls": [1]},
        "pg": {"kind": "modify_grad", "select": "lin", "param": "weight", "op": "mul", "value": 1.0, "calls": [0]},
    }
    with surgery.apply(model, recipe, verify=True) as s:
        model(x).sum().backward()
        assert len(s.captures["cg"]["lin"].calls) == 1


def test_calls_on_backward_hooks_count_backward_calls_in_autograd_order() -> None:
    model, x = Twice(), _x().requires_grad_()
    seen: list[tuple[torch.Tensor, ...]] = []
    handle = model.lin.register_full_backward_hook(lambda m, gi, go: seen.append(tuple(g.clone() for g in go)))
    model(x).sum().backward()
    handle.remove()
    with surgery.apply(model, {"g": {"kind": "capture_grad", "select": "lin", "calls": [1]}}, verify=True) as s:
        model(x).sum().backward()
        (call,) = s.captures["g"]["lin"].calls
    assert torch.equal(call.grad_output[0], seen[1][0])  # the second backward call: the first forward call's


def test_calls_not_selected_cost_under_a_microsecond() -> None:
    """The gate on a call it skips: one counter update and one predicate, against a bare hook call."""
    hook = lambda *a: None  # noqa: E731
    skip = gated(hook, parse_calls("1000000000:"), CallCounter())
    args = (None, (), None)
    n = 200_000
    gate = min(timeit.repeat(lambda: skip(*args), number=n, repeat=5)) / n
    bare = min(timeit.repeat(lambda: hook(*args), number=n, repeat=5)) / n
    assert gate - bare < 1e-6, f"a skipped call costs {(gate - bare) * 1e9:.0f} ns more than a bare hook"


def test_prepend_runs_before_a_hook_already_on_the_module() -> None:
    model, x = Twice(), _x()
    lin = nn.Linear(4, 4)
    lin.load_state_dict(model.lin.state_dict())
    lin.register_forward_hook(lambda m, a, o: o * 2)  # a hook already there
    with torch.no_grad():
        base = nn.functional.linear(x, lin.weight, lin.bias)
    for prepend, want in ((True, (base + 1.0) * 2), (False, base * 2 + 1.0)):
        recipe = {"a": {"kind": "modify_output", "select": "<root>", "op": "add", "value": 1.0, "prepend": prepend}}
        with surgery.apply(lin, recipe, verify=True), torch.no_grad():
            assert torch.equal(lin(x), want)


def test_prepend_on_a_parameter_hook_is_refused() -> None:
    recipe = {"a": {"kind": "modify_grad", "select": "lin", "param": "weight", "op": "zero", "prepend": True}}
    with pytest.raises(ConfigError, match=r"^actions\.a\.prepend: "):
        surgery.plan(Twice(), recipe)


def test_modify_grad_on_grad_output_reaches_the_modules_own_parameter_gradients() -> None:
    """PyTorch's test_full_backward_pre_hooks: zeroing grad_output in a pre-hook zeroes the module's weight grad."""
    model, x = Twice(), _x()
    model.lin.register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,))
    model(x).sum().backward()
    expected = model.lin.weight.grad.clone()
    model.zero_grad()
    model._backward_pre_hooks.clear()
    model.lin._backward_pre_hooks.clear()
    model.lin._is_full_backward_hook = None
    recipe = {"g": {"kind": "modify_grad", "select": "lin", "what": "grad_output", "op": "mul", "value": 0.5}}
    with surgery.apply(model, recipe, verify=True):
        model(x).sum().backward()
    assert torch.equal(model.lin.weight.grad, expected)


def test_capture_grad_of_grad_output_and_of_grad_input() -> None:
    model, x = Twice(), _x().requires_grad_()
    outs: list[torch.Tensor] = []
    ins: list[torch.Tensor] = []
    h = model.lin.register_full_backward_hook(lambda m, gi, go: ins.append(gi[0].clone()) or outs.append(go[0].clone()))
    model(x).sum().backward()
    h.remove()
    model.lin._is_full_backward_hook = None
    recipe = {
        "o": {"kind": "capture_grad", "select": "lin", "what": "grad_output"},
        "i": {"kind": "capture_grad", "select": "lin", "what": "grad_input"},
    }
    with surgery.apply(model, recipe, verify=True) as s:
        model(x).sum().backward()
        o, i = s.captures["o"]["lin"].calls, s.captures["i"]["lin"].calls
    assert all(torch.equal(c.grad_output[0], t) for c, t in zip(o, outs))
    assert len(o) == 2 and o[0].grad_input is None and i[0].grad_output is None
    assert all(torch.equal(c.grad_input[0], t) for c, t in zip(i, ins))


class Biased(nn.Module):
    """A module whose forward takes a keyword input, as Hugging Face blocks take masks and position ids."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x * 2


def test_expr_reads_keyword_inputs() -> None:
    """PyTorch's test_forward_hooks with kwargs: ``out + kwargs['bias']``."""
    module, x, bias = Biased(), _x(), torch.full((4,), 0.5)
    handle = module.register_forward_hook(lambda m, a, k, o: o + k["bias"], with_kwargs=True)
    expected = module(x, bias=bias)
    handle.remove()
    recipe = {"k": {"kind": "replace_forward", "select": "<root>", "expr": "output + kwargs['bias']"}}
    with surgery.apply(module, recipe, verify=True):
        assert torch.equal(module(x, bias=bias), expected)


def add_keyword_bias(module: nn.Module, inputs: tuple, output: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """A ``fn`` for replace_forward that reads the keyword inputs."""
    return output + kwargs["bias"]


def test_fn_with_a_kwargs_parameter_gets_keyword_inputs() -> None:
    module, x, bias = Biased(), _x(), torch.full((4,), 0.5)
    recipe = {"k": {"kind": "replace_forward", "select": "<root>", "fn": f"{__name__}:add_keyword_bias"}}
    with surgery.apply(module, recipe, verify=True):
        assert torch.equal(module(x, bias=bias), x * 2 + bias)


def test_kwargs_where_the_hook_has_none_is_refused() -> None:
    recipe = {"k": {"kind": "modify_output", "select": "lin", "op": "expr", "expr": "output + kwargs['b']"}}
    with pytest.raises(ConfigError, match=r"^actions\.k\.expr: .*'kwargs' is not available here"):
        surgery.plan(Twice(), recipe)
