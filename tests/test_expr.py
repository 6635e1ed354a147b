"""The expression language: one table of accepted expressions checked against plain torch, one of refusals."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError
from surgery.expr.check import FUNCTIONS, NAMES, TENSOR_ATTRIBUTES, TENSOR_METHODS, compile_expr
from surgery.expr.parsing import MAX_LENGTH, compile_index

WHERE = "actions.demo.expr"


class Affine(nn.Module):
    """Tiny module with parameters, a buffer, a plain number and a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.register_buffer("scale", torch.tensor(2.0))
        self.eps = 1e-3
        self.inner = nn.Linear(4, 4)


MODULES = {"affine": Affine, "linear": lambda: nn.Linear(4, 4), "norm": lambda: nn.LayerNorm(4)}


def make_env(module: str = "affine") -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    return {
        "x": x,
        "inputs": (x, torch.randn(3, 4)),
        "output": torch.randn(3, 4),
        "grad": torch.randn(3, 4) * 3,
        "module": MODULES[module](),
    }


# (expression, module kind, the same computation in plain torch on `e` = the env as a namespace)
ACCEPTED = [
    ("x * module.W + module.b", "affine", lambda e: e.x * e.module.W + e.module.b),
    ("relu(x)", "affine", lambda e: torch.relu(e.x)),
    ("relu(x) * 2", "affine", lambda e: torch.relu(e.x) * 2),
    ("x @ module.weight.T + module.bias", "linear", lambda e: e.x @ e.module.weight.T + e.module.bias),
    ("linear(x, module.weight, module.bias)", "linear", lambda e: e.module(e.x)),
    ("x.matmul(module.weight.t()) + module.bias", "linear", lambda e: e.module(e.x)),
    ("softmax(output, dim=-1)", "affine", lambda e: torch.softmax(e.output, dim=-1)),
    ("log_softmax(x, -1)", "affine", lambda e: torch.log_softmax(e.x, -1)),
    ("output[:, 1:3] * 0", "affine", lambda e: e.output[:, 1:3] * 0),
    ("output[..., -1]", "affine", lambda e: e.output[..., -1]),
    ("x[None, :2]", "affine", lambda e: e.x[None, :2]),
    ("x[::2, 1]", "affine", lambda e: e.x[::2, 1]),
    ("inputs[1] - x", "affine", lambda e: e.inputs[1] - e.x),
    ("grad.clamp(-1, 1)", "affine", lambda e: e.grad.clamp(-1, 1)),
    ("clamp(grad, min=-1)", "affine", lambda e: torch.clamp(e.grad, min=-1)),
    ("where(x > 0, x, 0.1 * x)", "affine", lambda e: torch.where(e.x > 0, e.x, 0.1 * e.x)),
    ("x.reshape(2, -1).mean(dim=1)", "affine", lambda e: e.x.reshape(2, -1).mean(dim=1)),
    ("-x ** 2", "affine", lambda e: -(e.x**2)),
    ("abs(x) ** 0.5 + 2 ** x", "affine", lambda e: e.x.abs() ** 0.5 + 2**e.x),
    ("module.eps", "norm", lambda e: e.module.eps),
    ("layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)", "norm", lambda e: e.module(e.x)),
    ("module.scale * x / module.eps", "affine", lambda e: e.module.scale * e.x / e.module.eps),
    ("module.inner.weight.sum()", "affine", lambda e: e.module.inner.weight.sum()),
    ("cat((x, x), dim=0)", "affine", lambda e: torch.cat((e.x, e.x), dim=0)),
    ("stack([x, output]).sum(0)", "affine", lambda e: torch.stack([e.x, e.output]).sum(0)),
    ("2 ** 10", "affine", lambda e: 1024),
    ("2 ** -2 + 7 // 2 - 7 % 4", "affine", lambda e: 0.25 + 3 - 3),
    ("x == 0", "affine", lambda e: e.x == 0),
    ("x != output", "affine", lambda e: e.x != e.output),
    ("x >= 0.5", "affine", lambda e: e.x >= 0.5),
    ("(x > 0) & (x < 1) | ~(output < 0)", "affine", lambda e: (e.x > 0) & (e.x < 1) | ~(e.output < 0)),
    ("x.T", "affine", lambda e: e.x.T),
    ("x.mT @ output", "affine", lambda e: e.x.mT @ e.output),
    ("x.shape[0] * 2 + x.ndim + x.size(1)", "affine", lambda e: 3 * 2 + 2 + 4),
    ("zeros_like(x, dtype=x.dtype) + ones_like(x)", "affine", lambda e: torch.ones_like(e.x)),
    ("full_like(x, 0.5)", "affine", lambda e: torch.full_like(e.x, 0.5)),
    ("randn_like(x).shape", "affine", lambda e: e.x.shape),
    ("gelu(x) + silu(x) + elu(x)", "affine", lambda e: F.gelu(e.x) + F.silu(e.x) + F.elu(e.x)),
    ("leaky_relu(x, negative_slope=0.2)", "affine", lambda e: F.leaky_relu(e.x, 0.2)),
    ("sigmoid(x) * tanh(x) + softplus(x)", "affine", lambda e: torch.sigmoid(e.x) * torch.tanh(e.x) + F.softplus(e.x)),
    ("norm(x, dim=-1)", "affine", lambda e: torch.linalg.vector_norm(e.x, dim=-1)),
    ("x.norm(dim=-1)", "affine", lambda e: e.x.norm(dim=-1)),
    ("amax(x, dim=0) - x.amin(dim=0)", "affine", lambda e: e.x.amax(0) - e.x.amin(0)),
    ("maximum(x, output) + minimum(x, output)", "affine", lambda e: e.x + e.output),
    ("sign(x) * sqrt(abs(x))", "affine", lambda e: torch.sign(e.x) * torch.sqrt(e.x.abs())),
    ("x.max(dim=0)[0]", "affine", lambda e: e.x.max(dim=0)[0]),
    ("x.chunk(2, dim=1)[1]", "affine", lambda e: e.x.chunk(2, dim=1)[1]),
    ("x.flatten().flip(0)", "affine", lambda e: e.x.flatten().flip(0)),
    ("x.unsqueeze(0).expand(2, 3, 4).sum(0)", "affine", lambda e: e.x * 2),
    ("x.transpose(0, 1).permute(1, 0).detach().clone()", "affine", lambda e: e.x),
    ("x.sum().item()", "affine", lambda e: e.x.sum().item()),
    ("x.argmax(dim=-1)", "affine", lambda e: e.x.argmax(dim=-1)),
    ("pow(x, 2) + square(x) + erf(x)", "affine", lambda e: 2 * e.x**2 + torch.erf(e.x)),
    ("x[[0, 2]] + x[x > 0].sum()", "affine", lambda e: e.x[[0, 2]] + e.x[e.x > 0].sum()),
    ("x[(x > 0) * 1, 1:]", "affine", lambda e: e.x[(e.x > 0) * 1, 1:]),
    ("x.flatten()[:, None] * output.flatten()", "affine", lambda e: e.x.flatten()[:, None] * e.output.flatten()),
    ("x[:, x.shape[1] // 2]", "affine", lambda e: e.x[:, 2]),
    ("module.W.expand(3, -1) * x < output", "affine", lambda e: e.module.W.expand(3, -1) * e.x < e.output),
    ("x.max(output) + x.abs().pow(output)", "affine", lambda e: e.x.max(e.output) + e.x.abs().pow(e.output)),
    ("x // 0.5 + x % 0.5", "affine", lambda e: e.x // 0.5 + e.x % 0.5),
    ("+x - -output", "affine", lambda e: e.x + e.output),
    ("(x > 0) ^ (output > 0)", "affine", lambda e: (e.x > 0) ^ (e.output > 0)),
    ("(x, output)[1] * module.scale", "affine", lambda e: e.output * 2),
    ("[x, output][0].view(-1).numel()", "affine", lambda e: 12),
    ("x.squeeze().unflatten(1, (2, 2)).flatten(1)", "affine", lambda e: e.x),
    ("x.narrow(1, 0, 2).roll(1, 0).contiguous()", "affine", lambda e: e.x[:, :2].roll(1, 0)),
    ("x.split(2, dim=1)[0].float().dim()", "affine", lambda e: 2),
    ("x.expand_as(output) - mean(x, dim=0, keepdim=True)", "affine", lambda e: e.x - e.x.mean(0, keepdim=True)),
    (
        "std(x) + var(x, dim=0).sum() + x.std() * x.var()",
        "affine",
        lambda e: e.x.std() + e.x.var(0).sum() + e.x.std() * e.x.var(),
    ),
    ("exp(x).log() + sin(x) ** 2 + cos(x) ** 2", "affine", lambda e: e.x + 1),
    ("matmul(x, module.inner.weight.T) + module.inner.bias", "affine", lambda e: e.module.inner(e.x)),
    ("x.dtype == output.dtype", "affine", lambda e: True),
]


@pytest.mark.parametrize(("text", "module", "expected"), ACCEPTED, ids=[case[0] for case in ACCEPTED])
def test_accepted_expression_matches_plain_torch(text: str, module: str, expected: Any) -> None:
    env = make_env(module)
    got = compile_expr(text, WHERE)(**env)
    want = expected(SimpleNamespace(**env))
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want)
    else:
        assert got == want


