"""Write docs/config.md and docs/expressions.md from the code: schemas, kind registry, conf/ and surgery/expr/.

``python scripts/gen_reference.py`` writes both; ``--check`` exits 1 when either is out of date.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from omegaconf import MISSING
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout's code, even where another surgery is installed

from surgery.actions import KINDS  # noqa: E402
from surgery.core import schema  # noqa: E402
from surgery.core.paths import config_dir, group_options  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from surgery.expr import check as expr  # noqa: E402
from surgery.expr import runtime as expr_runtime  # noqa: E402
from surgery.models.functions import Function_C  # noqa: E402

DOC = ROOT / "docs" / "config.md"
EXPR_DOC = ROOT / "docs" / "expressions.md"
GROUPS = ("model", "actions", "input", "experiment")
RUN_CHOICES = {"mode": schema.MODES, "loss": schema.LOSSES, "dtype": schema.DTYPES}
KIND_CHOICES = {  # kind -> (its key, the schema tuple of values that key accepts)
    "init": ("method", schema.INIT_METHODS),
    "add_parameter": ("init.method", schema.INIT_METHODS),
    "add_buffer": ("init.method", schema.INIT_METHODS),
    "modify_output": ("op", schema.TENSOR_OPS),
    "modify_input": ("op", schema.TENSOR_OPS),
    "modify_grad": ("op", schema.GRAD_OPS),
    "replace_forward": ("fn", schema.FORWARD_FNS),
}
# A field line of a dataclass body, `    name: type = default  # comment`; methods are indented deeper.
FIELD_COMMENT = re.compile(r"^    (\w+):[^#\n]*#\s*(.*)$", re.MULTILINE)


def line_comments(cls: type) -> dict[str, str]:
    """The trailing comment of each field line of ``cls`` and its dataclass bases; the nearest class wins."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            comments.update(FIELD_COMMENT.findall(inspect.getsource(base)))
    return comments


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value, calling its factory; MISSING when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def yaml_text(value: Any) -> str:
    """A value as it would be written in a YAML config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return str(value)


def field_rows(cls: type, skip: frozenset[str] = frozenset(), prefix: str = "", values: Any = None) -> list[list[str]]:
    """(key, type, default, comment) per field of a dataclass; a nested dataclass becomes ``key.field`` rows."""
    comments = line_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = default_of(f) if values is None else getattr(values, f.name)
        if dataclasses.is_dataclass(value):
            rows += field_rows(type(value), prefix=f"{prefix}{f.name}.", values=value)
            continue
        default = "required" if value == MISSING else f"`{yaml_text(value)}`"
        rows.append([f"`{prefix}{f.name}`", f"`{f.type}`", default, comments.get(f.name, "")])
    return rows


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; pipes inside cells are escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", r"\|") for cell in row) + " |" for row in rows]
    return lines


def choices(key: str, values: tuple[str, ...]) -> str:
    """One line naming the values ``key`` accepts."""
    return f"- `{key}`: one of " + ", ".join(f"`{v}`" for v in values)


def description(path: Path) -> str:
    """The leading comment block of a YAML file, as one line (``# @package`` directives skipped)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring on one line, with reST ``code`` as Markdown `code`."""
    text = inspect.cleandoc(doc or "").split("\n\n")[0]
    return " ".join(text.split()).replace("``", "`")


def run_settings() -> list[str]:
    """The run settings section."""
    return [
        "## Run settings",
        "",
        "Top-level keys of `conf/config.yaml`; override any of them on the command line, e.g. `mode=plan`.",
        "",
        *table(["key", "type", "default", "meaning"], field_rows(schema.RunSettings)),
        "",
        "Allowed values:",
        "",
        *(choices(key, values) for key, values in RUN_CHOICES.items()),
        "",
    ]


def common_keys() -> list[str]:
    """The keys every action has."""
    return [
        "## Keys every action has",
        "",
        "An actions file (`conf/actions/NAME.yaml`) maps action names to actions, applied in order.",
        "",
        *table(["key", "type", "default", "meaning"], field_rows(schema.Action)),
        "",
    ]


def kinds() -> list[str]:
    """A summary of the action kinds, then one section per kind with its own keys."""
    unknown = set(KIND_CHOICES) - set(KINDS.names())
    if unknown:
        raise ValueError(f"KIND_CHOICES names kinds that are not registered: {', '.join(sorted(unknown))}")
    common = frozenset(f.name for f in dataclasses.fields(schema.Action))
    summary = [[f"[`{name}`](#{name})", KINDS.get(name).mechanism] for name in KINDS.names()]
    lines = ["## Action kinds", "", *table(["kind", "PyTorch mechanism"], summary), ""]
    for name in KINDS.names():
        kind = KINDS.get(name)
        if not kind.__doc__:
            raise ValueError(f"action kind {name!r} ({kind.__qualname__}) has no docstring")
        rows = field_rows(kind.schema, skip=common)
        lines += [f"### `{name}`", "", first_paragraph(kind.__doc__), ""]
        lines += [f"Mechanism: {kind.mechanism}. Schema: `surgery.core.schema.{kind.schema.__name__}`.", ""]
        lines += [*table(["key", "type", "default", "meaning"], rows), ""] if rows else ["No keys of its own.", ""]
        if name in KIND_CHOICES:
            key, values = KIND_CHOICES[name]
            if f"`{key}`" not in [row[0] for row in rows]:
                raise ValueError(f"KIND_CHOICES: kind {name!r} has no key {key!r}")
            lines += [choices(key, values), ""]
    return lines


def config_groups() -> list[str]:
    """The options of each config group with the description at the top of its file."""
    lines = ["## Config groups", "", "Choose one option of a group with `+GROUP=NAME`, e.g. `+model=cnn`.", ""]
    for group in GROUPS:
        options = group_options(group)
        rows = [[f"`{option}`", description(config_dir() / group / f"{option}.yaml")] for option in options]
        lines += [f"### `{group}`", ""]
        lines += [*table(["option", "description"], rows), ""] if rows else ["No options yet.", ""]
    return lines


def render() -> str:
    """The whole reference as Markdown."""
    header = [
        "# Config reference",
        "",
        "Generated from the code by `python scripts/gen_reference.py`: do not edit by hand.",
        "",
    ]
    return "\n".join(header + run_settings() + common_keys() + kinds() + config_groups()).rstrip() + "\n"


# ---- docs/expressions.md ------------------------------------------------------------------------------------------


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
        Place("replace_forward", ("x", "inputs", "output", "module"), "the module's output"),
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
    ("text longer than the limit", [], f"more than {expr.MAX_LENGTH} characters."),
    ("nesting deeper than the limit", [], f"brackets or operators nested more than {expr.MAX_DEPTH} levels."),
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
WHERE = "actions.NAME.expr"


def refusal(compile_text: Callable[[str, str], Any], text: str, where: str = WHERE) -> str:
    """The ConfigError message for ``text``, or raise when it is accepted."""
    try:
        compile_text(text, where)
    except ConfigError as error:
        return str(error)
    raise ValueError(f"{text!r} was expected to be refused but is accepted")


def torch_name(function: Callable[..., Any]) -> str:
    """The public torch name of an expression function; a wrapper ``_name`` in surgery.expr.runtime drops
    ``inplace``."""
    if function.__module__ == expr_runtime.__name__:
        wrapped = function.__name__.lstrip("_")
        if not callable(getattr(F, wrapped, None)):
            raise ValueError(f"surgery.expr.runtime.{function.__name__} wraps no torch.nn.functional.{wrapped}")
        return f"`torch.nn.functional.{wrapped}` without its `inplace` argument"
    for prefix, namespace in (("torch", torch), ("torch.nn.functional", F), ("torch.linalg", torch.linalg)):
        found = sorted(name for name, value in vars(namespace).items() if value is function and name[0] != "_")
        if found:
            return f"`{prefix}.{found[0]}`"
    raise ValueError(f"cannot find {function!r} in torch, torch.nn.functional or torch.linalg")


def index_text(index: tuple[Any, ...]) -> str:
    """A compiled index as the Python value it is."""

    def part(value: Any) -> str:
        if isinstance(value, slice):
            bounds = [value.start, value.stop] + ([value.step] if value.step is not None else [])
            return f"slice({', '.join(map(str, bounds))})"
        return "..." if value is Ellipsis else str(value)

    return "(" + ", ".join(map(part, index)) + ("," if len(index) == 1 else "") + ")"


def code(text: str) -> str:
    """Inline Markdown code that survives backticks inside."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def expression_places() -> list[str]:
    """Where expressions go and the variables each place gives them."""
    if set(VARIABLES) != set(expr.NAMES) or {n for p in PLACES.values() for n in p.names} != set(expr.NAMES):
        raise ValueError(f"VARIABLES and PLACES must describe exactly surgery.expr.check.NAMES: {expr.NAMES}")
    rows = [[f"`{p.kind}`", ", ".join(f"`{n}`" for n in p.names), p.becomes] for p in PLACES.values()]
    examples = {kind: next(e for e in EXAMPLES if e.kind == kind) for kind in PLACES}
    return [
        "## Where expressions go",
        "",
        *table(["action kind", "variables", "the expression's value replaces"], rows),
        "",
        "In an actions file (`conf/actions/NAME.yaml`):",
        "",
        "```yaml",
        *(example.yaml() for example in examples.values()),
        "```",
        "",
        "With `index` (modify kinds), the variable holds only that slice and only that slice changes.",
        "",
        "## Variables",
        "",
        *table(["name", "holds"], [[f"`{name}`", VARIABLES[name]] for name in expr.NAMES]),
        "",
        "`module.NAME` reads the module's own parameters and buffers (the tensors themselves), its",
        "submodules (read the same way, so `module.inner.weight` works) and its plain numbers:",
        "ints, floats, bools and tuples of them, such as `module.eps` or `module.normalized_shape`",
        "of a `LayerNorm`. Methods, other objects and names starting with `_` are not readable, and",
        "nothing can be set or deleted. `module` is only read as `module.NAME`: alone (`relu(module)`)",
        "it is refused, and a value that is a whole submodule (`module.inner`) is an error when the hook",
        "runs. A name the module does not have is an error when the hook runs, listing the names it does have.",
        "",
        "When the expression's value is one of the module's own tensors or a view of one",
        "(`module.weight`, `module.weight.detach()`), it is copied, so the model can never write into it.",
        "Whether a copy is needed is decided once, when the expression is checked, from its shape: a",
        "value reached from `module.NAME` through indexing, `.T`/`.mT`, `+` or a method that may return a",
        "view is copied; arithmetic and functions make new tensors and are not. So an expression runs as",
        "one plain function in the hook and torch.compile traces it, `module.NAME` reads included,",
        "without a graph break.",
        "",
    ]


def expression_grammar() -> list[str]:
    """What the language allows and what it refuses, with why."""
    refused = [[what, ", ".join(code(t) for t in texts) or "—", why] for what, texts, why in REFUSED]
    return [
        "## Grammar",
        "",
        "An expression is one Python expression, restricted to:",
        "",
        *table(["allowed", "example"], [[what, code(text)] for what, text in GRAMMAR]),
        "",
        "Arithmetic on plain numbers is computed once, when the plan is compiled (`2 ** 10` becomes",
        "`1024`). When the hook runs, `**` between Python numbers (`x.ndim ** 2`) has the same guard",
        "as at compile time, `*` refuses to repeat a tuple or list (`inputs * 3`), and `.NAME` works",
        "only on tensors and on `module`; these are errors naming the action and the expression.",
        "",
        "Refused when the plan is compiled, each with a message naming the action key and quoting the",
        "offending part:",
        "",
        *table(["refused", "examples", "why"], refused),
        "",
    ]


def expression_allowlists() -> list[str]:
    """The functions, tensor methods and tensor attributes, straight from surgery.expr.check."""
    rows = [[f"`{name}`", torch_name(function)] for name, function in sorted(expr.FUNCTIONS.items())]
    return [
        "## Functions",
        "",
        "Called by name, e.g. `relu(x)`; `norm` is the vector norm.",
        "",
        *table(["name", "calls"], rows),
        "",
        "## Tensor methods",
        "",
        "Called on a tensor, e.g. `x.flatten(1)`; nothing in place, no device moves, no hooks:",
        "",
        ", ".join(f"`{name}`" for name in sorted(expr.TENSOR_METHODS)),
        "",
        "## Tensor attributes",
        "",
        ", ".join(f"`{name}`" for name in sorted(expr.TENSOR_ATTRIBUTES)),
        "",
    ]


def index_language() -> list[str]:
    """The literal subscripts of ``index``, with what each compiles to or why it is refused."""
    rows = []
    for text in INDEXES:
        try:
            rows.append([code(text), code(index_text(expr.compile_index(text, "index")))])
        except ConfigError as error:
            rows.append([code(text), "refused: " + str(error).removeprefix("index: ")])
    return [
        "## `index` subscripts",
        "",
        "The modify kinds take `index`, a subscript applied before the op so only that slice",
        "changes. It is a literal, never evaluated: integers (negative too), slices of integers with",
        "positive steps, `...` and `None`, in brackets.",
        "",
        *table(["index", "means"], rows),
        "",
    ]


def worked_examples() -> list[str]:
    """The examples with their YAML; tests/test_reference.py runs each one."""
    lines = ["## Worked examples", ""]
    for number, example in enumerate(EXAMPLES, 1):
        indent = " " * len(f"{number}. ")  # a list item's blocks line up with its text
        lines += [
            f"{number}. {example.meaning}",
            "",
            f"{indent}```yaml",
            f"{indent}{example.yaml()}",
            f"{indent}```",
            "",
        ]
    return lines


def render_expressions() -> str:
    """The expression language reference as Markdown."""
    header = [
        "# Expressions",
        "",
        "Generated from `surgery/expr/check.py` and `surgery/expr/runtime.py` by `python scripts/gen_reference.py`:"
        " do not edit by hand.",
        "",
        "An `expr` is one line of Python-like arithmetic over tensors, such as `x * module.W + module.b`",
        "or `softmax(output, dim=-1)`. It is parsed and checked against the allowlists below when the",
        "plan is compiled, before the model is touched, and compiled once so hooks run it fast; config",
        "text is never evaluated unchecked. Anything not allowed is a config error naming the action",
        "key and quoting the offending text:",
        "",
        "```",
        refusal(expr.compile_expr, "x.__class__.__mro__", "actions.act.expr"),
        "```",
        "",
        "Where `expr` is not enough, `fn: pkg.module:function` calls Python (refused under `safe=true`).",
        "",
    ]
    body = expression_places() + expression_grammar() + expression_allowlists() + index_language()
    return "\n".join(header + body + worked_examples()).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/config.md and docs/expressions.md, or with ``--check`` return 1 when either is out of date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated doc is out of date")
    args = parser.parse_args(argv)
    docs = {DOC: render(), EXPR_DOC: render_expressions()}
    if args.check:
        stale = [path.name for path, text in docs.items() if not path.is_file() or path.read_text() != text]
        for name in stale:
            print(f"{name} is out of date: run python scripts/gen_reference.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in docs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
