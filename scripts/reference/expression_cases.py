"""What docs/expressions.md shows by example: places, grammar, refusals and worked examples (the tests run them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from surgery.expr import parsing
from surgery.expr import runtime as expr_runtime
from surgery.models.functions import Function_C


@dataclasses.dataclass(frozen=True)
class Place:
    """Where an expression goes: an action kind, the variables it sees there, and what its value becomes."""

    kind: str
    names: tuple[str, ...]  # what surgery/actions passes to compile_expr; tests/test_reference.py checks it
    becomes: str

    def fields(self, text: str) -> str:
        """The YAML keys that put ``text`` in an action of this kind."""
        return f'expr: "{text}"' if self.kind == "replace_forward" else f'op: expr, expr: "{text}"'


PLACES = {
    place.kind: place
    for place in (
        Place("replace_forward", ("x", "inputs", "output", "module", "kwargs"), "the module's output"),
        Place("modify_output", ("output", "module"), "the output (or its `item`, or the `index` slice of that)"),
        Place("modify_input", ("x", "module"), "positional input `item` (default 0) before forward sees it"),
        Place(
            "modify_grad",
            ("grad", "module"),
            "each gradient w.r.t. the module's inputs (or only `item`); with `param`, that parameter's gradient",
        ),
    )
}

VARIABLES = {
    "x": "`replace_forward`: the first positional input. `modify_input`: the input being modified.",
    "inputs": "`replace_forward`: the tuple of all positional inputs, e.g. `inputs[1]`.",
    "output": "`replace_forward`: the module's own output (forward still runs). `modify_output`: the output"
    " being modified.",
    "grad": "`modify_grad`: the gradient being modified.",
    "module": "The hooked module, read-only (see below).",
    "kwargs": "`replace_forward`: the keyword inputs of the call, read by name: `kwargs['attention_mask']`"
    " (Hugging Face blocks get masks and position ids this way).",
}

# (construct, an example) of what the language allows; the tests compile every example.
GRAMMAR = [
    ("numbers, `True`, `False`, `None`", "x * 0.5 + 1e-6"),
    ("arithmetic `+ - * / // % **`", "(x - x.mean()) / x.std() ** 2"),
    ("matrix product `@`", "x @ module.weight.T + module.bias"),
    ("unary `-`, `+` and `~`", "-x"),
    ("one comparison `== != < <= > >=`", "x >= 0"),
    ("masks combined with `&`, `|`, `^`, `~`", "(x > 0) & ~(x > 1)"),
    ("subscripts and slices, `...` and `None` in them", "output[..., 1:3, None]"),
    ("tuple and list literals", "cat((x, output), dim=-1)"),
    ("calls of the functions below, with keyword arguments", "softmax(output, dim=-1)"),
    ("the tensor methods and attributes below", "x.reshape(2, -1).mean(dim=1) * x.shape[0]"),
    ("`module.NAME`, also through submodules", "module.weight.sum()"),
]

# (construct, examples, why it is refused); the tests check that every example is a ConfigError.
REFUSED = [
    ("`a if c else b`", ["x if x > 0 else 0"], "Python picks one branch for the whole tensor; use `where(c, a, b)`."),
    ("`and`, `or`", ["x > 0 and x < 1"], "they ask a tensor for one truth value; use `&` and `|`."),
    ("`not`", ["not x", "not (x > 0)"], "it asks a tensor for one truth value; use `~`, e.g. `~(x > 0)`."),
    ("chained comparisons", ["0 < x < 1"], "an `and` in disguise; write `(0 < x) & (x < 1)`."),
    ("`is`, `is not`, `in`, `not in`", ["x is None", "x in x"], "not tensor operations; use `== != < <= > >=`."),
    ("shifts `<<`, `>>`", ["x << 2"], "they grow numbers without bound."),
    (
        "strings, bytes, f-strings",
        ["'os'", "b'os'", "f'{x}'"],
        "nothing needs text, and text is how escapes name things.",
    ),
    ("complex numbers", ["x * 3j"], "only real numbers."),
    ("`lambda`", ["lambda: x"], "no functions are defined in a config."),
    ("comprehensions and generator expressions", ["[v for v in x]", "(v for v in x)"], "no loops."),
    ("dict and set literals", ["{'a': x}", "{1, 2}"], "not needed; tuples and lists are."),
    ("`:=`, `=`", ["(y := x)", "x = 1"], "an expression computes a value and assigns nothing."),
    ("`*` and `**` unpacking", ["relu(*inputs)", "relu(**x)"], "arguments are written out."),
    (
        "names and attributes starting with `_`",
        ["x.__class__.__mro__", "module._modules", "__import__('os')"],
        "dunder walks are the classic way out of a Python sandbox, and `_` fields bypass the read-only reads.",
    ),
    (
        "names and functions not listed here",
        ["eval('1')", "open('f')", "getattr(x, 'T')", "type(x)", "globals()"],
        "only the variables and the functions below exist; there are no builtins.",
    ),
    ("a function that is not called", ["relu"], "functions are only called, e.g. `relu(x)`."),
    (
        "tensor methods not listed, in-place methods",
        ["x.add_(1)", "x.copy_(x)", "x.to(2)", "x.numpy()", "x.storage()"],
        "nothing writes in place, moves devices, registers hooks or leaves torch.",
    ),
    (
        "attributes not listed",
        ["x.data", "x.grad", "(1).real", "inputs.count"],
        "tensors have only the attributes below; `.NAME` on anything else is `module.NAME`.",
    ),
    ("calling a call or an attribute", ["x.mean()()", "(x.T)(1)"], "only functions and tensor methods are called."),
    ("keywords `out=`, `inplace=`, `_...=`", ["clamp(x, 0, 1, out=x)", "relu(x, inplace=True)"], "they write."),
    ("indexing a number, `...` outside `[ ]`", ["1[0]", "x + ..."], "mistakes, refused with a clear message."),
    (
        "huge or non-finite constant arithmetic",
        ["9 ** 9 ** 9", "2 ** (2 ** 100)", "10 ** 100000", "1 / 0", "1e999", "(-8) ** 0.5"],
        f"number-only arithmetic is computed when the plan is compiled: an exponent over {expr_runtime.MAX_EXPONENT} in"
        " absolute value, or a result that is not a finite real number, is refused instead of hanging.",
    ),
    ("text longer than the limit", [], f"more than {parsing.MAX_LENGTH} characters."),
    ("nesting deeper than the limit", [], f"brackets or operators nested more than {parsing.MAX_DEPTH} levels."),
]


def _function_with_bias() -> nn.Module:
    """The seeds' ``Function_C`` (x * W) after ``add_parameter`` has given it ``b``."""
    function = Function_C(3.0)
    function.b = nn.Parameter(torch.tensor([1.0]))
    return function