@pytest.mark.parametrize(
    ("text", "used"),
    [
        ("x * module.W + module.b", {"x", "module"}),
        ("softmax(output, dim=-1)", {"output"}),
        ("grad.clamp(-1, 1)", {"grad"}),
        ("inputs[1] - x", {"inputs", "x"}),
        ("2 ** 10", set()),
    ],
)
def test_names_used(text: str, used: set[str]) -> None:
    assert compile_expr(text, WHERE).names_used == frozenset(used)


# (expression, a fragment of it the error must quote)
REFUSED = [
    ("__import__('os')", "__import__"),
    ("x.__class__", "x.__class__"),
    ("x.__class__.__mro__", "__mro__"),
    ("().__class__.__bases__[0].__subclasses__()", "__subclasses__"),
    ("module.__dict__", "module.__dict__"),
    ("module._parameters", "module._parameters"),
    ("x._version", "x._version"),
    ("getattr(x, 'T')", "getattr(x, 'T')"),
    ("eval('1')", "eval('1')"),
    ("open('f')", "open('f')"),
    ("print(x)", "print(x)"),
    ("lambda: 1", "lambda: 1"),
    ("[i for i in x]", "[i for i in x]"),
    ("(i for i in range(3))", "i for i in range(3)"),
    ("{k: 1 for k in x}", "{k: 1 for k in x}"),
    ("{1, 2}", "{1, 2}"),
    ("{'a': x}", "{'a': x}"),
    ("'abc'", "'abc'"),
    ("b'abc'", "b'abc'"),
    ("x * 3j", "3j"),
    ("f'{x}'", "f'{x}'"),
    ("x if x else x", "x if x else x"),
    ("(y := x)", "y := x"),
    ("9 ** 9 ** 9", "9 ** 9 ** 9"),
    ("2 ** (2 ** 100)", "2 ** 100"),
    ("10 ** 100000", "10 ** 100000"),
    ("2 ** -100", "2 ** -100"),
    ("x * (-8) ** 0.5", "(-8) ** 0.5"),
    ("x + 1 / 0", "1 / 0"),
    ("x * 1e999", "1e999"),
    ("x * (1e300 * 1e300)", "1e300 * 1e300"),
    ("y", "y"),
    ("x + yy", "yy"),
    ("foo(x)", "foo(x)"),
    ("relu", "relu"),
    ("x.register_hook(print)", "x.register_hook(print)"),
    ("x.add_(1)", "x.add_(1)"),
    ("x.numpy()", "x.numpy()"),
    ("x.to(2)", "x.to(2)"),
    ("x.data", "x.data"),
    ("x.grad", "x.grad"),
    ("x.shape.count", "x.shape.count"),
    ("os.system('ls')", "os.system('ls')"),
    ("x.mean()()", "x.mean()()"),
    ("(x.T)(1)", "(x.T)(1)"),
    ("x and x", "x and x"),
    ("not x", "'not' does not work on tensors; use ~"),
    ("not False", "'not' does not work on tensors; use ~"),
    ("x.flatten()[0].expand(10**11).sum()", "100,000,000,000 elements are more than 68,719,476,736"),
    ("x.expand((2**20, 2**20))", "1,099,511,627,776 elements are more than"),
    ("x.repeat(10**6)", "unknown tensor method '.repeat()'"),
    ("x.new_zeros(10**6)", "unknown tensor method '.new_zeros()'"),
    ("x.tile(10**6)", "unknown tensor method '.tile()'"),
    ("x.repeat_interleave(10**6)", "unknown tensor method '.repeat_interleave()'"),
    ("x.broadcast_to((10**6,))", "unknown tensor method '.broadcast_to()'"),
    ("zeros(10**6)", "unknown function 'zeros'"),
    ("ones(10**6)", "unknown function 'ones'"),
    ("full((10**6,), 1.0)", "unknown function 'full'"),
    ("arange(10**11)", "unknown function 'arange'"),
    ("broadcast_to(x, (10**6,))", "unknown function 'broadcast_to'"),
    ("x or 1", "x or 1"),
    ("x is None", "x is None"),
    ("x in x", "x in x"),
    ("0 < x < 1", "0 < x < 1"),
    ("x << 2", "x << 2"),
    ("*x", "*x"),
    ("relu(*x)", "*x"),
    ("relu(**x)", "**x"),
    ("clamp(x, 0, 1, out=x)", "out=x"),
    ("leaky_relu(x, inplace=True)", "inplace=True"),
    ("relu(x, _hidden=1)", "_hidden=1"),
    ("x + ...", "..."),
    ("1[0]", "1[0]"),
    ("x = 1", "x = 1"),
    ("x +", "x +"),
    ("", ""),
    # the classic sandbox escapes and their relatives, written as the brief lists them
    ("{i for i in x}", "{i for i in x}"),
    ("exec('1')", "exec('1')"),
    ("compile('1', '', 'eval')", "compile('1', '', 'eval')"),
    ("globals()", "globals()"),
    ("vars()", "vars()"),
    ("dir()", "dir()"),
    ("breakpoint()", "breakpoint()"),
    ("setattr(module, 'W', x)", "setattr(module, 'W', x)"),
    ("type(x)", "type(x)"),
    ("__builtins__", "__builtins__"),
    ("x.__dict__", "x.__dict__"),
    ("x.__reduce_ex__(2)", "x.__reduce_ex__"),
    ("x[x.__class__]", "x.__class__"),
    ("module._modules", "module._modules"),
    ("module.__class__", "module.__class__"),
    ("module.inner.__dict__", "module.inner.__dict__"),
    ("module.register_forward_hook(print)", "module.register_forward_hook(print)"),
    ("module.apply(relu)", "module.apply(relu)"),
    ("module.state_dict()", "module.state_dict()"),
    ("module.sum()", "module"),
    ("module", "module"),
    ("relu(module)", "module"),
    ("(module, x)[0].weight", "(module, x)[0].weight"),
    ("(1).real", "(1).real"),
    ("inputs.count", "inputs.count"),
    ("inputs.index(x)", "inputs.index(x)"),
    ("9**9**9", "9**9**9"),
    ("2**(2**100)", "2**100"),
    ("10**100000", "10**100000"),
    ("(10**10)**(10**10)", "(10**10)**(10**10)"),
    ("x.storage()", "x.storage()"),
    ("x.untyped_storage()", "x.untyped_storage()"),
    ("x.requires_grad_()", "x.requires_grad_()"),
    ("x.copy_(x)", "x.copy_(x)"),
    ("x.apply_(print)", "x.apply_(print)"),
    ("x.tolist()", "x.tolist()"),
    ("x.backward()", "x.backward()"),
    ("x.register_hook", "x.register_hook"),
    ("x.requires_grad", "x.requires_grad"),
    ("x.max(dim=0, out=x)", "out=x"),
    ("full_like(x, 1, out=x)", "out=x"),
]


