"""replace_forward against the same hooks written in plain PyTorch: modules that write into their input
(``inplace``), keyword inputs, ``calls``, the ``linear`` weights, and every refusal's exact text."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery import ActionError, ConfigError
from tests.test_functions import Model as SoftmaxModel

X = torch.tensor([[1.0, -2.0, 0.5, 4.0], [-0.25, 3.0, -1.5, 2.0]])
BIAS = torch.tensor([0.5, -1.0, 2.0, 0.25])


class Scale(nn.Module):
    """``x * k (+ bias)``; with ``inplace`` it writes into ``x`` as nn.ReLU(inplace=True) does (None: no attribute)."""

    def __init__(self, inplace: bool | None = None) -> None:
        super().__init__()
        if inplace is not None:
            self.inplace = inplace
        self.register_buffer("alpha", torch.tensor(3.0))

    def forward(self, x: torch.Tensor, k: float, bias: Any = None) -> torch.Tensor:
        y = x.mul_(k) if getattr(self, "inplace", False) else x * k
        return y if bias is None else y + bias


class Holder(nn.Module):
    """Calls ``m`` with a number by position and ``bias`` by keyword, as blocks pass masks."""

    def __init__(self, inplace: bool | None = None) -> None:
        super().__init__()
        self.m = Scale(inplace)

    def forward(self, x: torch.Tensor, k: float, bias: Any = None) -> torch.Tensor:
        return self.m(x, k, bias=bias)


def scaled(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """A replace_forward ``fn`` reading the module, its inputs and its output."""
    return inputs[0] * module.alpha + output


def scaled_kw(module: nn.Module, inputs: tuple, output: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The same, also reading the keyword inputs."""
    return inputs[0] * module.alpha + output + kwargs["bias"]


def give_k(module: nn.Module, inputs: tuple, output: torch.Tensor) -> Any:
    """A replace_forward ``fn`` that returns a number where the module returns a tensor."""
    return inputs[1]


def plain_hooks(module: nn.Module, compute: Any, with_kwargs: bool, calls: set[int] | None = None) -> list[Any]:
    """The hooks replace_forward registers, in plain PyTorch: an inplace module's forward gets copies of its inputs."""
    inplace, pending, seen = getattr(module, "inplace", False), [], {"pre": 0, "post": 0}

    def wanted(which: str) -> bool:
        seen[which] += 1
        return calls is None or seen[which] - 1 in calls

    def keep(m: nn.Module, args: tuple) -> tuple | None:
        if not wanted("pre"):
            return None
        pending.append(args)
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    def hook(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if not wanted("post"):
            return None
        args = pending.pop() if inplace else args
        return compute(m, args, out, kwargs) if with_kwargs else compute(m, args, out)

    handles = [module.register_forward_pre_hook(keep)] if inplace else []
    return handles + [module.register_forward_hook(hook, with_kwargs=True)]


EXPRS = {False: "inputs[0] * module.alpha + output", True: "inputs[0] * module.alpha + output + kwargs['bias']"}


@pytest.mark.parametrize("inplace", [True, None])
@pytest.mark.parametrize("with_kwargs", [False, True])
@pytest.mark.parametrize("source", ["expr", "fn"])
def test_replace_forward_equals_plain_hooks(inplace: bool | None, with_kwargs: bool, source: str) -> None:
    model = Holder(inplace)
    compute = scaled_kw if with_kwargs else scaled
    handles = plain_hooks(model.m, compute, with_kwargs)
    x_plain = X.clone()
    expected = model(x_plain, 2.0, bias=BIAS)
    for h in handles:
        h.remove()
    how = EXPRS[with_kwargs] if source == "expr" else f"{__name__}:{compute.__name__}"
    x = X.clone()
    with surgery.apply(model, {"k": {"kind": "replace_forward", "select": "m", source: how}}, verify=True) as s:
        assert torch.equal(model(x, 2.0, bias=BIAS), expected)
        assert torch.equal(x, x_plain) and torch.equal(x, X)  # the caller's input is left as it came in
        assert s.hook_count == {"k": 2 if inplace else 1}  # a pre-hook copying the inputs only where forward writes
    assert not model.m._forward_hooks and not model.m._forward_pre_hooks


class Keeps(nn.Module):
    """Keeps the tensor its forward was handed (a cache): without ``inplace`` it must be the caller's own."""

    def forward(self, x: torch.Tensor, k: float, bias: Any = None) -> torch.Tensor:
        self.seen = x
        return x * k


@pytest.mark.parametrize("expr", ["output + 1", "output + kwargs['bias']"])
def test_a_module_without_inplace_gets_the_callers_tensor_itself(expr: str) -> None:
    module, x = Keeps(), X.clone()
    with surgery.apply(module, {"k": {"kind": "replace_forward", "select": "<root>", "expr": expr}}) as s:
        module(x, 2.0, bias=BIAS)
        assert module.seen is x and s.hook_count == {"k": 1}


@pytest.mark.parametrize("inplace", [True, None])
@pytest.mark.parametrize("with_kwargs", [False, True])
def test_calls_leaves_the_other_calls_exactly_as_without_surgery(inplace: bool | None, with_kwargs: bool) -> None:
    model = Holder(inplace)
    handles = plain_hooks(model.m, scaled_kw if with_kwargs else scaled, with_kwargs, calls={1})
    plain = [X.clone(), X.clone(), X.clone()]
    expected = [model(x, 2.0, bias=BIAS) for x in plain]
    for h in handles:
        h.remove()
    recipe = {"k": {"kind": "replace_forward", "select": "m", "expr": EXPRS[with_kwargs], "calls": [1]}}
    xs = [X.clone(), X.clone(), X.clone()]
    with surgery.apply(model, recipe, verify=True):
        got = [model(x, 2.0, bias=BIAS) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(xs, plain))  # calls 0 and 2 of an inplace module write into x
    assert not torch.equal(got[1], Holder(inplace)(X.clone(), 2.0, bias=BIAS))


@pytest.mark.parametrize("inplace", [True, None])
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ({"expr": "inputs[0] + kwargs['missing']"}, "'inputs[0] + kwargs['missing']' failed: 'missing'"),
        ({"expr": "inputs[3]"}, "'inputs[3]' failed: tuple index out of range"),
        ({"expr": "inputs[1]"}, "'inputs[1]' gave a float, not a tensor as the module returns"),
        ({"expr": "kwargs['bias']"}, "\"kwargs['bias']\" gave a float, not a tensor as the module returns"),
        ({"fn": f"{__name__}:give_k"}, f"'{__name__}:give_k' gave a float, not a tensor as the module returns"),
    ],
)
def test_a_failing_replacement_names_action_key_and_module(inplace: bool | None, how: dict, message: str) -> None:
    model = Holder(inplace)
    key = next(iter(how))
    with surgery.apply(model, {"k": {"kind": "replace_forward", "select": "m", **how}}):
        with pytest.raises(ActionError) as e:
            model(X.clone(), 2.0, bias=0.5)
    assert str(e.value) == f"actions.k.{key} on module 'm': {message}"