@dataclasses.dataclass(frozen=True)
class Example:
    """A worked example: the action it goes in, what it computes, and the same computation in plain torch."""

    name: str
    kind: str
    target: str  # the YAML keys that choose the modules (and parameter)
    text: str
    meaning: str
    module: Callable[[], nn.Module]  # a module it suits, for tests/test_reference.py
    expected: Callable[[Any], Any]  # plain torch on the variables (attributes of the argument), for the tests

    def yaml(self) -> str:
        """The action as one line of an actions file."""
        return f"{self.name}: {{kind: {self.kind}, {self.target}, {PLACES[self.kind].fields(self.text)}}}"


EXAMPLES = [
    Example(
        "linear",
        "replace_forward",
        'type: "Function_*"',
        "x * module.W + module.b",
        "The seeds' exercise: every `Function_*` computes `x * W + b` with its own `W` and the `b` that"
        " `add_parameter` gave it.",
        _function_with_bias,
        lambda e: e.x * e.module.W + e.module.b,
    ),
    Example(
        "prune",
        "replace_forward",
        "type: Linear",
        "linear(x, module.weight * (module.weight.abs() > 0.05), module.bias)",
        "Each `Linear` runs as if its weights under 0.05 in magnitude were zero; the stored weights stay as they are.",
        lambda: nn.Linear(4, 4),
        lambda e: F.linear(e.x, e.module.weight * (e.module.weight.abs() > 0.05), e.module.bias),
    ),
    Example(
        "residual",
        "replace_forward",
        "type: Linear",
        "output + x",
        "A residual connection around each `Linear` (input and output of the same size).",
        lambda: nn.Linear(4, 4),
        lambda e: e.module(e.x) + e.x,
    ),
    Example(
        "rmsnorm",
        "replace_forward",
        "type: LayerNorm",
        "x * rsqrt(mean(x ** 2, dim=-1, keepdim=True) + module.eps) * module.weight",
        "Each `LayerNorm` becomes an RMSNorm with the same weight and `eps`.",
        lambda: nn.LayerNorm(4),
        lambda e: e.x * torch.rsqrt(e.x.pow(2).mean(-1, keepdim=True) + e.module.eps) * e.module.weight,
    ),
    Example(
        "leaky",
        "replace_forward",
        "type: GELU",
        "where(x > 0, x, 0.01 * x)",
        "Each `GELU` becomes a leaky ReLU.",
        nn.GELU,
        lambda e: F.leaky_relu(e.x, 0.01),
    ),
    Example(
        "temperature",
        "modify_output",
        "type: Linear",
        "softmax(output / 2.0, dim=-1)",
        "The logits become probabilities at temperature 2.",
        lambda: nn.Linear(4, 4),
        lambda e: torch.softmax(e.output / 2, dim=-1),
    ),
    Example(
        "winner",
        "modify_output",
        "type: Linear",
        "where(output == output.amax(dim=-1, keepdim=True), output, 0.0)",
        "Winner takes all: only the largest unit of each row keeps its value.",
        lambda: nn.Linear(4, 4),
        lambda e: e.output * F.one_hot(e.output.argmax(-1), 4),
    ),
    Example(
        "unit",
        "modify_input",
        "type: Linear",
        "x / norm(x, dim=-1, keepdim=True).clamp(min=1e-6)",
        "Each `Linear` sees its input rows scaled to unit length.",
        lambda: nn.Linear(4, 4),
        lambda e: F.normalize(e.x, dim=-1, eps=1e-6),
    ),
    Example(
        "sign_grad",
        "modify_grad",
        "type: Linear",
        "sign(grad) * grad.abs().mean()",
        "signSGD-style: the gradient flowing back through each `Linear` keeps its signs and its mean magnitude.",
        lambda: nn.Linear(4, 4),
        lambda e: e.grad.sign() * e.grad.abs().mean(),
    ),
    Example(
        "masked_grad",
        "modify_grad",
        "type: Linear, param: weight",
        "grad * (module.weight.abs() > 0.05)",
        "Only weights over 0.05 in magnitude get a gradient; the gradient of the others is zero.",
        lambda: nn.Linear(4, 4),
        lambda e: e.grad * (e.module.weight.abs() > 0.05),
    ),
]

INDEXES = ["[:, 3:5]", "[0]", "[-1]", "[..., -1]", "[None, :2]", "[1:-1:2, ::3]", "[x]", "[1 + 1]", "[::-1]", "[0.5]"]