@pytest.mark.parametrize(("text", "fragment"), REFUSED, ids=[case[0] or "<empty>" for case in REFUSED])
def test_refused_expression_names_where_and_fragment(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_expr(text, WHERE)
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: ")
    assert fragment in message


def test_overly_long_text_is_refused() -> None:
    text = "+".join(["x"] * MAX_LENGTH)
    with pytest.raises(ConfigError, match=rf"{WHERE}: expression is longer than .*'x\+x\+x"):
        compile_expr(text, WHERE)


@pytest.mark.parametrize(
    "text",
    ["(" * 60 + "x" + ")" * 60, "-" * 60 + "x", "+".join(["x"] * 60), "relu(" * 60 + "x" + ")" * 60],
    ids=["parentheses", "unary", "sum", "calls"],
)
def test_deep_nesting_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"{WHERE}: .*nested deeper than 50") as caught:
        compile_expr(text, WHERE)
    assert text[:20] in str(caught.value)


@pytest.mark.parametrize(
    ("text", "names", "refused"),
    [
        ("output * 2", ("x", "module"), "output"),
        ("x * grad", ("grad", "module"), "x"),
    ],
)
def test_variable_outside_restricted_names_lists_allowed_ones(text: str, names: tuple[str, ...], refused: str) -> None:
    with pytest.raises(ConfigError, match=f"variable '{refused}' is not available here; allowed: {', '.join(names)}"):
        compile_expr(text, WHERE, names=names)


