"""The expression checker, table by table: einsum against torch.einsum, exact refusal messages, aliasing, binding."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import surgery
from surgery.errors import ActionError, ConfigError
from surgery.expr.check import FUNCTIONS, NAMES, TENSOR_ATTRIBUTES, TENSOR_METHODS, compile_expr

WHERE = "actions.demo.expr"
OPERANDS = ("x", "output", "grad")  # einsum operands, in order, each of the rank the case gives


def _operands(ranks: tuple[int, ...]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shapes = {0: (), 1: (3,), 2: (3, 3), 3: (2, 3, 3)}
    return {name: torch.randn(shapes[rank]) for name, rank in zip(OPERANDS, ranks)}


def _einsum_text(equation: str, count: int) -> str:
    return f"einsum({equation!r}, {', '.join(OPERANDS[:count])})" if count else f"einsum({equation!r})"


# (equation, operand ranks): torch.einsum accepts each, and so does the checker, with torch's own numbers
EINSUM_ACCEPTED = [
    ("ij,jk->ik", (2, 2)),
    ("ij,jk", (2, 2)),  # no '->': torch's implicit output
    ("ij->ji", (2,)),
    ("IJ->JI", (2,)),
    ("iJ,Jk->ik", (2, 2)),
    ("i j -> j i", (2,)),
    (" ij , jk -> ik ", (2, 2)),
    ("ii->i", (2,)),
    ("ij->", (2,)),
    ("i,j->ij", (1, 1)),
    ("...ij->...ji", (3,)),
    ("...->...", (3,)),
    ("b...,b...->b...", (3, 3)),
    ("...ij,...jk->...ik", (3, 3)),
    ("ij->...ij", (2,)),
    ("->", (0,)),
    ("i,->i", (1, 0)),
    ("ij,jk,kl->il", (2, 2, 2)),
]


@pytest.mark.parametrize(("equation", "ranks"), EINSUM_ACCEPTED, ids=[case[0] for case in EINSUM_ACCEPTED])
def test_einsum_the_checker_accepts_runs_as_torch_einsum(equation: str, ranks: tuple[int, ...]) -> None:
    env = _operands(ranks)
    got = compile_expr(_einsum_text(equation, len(ranks)), WHERE)(**env)
    assert torch.equal(got, torch.einsum(equation, *env.values()))


MESSAGE_LETTERS = "an einsum equation uses letters, ',', '->' and '...' only, e.g. 'bij,bjk->bik'"
MESSAGE_ARROWS = "an einsum equation has at most one '->'"
# (equation, operand ranks, the checker's reason): refused before any model runs
EINSUM_REFUSED = [
    ("", (2,), MESSAGE_LETTERS),
    ("ij#", (2,), MESSAGE_LETTERS),
    ("i1->i", (1,), MESSAGE_LETTERS),
    ("i=>i", (1,), MESSAGE_LETTERS),
    ("é->é", (1,), MESSAGE_LETTERS),
    ("i->i->i", (1,), MESSAGE_ARROWS),
    ("ij-k", (2,), MESSAGE_ARROWS),
    ("ij>k", (2,), MESSAGE_ARROWS),
    ("i-->i", (1,), MESSAGE_ARROWS),
    ("ij,jk->ik", (2,), "the equation names 2 operand(s), the call gives 1"),
    ("ij->ji", (2, 2), "the equation names 1 operand(s), the call gives 2"),
    ("ij,jk->ik", (2, 2, 2), "the equation names 2 operand(s), the call gives 3"),
    ("...i...->i", (2,), "'...i...': each term is letters with at most one '...'"),
    ("...ij...", (2,), "'...ij...': each term is letters with at most one '...'"),
    ("i......->i", (1,), "'i......': each term is letters with at most one '...'"),
    ("i..j->ij", (2,), "'i..j': each term is letters with at most one '...'"),
    ("i.j->ij", (2,), "'i.j': each term is letters with at most one '...'"),
    ("ij->i.j", (2,), "'i.j': each term is letters with at most one '...'"),
    ("ij->ik", (2,), "the output 'ik' must use each input letter at most once; k is in no input"),
    ("ij->lk", (2,), "the output 'lk' must use each input letter at most once; k, l is in no input"),
    ("ij->ii", (2,), "the output 'ii' must use each input letter at most once"),
    ("ij->iik", (2,), "the output 'iik' must use each input letter at most once; k is in no input"),
]


@pytest.mark.parametrize(
    ("equation", "ranks", "reason"), EINSUM_REFUSED, ids=[case[0] or "<empty>" for case in EINSUM_REFUSED]
)
def test_einsum_the_checker_refuses_is_refused_by_torch_too(equation: str, ranks: tuple[int, ...], reason: str) -> None:
    text = _einsum_text(equation, len(ranks))
    with pytest.raises(ConfigError) as caught:
        compile_expr(text, WHERE)
    assert str(caught.value) == f"{WHERE}: '{text}': {reason}"
    with pytest.raises(RuntimeError):  # with operands of these ranks, torch refuses it as well
        torch.einsum(equation, *_operands(ranks).values())


def test_the_empty_einsum_equation_is_refused_though_torch_takes_it_for_scalars() -> None:
    """The one difference from torch: '' is refused even where torch would sum a 0-d tensor into itself."""
    assert torch.equal(torch.einsum("", torch.tensor(2.0)), torch.tensor(2.0))
    with pytest.raises(ConfigError, match=f"^{WHERE}: 'einsum\\(''\\)': an einsum equation uses letters"):
        compile_expr("einsum('')", WHERE)


LITERAL_FIRST = "einsum takes a literal equation first, then tensors: einsum('ij,jk->ik', a, b)"


@pytest.mark.parametrize(
    "text",
    ["einsum()", "einsum(x, x)", "einsum(2, x)", "einsum('i->i', x, out=x)", "einsum('i->i', x, equation='i')"],
)
def test_einsum_needs_a_literal_equation_and_no_keywords(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_expr(text, WHERE)
    assert str(caught.value) == f"{WHERE}: '{text}': {LITERAL_FIRST}"


@pytest.mark.parametrize(
    ("text", "segment", "reason"),
    [
        ("relu(einsum(x, x))", "einsum(x, x)", LITERAL_FIRST),
        ("relu(einsum('ij,jk->ik', x))", "einsum('ij,jk->ik', x)", "the equation names 2 operand(s), the call gives 1"),
    ],
)
def test_einsum_refusal_inside_a_larger_expression_quotes_the_call(text: str, segment: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_expr(text, WHERE)
    assert str(caught.value) == f"{WHERE}: '{segment}' in '{text}': {reason}"


def test_einsum_result_is_bounded_before_it_is_made() -> None:
    """An outer product of two 8,192-element vectors has 2**26 elements: more than 16 × the largest input."""
    grow = compile_expr("einsum('i,j->ij', x, output)", WHERE)
    with pytest.raises(ActionError) as caught:
        grow(x=torch.ones(2**13), output=torch.ones(2**13))
    assert str(caught.value) == (
        f"{WHERE}: 'einsum('i,j->ij', x, output)' failed: it would create a tensor of 67,108,864 elements, more than"
        " the 16,777,216 an expression may create here (at most 16 × its largest input, at least 16,777,216,"
        " never more than 68,719,476,736)"
    )
    small = grow(x=torch.arange(3.0), output=torch.arange(2.0))
    assert torch.equal(small, torch.einsum("i,j->ij", torch.arange(3.0), torch.arange(2.0)))


def test_einsum_in_a_replace_forward_action_matches_plain_torch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(5, 4)
    want = torch.einsum("bi,oi->bo", x, model[0].weight) + model[0].bias
    action = {"e": {"kind": "replace_forward", "type": "Linear", "expr": "einsum('bi,oi->bo', x, module.weight)"
                    " + module.bias"}}  # fmt: skip
    with surgery.apply(model, action):
        got = model(x)
    assert torch.equal(got, want)


# (expression, the exact refusal after the WHERE prefix): a part of a larger expression is quoted with its context
EXACT_REFUSALS = [
    ("x + ...", "'...' in 'x + ...': '...' is only allowed inside [ ]"),
    ("x + 'a'", "''a'' in 'x + 'a'': str values are not allowed, only numbers"),
    ("x['a']", "''a'' in 'x['a']': str values are not allowed, only numbers"),
    ("x * 1e999", "'1e999' in 'x * 1e999': numbers must be finite and fit in a float"),
    (
        "relu(module)",
        "'module' in 'relu(module)': module is read as module.NAME: a parameter, buffer, submodule or number",
    ),
    ("x + relu", "'relu' in 'x + relu': function 'relu' must be called, e.g. relu(x)"),
    ("x + yy", "'yy' in 'x + yy': unknown name 'yy'. Variables: x, inputs, output, grad, module, kwargs"),
    (
        "x + outptu",
        "'outptu' in 'x + outptu': unknown name 'outptu'. Did you mean 'output' or 'softplus'? Variables: "
        "x, inputs, output, grad, module, kwargs",
    ),  # fmt: skip
    ("relu(not x)", "'not x' in 'relu(not x)': 'not' does not work on tensors; use ~, e.g. ~(x > 0) (logical_not)"),
    ("relu(x << 2)", "'x << 2' in 'relu(x << 2)': this operator is not allowed"),
    (
        "x * (1e300 * 1e300)",
        "'1e300 * 1e300' in 'x * (1e300 * 1e300)': cannot compute (the result is not a finite real number)",
    ),  # fmt: skip
    (
        "relu(0 < x < 1)",
        "'0 < x < 1' in 'relu(0 < x < 1)': chained comparisons do not work on tensors; write (a < x) & (x < b)",
    ),  # fmt: skip
    (
        "relu(x is None)",
        "'x is None' in 'relu(x is None)': 'is' and 'in' are not allowed; compare with == != < <= > >=",
    ),
    ("x + 1[0]", "'1[0]' in 'x + 1[0]': numbers cannot be indexed"),
    ("relu(x._version)", "'x._version' in 'relu(x._version)': names starting with '_' are not allowed ('._version')"),
    (
        "relu(x.data)",
        "'x.data' in 'relu(x.data)': '.data' cannot be read; tensors have "
        f"{', '.join(sorted(TENSOR_ATTRIBUTES))} and module.NAME reads the module's parameters, buffers and numbers",
    ),
    ("relu(foo(x))", f"'foo(x)' in 'relu(foo(x))': unknown function 'foo'. Functions: {', '.join(FUNCTIONS)}"),
    (
        "relu(x.foo())",
        "'x.foo()' in 'relu(x.foo())': unknown tensor method '.foo()'. Did you mean 'float'? In-place"
        f" methods are never allowed. Methods: {', '.join(sorted(TENSOR_METHODS))}",
    ),  # fmt: skip
    ("relu(x.mean()())", "'x.mean()()' in 'relu(x.mean()())': only functions and tensor methods can be called"),
    ("relu(x, **x)", "'**x' in 'relu(x, **x)': '**' unpacking is not allowed"),
    ("relu(x, _a=1)", "'_a=1' in 'relu(x, _a=1)': keyword '_a' is not allowed"),
    ("await x", "'await x': Await is not allowed"),
    ("relu(await x)", "'await x' in 'relu(await x)': Await is not allowed"),
    (
        "relu(x.expand(10**11))",
        "'x.expand(10**11)' in 'relu(x.expand(10**11))': 100,000,000,000 elements are more than"
        " 68,719,476,736, the most an expression may ever create",
    ),  # fmt: skip
    (
        "x.flatten()[0].expand(2**36 + 1)",
        "'x.flatten()[0].expand(2**36 + 1)': 68,719,476,737 elements are more than"
        " 68,719,476,736, the most an expression may ever create",
    ),  # fmt: skip
    ("-" * 49 + "x", f"'x' in '{'-' * 49}x': expression is nested deeper than 50 levels"),
    ("x + " + "-" * 48 + "x", f"'x' in 'x + {'-' * 48}x': expression is nested deeper than 50 levels"),
    (
        "(x, x, x, x, x, x, x, x, x, x, " + "-" * 48 + "x)",
        "'x' in '(x, x, x, x, x, x, x, x, x, x, " + "-" * 48 + "x...': expression is nested deeper than 50 levels",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("text", "message"), EXACT_REFUSALS, ids=[case[0][:40] for case in EXACT_REFUSALS])
def test_refusal_message_is_exact(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_expr(text, WHERE)
    assert str(caught.value) == f"{WHERE}: {message}"


@pytest.mark.parametrize(
    "text",
    [
        "-" * 48 + "x",
        "x + " + "-" * 47 + "x",
        "(x, x, x, x, x, x, x, x, x, x, " + "-" * 47 + "x)",
        "cat([" + "x, " * 200 + "x]).sum()",
    ],  # fmt: skip
    ids=["chain-48", "after-a-sibling-47", "after-ten-siblings-47", "wide"],
)
def test_nesting_up_to_the_limit_and_wide_expressions_are_accepted(text: str) -> None:
    assert compile_expr(text, WHERE)(x=torch.ones(2)) is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x.flatten()[0].expand(2**36)", "it would create a tensor of 68,719,476,736 elements"),  # exactly the bound
        ("x.flatten()[:1].expand(-1, 2**35 + 1)", "it would create a tensor of 34,359,738,369 elements"),
        ("x.flatten()[0].expand(x.shape[0], 2**40)", "it would create a tensor of 2,199,023,255,552 elements"),
        ("x.flatten()[0].expand(1e12)", "expand(): argument 'size' (position 1) must be tuple of ints, not float"),
    ],
)
def test_expand_sizes_not_known_past_the_bound_are_checked_when_the_hook_runs(text: str, message: str) -> None:
    expr = compile_expr(text, WHERE)  # within the absolute bound, or not all int literals: no ConfigError now
    with pytest.raises(ActionError) as caught:
        expr(x=torch.ones(2, 3))
    assert str(caught.value).startswith(f"{WHERE}: '{text}' failed: {message}")


def test_expand_to_a_size_computed_from_the_input_runs() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(compile_expr("x.flatten()[1].expand(x.numel())", WHERE)(x=x), torch.ones(6))


def test_kwargs_are_read_by_name_and_other_indexes_by_value() -> None:
    bias = torch.arange(3.0)
    assert torch.equal(compile_expr("kwargs['bias'] * 2", WHERE)(kwargs={"bias": bias}), bias * 2)
    inputs = (torch.zeros(2), torch.ones(2))
    assert torch.equal(compile_expr("inputs[x.ndim - 1]", WHERE)(inputs=inputs, x=torch.ones(1, 1)), inputs[1])


def _shares_storage(value: torch.Tensor, module: nn.Module) -> bool:
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    return value.untyped_storage().data_ptr() in own


# (expression, the same in plain torch): views of the module's tensors, which must come back as copies
MODULE_VIEWS = [
    ("module.weight[x.shape[0] - 3]", lambda m: m.weight[0]),
    ("module.weight.expand(2, -1, -1)", lambda m: m.weight.expand(2, -1, -1)),
    ("module.weight.detach().T", lambda m: m.weight.T),
    ("module.weight.detach().mT", lambda m: m.weight.mT),
]


@pytest.mark.parametrize(("text", "plain"), MODULE_VIEWS, ids=[case[0] for case in MODULE_VIEWS])
def test_a_view_of_a_module_tensor_comes_back_as_a_copy(text: str, plain: Any) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    got = compile_expr(text, WHERE)(x=torch.ones(3, 2), module=layer)
    assert torch.equal(got, plain(layer).detach())
    assert not _shares_storage(got, layer)


class _CountClones(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.clones = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.clones += getattr(func, "__name__", "") == "clone"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "text", ["relu(x)", "module.W.abs()", "module.W.clamp(0, 1)", "x[x.shape[0] - 3]", "x.T", "module.W.sum()"]
)
def test_a_value_that_cannot_alias_the_module_is_not_copied(text: str) -> None:
    """Copies are made only where the check found the value may be the module's own (a cost, not a guarantee)."""
    module = nn.Module()
    module.W = nn.Parameter(torch.arange(4.0) - 1)
    with _CountClones() as counted:
        compile_expr(text, WHERE)(x=torch.ones(3, 4), module=module)
    assert counted.clones == 0