def test_replace_forward_refuses_grad() -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(Holder(), {"k": {"kind": "replace_forward", "select": "m", "expr": "grad * 2"}})
    assert str(e.value) == (
        "actions.k.expr: 'grad' in 'grad * 2': variable 'grad' is not available here;"
        " allowed: x, inputs, output, module, kwargs"
    )


def test_replace_forward_of_a_function_reads_its_keyword_inputs() -> None:
    model, x = SoftmaxModel(), torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    m = model.scores
    expected = model.other(m.v(-torch.ones_like(m.w(x))))  # F.softmax(s, dim=-1): kwargs {'dim': -1}
    recipe = {"f": {"kind": "replace_forward", "select": "scores", "function": "softmax",
                    "expr": "ones_like(output) * kwargs['dim']"}}  # fmt: skip
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


# ---------------------------------------------------------------- fn: linear


class Weights(nn.Module):
    """A module whose forward ignores its weights (replace_forward with fn: linear uses them)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


W = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.5, 0.75, -0.5, 3.0], [-2.0, 0.125, 1.0, -0.25]])
B3 = torch.tensor([0.5, -0.25, 4.0])
V4 = torch.tensor([2.0, -0.5, 4.0, 0.25])


@pytest.mark.parametrize(
    ("tensors", "plain"),
    [
        ({"W": W}, lambda x: F.linear(x, W)),
        ({"W": W, "b": B3}, lambda x: F.linear(x, W, B3)),
        ({"weight": W, "b": B3}, lambda x: F.linear(x, W, B3)),
        ({"W": V4}, lambda x: x * V4),
        ({"W": V4, "b": BIAS}, lambda x: x * V4 + BIAS),
        ({"W": torch.tensor(-3.0), "bias": torch.tensor(1.5)}, lambda x: x * -3.0 + 1.5),
    ],
    ids=["W", "W-b", "weight-b", "vector-W", "vector-W-b", "scalar-W-bias"],
)
def test_linear_uses_the_modules_own_weight_and_bias(tensors: dict, plain: Any) -> None:
    module = Weights(**tensors)
    with surgery.apply(module, {"r": {"kind": "replace_forward", "select": "<root>", "fn": "linear"}}, verify=True):
        assert torch.equal(module(X), plain(X))


def test_linear_on_a_weight_added_by_an_earlier_action() -> None:
    module = Weights()
    actions = {
        "add": {"kind": "add_parameter", "select": "<root>", "name": "W", "shape": [3, 4]},
        "fill": {"kind": "init", "select": "<root>", "param": "W", "method": "constant", "value": 0.5},
        "r": {"kind": "replace_forward", "select": "<root>", "fn": "linear"},
    }
    with surgery.apply(module, actions, verify=True):
        assert torch.equal(module(X), F.linear(X, torch.full((3, 4), 0.5)))


class _Compiled:
    """A callable whose signature cannot be read, as a Cython-compiled function's (inspect raises ValueError)."""

    @property
    def __signature__(self) -> Any:
        raise ValueError("no signature found")

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor, **extra: Any) -> torch.Tensor:
        return output * 2 + len(extra)


COMPILED = _Compiled()


def test_a_fn_without_a_readable_signature_gets_no_keyword_inputs() -> None:
    module = Keeps()
    with surgery.apply(module, {"k": {"kind": "replace_forward", "select": "<root>", "fn": f"{__name__}:COMPILED"}}):
        assert torch.equal(module(X, 2.0, bias=BIAS), X * 2.0 * 2)