def test_restricted_names_still_accept_allowed_ones() -> None:
    clip = compile_expr("grad.clamp(-module.eps, module.eps)", WHERE, names=("grad", "module"))
    grad = torch.tensor([-1.0, 0.0005, 1.0])
    torch.testing.assert_close(clip(grad=grad, module=Affine()), torch.tensor([-1e-3, 0.0005, 1e-3]))


def test_non_string_is_refused() -> None:
    with pytest.raises(ConfigError, match=f"{WHERE}: expected an expression string, got int"):
        compile_expr(3, WHERE)  # type: ignore[arg-type]


# (expression, module kind, a fragment the runtime error must contain)
RUNTIME_REFUSED = [
    ("module.nonexistent", "affine", "no readable attribute 'nonexistent'. Readable: W, b, eps, inner, scale"),
    ("module.forward", "linear", "no readable attribute 'forward'"),
    ("module.weight.data", "linear", "tensors have no readable '.data'"),
    ("module.eps.real", "norm", "cannot read '.real' of a float"),
    ("module.weight.shape.count", "linear", "cannot read '.count' of a Size"),
    ("module.inner.sum()", "affine", "cannot call '.sum()' on a Linear; only on tensors"),
    ("module.inner", "affine", "the result is the submodule Linear, not a value"),
    ("(x, module.inner)", "affine", "the result is the submodule Linear, not a value"),
    ("x.ndim ** 100", "affine", "exponent 100 is larger than 64"),
    ("(x.numel() ** 64) ** 64", "affine", "is not a finite real number"),
    ("inputs * 3", "affine", "repeating a tuple or list"),
    ("[x] * 3", "affine", "repeating a tuple or list"),
    ("where(x > 0) * 3", "affine", "repeating a tuple or list"),
    ("3 * where(x > 0)", "affine", "repeating a tuple or list"),
    ("x @ x", "affine", "cannot be multiplied"),
    ("leaky_relu(module.weight, 0.1, True)", "linear", "positional argument"),
    ("module.register_forward_hook", "linear", "no readable attribute 'register_forward_hook'"),
    ("module.apply", "linear", "no readable attribute 'apply'"),
    ("module.state_dict", "linear", "no readable attribute 'state_dict'"),
    ("module.inner.forward", "affine", "no readable attribute 'forward'"),
    ("module.weight.grad", "linear", "tensors have no readable '.grad'"),
    ("module.weight.requires_grad", "linear", "tensors have no readable '.requires_grad'"),
    ("module.inner.weight.data", "affine", "tensors have no readable '.data'"),
    ("x.shape * 3", "affine", "repeating a tuple or list"),
    ("x.numel() ** 65", "affine", "exponent 65 is larger than 64"),
    *(
        (text, "affine", fragment)
        for text, fragment in [
            ("x[0, 0].expand(10**9).sum()", "a tensor of 1,000,000,000 elements, more than the 16,777,216"),
            ("x[0, 0].expand(BIG)[:, None] * x[0, 0].expand(BIG)", "a tensor of 1,099,511,627,776"),
            ("x[0, 0].expand(BIG)[:, None] > x[0, 0].expand(BIG)", "a tensor of 1,099,511,627,776"),
            ("x[0, 0].expand(BIG)[:, None] @ x[0, 0].expand(BIG)[None]", "a tensor of 1,099,511,627,776"),
            (
                "x[0, 0].expand(BIG)[:, None].matmul(x[0, 0].expand(1, BIG))",
                "a tensor of 1,099,511,627,776",
            ),
            ("linear(x[0, 0].expand(BIG, 1), x[0, 0].expand(BIG, 1))", "a tensor of 1,099,511,627,776"),
            ("where(x[0, 0].expand(BIG)[:, None] > 0, x[0, 0].expand(BIG), 0.0)", "1,099,511,627,776"),
            ("maximum(x[0, 0].expand(BIG)[:, None], x[0, 0].expand(BIG))", "1,099,511,627,776"),
            ("x[0, 0].expand(BIG)[:, None].clamp(x[0, 0].expand(BIG))", "1,099,511,627,776"),
            ("cat([x[0, 0].expand(2**24), x[0, 0].expand(2**24)])", "a tensor of 33,554,432 elements"),
            ("stack([x[0, 0].expand(2**24), x[0, 0].expand(2**24)])", "a tensor of 33,554,432 elements"),
            ("x[0, 0].expand(2**12, 2**12)[(x[0, 0].expand(2**13) > 1e9) * 1]", "33,554,432 elements"),
            ("x[0, 0].expand(1, 2**24)[[0, 0]]", "a tensor of 33,554,432 elements"),
        ]
    ),  # fmt: skip
]
RUNTIME_REFUSED = [(text.replace("BIG", "2**20"), module, fragment) for text, module, fragment in RUNTIME_REFUSED]