def test_bind_compiles_once_per_argument_order() -> None:
    expr = compile_expr("x + output", WHERE)
    assert expr.bind("x", "output") is expr.bind("x", "output")
    assert expr.bind("output", "x") is not expr.bind("x", "output")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (("output",), "cannot bind ('output',) for 'x + 1' (uses ['x'])"),
        (("x", "bogus"), "cannot bind ('x', 'bogus') for 'x + 1' (uses ['x'])"),
    ],
)
def test_bind_refuses_missing_or_unknown_names(params: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        compile_expr("x + 1", WHERE).bind(*params)
    assert str(caught.value) == f"{WHERE}: {message}"


def test_bind_takes_every_name() -> None:
    run = compile_expr("x + 1", WHERE).bind(*NAMES)
    assert torch.equal(run(torch.zeros(2), (), None, None, None, {}), torch.ones(2))


def test_a_given_x_wins_over_the_first_input_and_a_missing_one_is_named() -> None:
    expr = compile_expr("x + 1", WHERE)
    assert torch.equal(expr(x=torch.zeros(2), inputs=(torch.ones(2),)), torch.ones(2))
    with pytest.raises(ActionError) as caught:
        expr(output=torch.ones(2))
    assert str(caught.value) == f"{WHERE}: 'x + 1' uses 'x', which this hook does not provide"


def test_a_failure_keeps_its_cause_and_the_expression_frame() -> None:
    with pytest.raises(ActionError) as caught:
        compile_expr("x", WHERE).bind("inputs")(())
    cause = caught.value.__cause__
    assert isinstance(cause, IndexError)
    assert "<expr>" in [frame.filename for frame in traceback.extract_tb(cause.__traceback__)]


class _Interrupt(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "relu":
            raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def test_an_interrupt_inside_an_expression_is_not_turned_into_an_action_error() -> None:
    expr = compile_expr("relu(x)", WHERE)
    with _Interrupt(), pytest.raises(KeyboardInterrupt):
        expr(x=torch.ones(2))
