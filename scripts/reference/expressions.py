"""docs/expressions.md: the expression language from surgery/expr/, with the cases of expression_cases.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from scripts.reference.config import table
from scripts.reference.expression_cases import EXAMPLES, GRAMMAR, INDEXES, PLACES, REFUSED, VARIABLES
from surgery.errors import ActionError, ConfigError
from surgery.expr import check as expr
from surgery.expr import parsing
from surgery.expr import runtime as expr_runtime
from surgery.expr import work as expr_work

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


def expression_bindings() -> list[str]:
    """Naming intermediates: ``NAME = expression; ...; result``."""
    return [
        "## Naming intermediates",
        "",
        "An expression may name intermediate values before its result: bindings `NAME = expression`,",
        "separated by `;` or new lines, then the result. An SAE with its error term names the",
        "features and the reconstruction once instead of writing the formula twice:",
        "",
        "```",
        "f = relu((output - module.b_dec) @ module.W_enc + module.b_enc); r = f @ module.W_dec + module.b_dec;"
        " r + (output - r)",
        "```",
        "",
        "Each bound expression is checked like any expression, and may use the names bound before it;",
        "the work bounds above count every binding of an evaluation together, and a result that may be",
        "the module's own tensor (`w = module.weight; w`) is copied as always. Refused, each naming the",
        "binding: a name of the language (a variable such as `x`, or a function such as `relu`), a name",
        "starting with `_`, a name bound twice or never used, anything before the result that is not",
        "`NAME = expression` (`a += x`, `x.y = 1`, `a, b = ...`, statements), and a text that ends with",
        "a binding:",
        "",
        "```",
        refusal(expr.compile_expr, "a = x; b = x; a", "actions.act.expr"),
        "```",
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
            rows.append([code(text), code(index_text(parsing.compile_index(text, "index")))])
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


def expression_bounds() -> list[str]:
    """The resource bounds of one evaluation, from surgery/expr/work.py, with a refusal of each kind."""
    w = expr_work

    def failure(text: str) -> str:
        x = torch.ones(64)  # a 64-element input: each bound at its floor
        try:
            expr.compile_expr(text, "actions.act.expr")(x=x)
        except ActionError as error:
            return str(error)
        raise ValueError(f"{text!r} was expected to fail on a 64-element input")

    rows = [
        ["one value", f"max({w.GROWTH} × N, {w.MIN_ELEMENTS:,}) elements", f"{w.MAX_ELEMENTS:,}"],
        ["all values one evaluation makes", f"max({w.LIVE} × N, {w.MIN_LIVE:,}) elements", f"{w.MAX_LIVE:,}"],
        ["operations, estimated from shapes", f"max({w.WORK} × N^1.5, {w.MIN_WORK:,})", f"{w.MAX_WORK:,}"],
        ["tensors split off by `.split`/`.chunk`", f"{w.MAX_PIECES:,}", f"{w.MAX_PIECES:,}"],
    ]
    return [
        "No expression can make tensors or take time without bound. Each evaluation keeps an account of",
        "what it makes and does, against bounds that grow with N, the element count of the largest tensor it",
        "is given (its variables and the hooked module's own parameters and buffers):",
        "",
        *table(["what", "bound", "never more than"], rows),
        "",
        "Operations are estimated from shapes: one per element made, one per element a reduction reads",
        "(`sum`, `mean`, `amax`, `norm`, ...), `2·m·n·k` for `@`, `matmul` and `linear`, for `einsum`",
        "2 × the product of the sizes of every index in each step of contracting left to right (as torch",
        f"does), and {w.SORT_COST}·n·log2(n) for `sort`, `topk`, `kthvalue` and `quantile`. Views (`expand`,",
        "`transpose`, `view`, slices) make nothing. Why N^1.5: one matrix product of two operands no larger",
        f"than the inputs, whose result keeps the one-value bound, takes at most 8 × N^1.5 operations, so {w.WORK} ×",
        "N^1.5 leaves room for several. `linear(x, module.weight)` on a 4096-wide layer over 4,096 tokens",
        "takes 2^37 of its 2^42; attention scores recomputed with `einsum('bhqd,bhkd->bhqk', q, k)` from",
        "queries and keys of N elements are one such product (while the scores keep the one-value bound).",
        "An expression over a 64-element input stops after about a second of CPU.",
        "",
        "What can make more elements than its operands is checked before it allocates (`expand`,",
        "broadcasting in arithmetic and comparisons, `@`, `matmul`, `linear`, `einsum`, `cat`, `stack`,",
        "`where`, `maximum`, `minimum`, `pow`, `clamp`, `.max`/`.min` of two tensors, indexing with tensors",
        "or lists), and so are the operations of products, reductions and sorts and the pieces of",
        "`.split`/`.chunk`; the elements of every other result are counted as it returns, so an evaluation",
        "overshoots the bound on all values by one value at most. An expression that makes at most",
        f"{w.UNCOUNTED_VALUES} values (`x * sigmoid(x)`) counts nothing after the fact: each value keeps the one-value",
        "bound, so together they keep the bound on all, and its hook runs plain calls. Past a bound the hook",
        "fails with an error naming the action and the expression:",
        "",
        "```",
        failure("x[0].expand(4096, 4096) @ x[0].expand(4096, 4096)"),
        failure("x[0].expand(2**24).split(1)"),
        failure("(-x[0].expand(2**24), -x[0].expand(2**24), -x[0].expand(2**24), -x[0].expand(2**24), -x)"),
        "```",
        "",
        "Literal sizes past a ceiling are refused when the plan is compiled:",
        "",
        "```",
        refusal(expr.compile_expr, "x.flatten()[0].expand(10**11).sum()", "actions.act.expr"),
        refusal(expr.compile_expr, "x.chunk(10**6)", "actions.act.expr"),
        "```",
        "",
    ]


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
        "Where `expr` is not enough, `fn: pkg.module:function` calls Python (under `safe=true`, only the",
        "allowlisted callables of [behaviour.md](behaviour.md#custom-code)).",
        "",
        *expression_bounds(),
    ]
    body = expression_places() + expression_grammar() + expression_bindings() + expression_allowlists()
    body += index_language()
    return "\n".join(header + body + worked_examples()).rstrip() + "\n"