@pytest.mark.parametrize(("text", "module", "fragment"), RUNTIME_REFUSED, ids=[case[0] for case in RUNTIME_REFUSED])
def test_runtime_refusal_is_action_error(text: str, module: str, fragment: str) -> None:
    env = make_env(module)
    before = {name: p.detach().clone() for name, p in env["module"].named_parameters()}
    expr = compile_expr(text, WHERE)
    with pytest.raises(ActionError) as caught:
        expr(**env)
    assert str(caught.value).startswith(f"{WHERE}: '{text}'")
    assert fragment in str(caught.value)
    for name, p in env["module"].named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed"


def test_the_element_bound_follows_the_largest_input_and_is_checked_before_allocating(monkeypatch) -> None:
    """16 × the largest input (at least 2**24): 2**25 elements pass for an input of 2**21, not for one of 2**20."""
    grow = compile_expr("x.flatten()[0].expand(2**25).sum()", WHERE)
    assert grow(x=torch.ones(2**21)) == 2**25
    assert grow.bind("x", "module")(torch.ones(1), nn.Linear(2**11, 2**10)) == 2**25  # the module's tensors count
    with pytest.raises(ActionError, match="a tensor of 33,554,432 elements, more than the 16,777,216"):
        grow(x=torch.ones(2**20))
    # refused before torch is asked for the memory: no tensor op runs past the check
    calls = []
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **k: calls.append(a))
    with pytest.raises(ActionError):
        compile_expr("(x[:, None] * x).sum()", WHERE)(x=torch.ones(2**13))
    assert calls == []


# What makes at most as many elements as its largest operand; SIZED_FUNCTIONS/SIZED_METHODS are checked at run time.
NON_GROWING_FUNCTIONS = set(
    "relu sigmoid tanh softmax log_softmax abs exp log sqrt rsqrt square sign erf sin cos mean sum amax amin std var"
    " zeros_like ones_like full_like randn_like rand_like gelu silu softplus leaky_relu elu layer_norm norm"
    " topk kthvalue sort cumsum".split()
)
NON_GROWING_METHODS = set(
    "reshape view flatten unflatten mean sum amax amin abs exp log sqrt relu sigmoid tanh softmax log_softmax"
    " transpose permute unsqueeze squeeze norm std var detach clone float size dim numel expand_as sign t contiguous"
    " chunk split narrow roll flip argmax argmin square sin cos item topk kthvalue sort cumsum".split()
)


def test_every_function_and_method_is_classified_for_the_element_bound() -> None:
    """A function added to the allowlists must be checked (SIZED_*) or known to make no more than it is given."""
    from surgery.expr.runtime import SIZED_FUNCTIONS, SIZED_METHODS

    assert set(FUNCTIONS) - SIZED_FUNCTIONS - NON_GROWING_FUNCTIONS == set()
    assert TENSOR_METHODS - SIZED_METHODS - NON_GROWING_METHODS == set()


def test_missing_variable_is_named() -> None:
    with pytest.raises(ActionError, match=f"{WHERE}: 'output \\* 2' uses 'output', which this hook does not provide"):
        compile_expr("output * 2", WHERE)(x=torch.ones(2))


def test_x_defaults_to_first_input() -> None:
    torch.testing.assert_close(compile_expr("x + 1", WHERE)(inputs=(torch.zeros(2),)), torch.ones(2))


def test_bare_module_is_refused_with_the_way_to_read_it() -> None:
    with pytest.raises(ConfigError, match="module is read as module.NAME: a parameter, buffer, submodule or number"):
        compile_expr("module", WHERE)


def _shares_storage(value: Any, module: nn.Module) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_shares_storage(item, module) for item in value)
    if not isinstance(value, torch.Tensor):
        return False
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    return value.untyped_storage().data_ptr() in own


MODULE_VALUES = [case for case in ACCEPTED if "module" in case[0]] + [
    ("module.weight", "linear", None),
    ("module.weight.T", "linear", None),
    ("+module.weight.detach()[0]", "linear", None),
    ("module.inner.weight.float().contiguous()", "affine", None),
    ("(x, module.W)", "affine", None),
    ("[module.W, module.scale][0].view(2, 2)", "affine", None),
]


@pytest.mark.parametrize(("text", "module", "_"), MODULE_VALUES, ids=[case[0] for case in MODULE_VALUES])
def test_expression_value_never_shares_the_modules_storage(text: str, module: str, _: Any) -> None:
    """The aliasing decision is made at check time; whatever it decides, no value is the module's own."""
    env = make_env(module)
    assert not _shares_storage(compile_expr(text, WHERE)(**env), env["module"])


def test_values_that_cannot_alias_the_module_are_not_copied() -> None:
    x = torch.ones(3, 2)
    assert compile_expr("x", WHERE).bind("x")(x) is x
    assert compile_expr("x.T", WHERE).bind("x")(x).data_ptr() == x.data_ptr()


def test_bound_function_takes_the_hooks_arguments_in_order() -> None:
    layer, x = nn.Linear(2, 3), torch.randn(4, 2)
    compute = compile_expr("linear(x, module.weight, module.bias) + output", WHERE).bind("module", "inputs", "output")
    torch.testing.assert_close(compute(layer, (x,), torch.ones(4, 3)), layer(x) + 1)
    with pytest.raises(ActionError, match=f"{WHERE}: 'x' failed: tuple index out of range"):
        compile_expr("x", WHERE).bind("inputs")(())


def test_expression_pickles_by_rechecking() -> None:
    expr = pickle.loads(pickle.dumps(compile_expr("x * 2", WHERE, names=("x",))))
    assert (expr.text, expr.where, expr.names_used) == ("x * 2", WHERE, frozenset({"x"}))
    torch.testing.assert_close(expr(x=torch.ones(2)), torch.full((2,), 2.0))


def test_allowlists_name_real_things_and_nothing_in_place() -> None:
    assert set(NAMES) == {"x", "inputs", "output", "grad", "module", "kwargs"}
    assert all(callable(function) for function in FUNCTIONS.values())
    assert all(hasattr(torch.Tensor, name) and not name.endswith("_") for name in TENSOR_METHODS | TENSOR_ATTRIBUTES)
    assert not {"to", "cuda", "numpy", "tolist", "register_hook", "backward", "data", "grad"} & TENSOR_METHODS


INDEXES = [
    ("[:, 3:5]", (slice(None), slice(3, 5))),
    ("[0]", (0,)),
    ("[-1]", (-1,)),
    ("[..., -1]", (Ellipsis, -1)),
    ("[None, :2]", (None, slice(None, 2))),
    ("[1:-1:2, ::3]", (slice(1, -1, 2), slice(None, None, 3))),
    (" [ 0 , 1 ] ", (0, 1)),
]


@pytest.mark.parametrize(("text", "index"), INDEXES, ids=[case[0] for case in INDEXES])
def test_compile_index_accepts_literals(text: str, index: tuple) -> None:
    assert compile_index(text, WHERE) == index


REFUSED_INDEXES = [
    ("0", "0"),
    (":, 3:5", ":, 3:5"),
    ("[x]", "x"),
    ("[1 + 1]", "1 + 1"),
    ("[True]", "True"),
    ("[1.5]", "1.5"),
    ("['a']", "'a'"),
    ("[::-1]", "::-1"),
    ("[::0]", "::0"),
    ("[(0, 1), 2]", "(0, 1)"),
    ("[0][1]", "[0][1]"),
    ("[0] + x[1]", "[0] + x[1]"),
    ("[__import__('os')]", "__import__('os')"),
    ("[", "["),
    ("[" * 60 + "0" + "]" * 60, "[[[["),
]


@pytest.mark.parametrize(("text", "fragment"), REFUSED_INDEXES, ids=[case[0][:20] for case in REFUSED_INDEXES])
def test_compile_index_refuses_everything_else(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_index(text, WHERE)
    assert str(caught.value).startswith(f"{WHERE}: ")
    assert fragment in str(caught.value)


def test_float_comparison_works_in_a_fresh_process() -> None:
    """The first `x > 0.5` of a process runs inside an expression (as in a fresh CLI run) and must still work."""
    code = (
        "import torch; from surgery.expr.check import compile_expr;"
        " print(compile_expr('x > 0.5', 'e')(x=torch.ones(2)))"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]


def test_expression_value_never_aliases_the_module() -> None:
    """A later in-place op in the model must not write into a weight the expression returned."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    before = model[0].weight.detach().clone()
    action = {"w": {"kind": "replace_forward", "type": "Linear", "expr": "module.weight.detach()"}}
    with surgery.apply(model, action):
        model(torch.ones(4, 4))
    assert torch.equal(model[0].weight, before)
