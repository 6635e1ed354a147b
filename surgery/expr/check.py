"""The safe expression language of config files: parse and check once, then run fast in hooks.

An expression such as ``"x * module.W + module.b"`` or ``"softmax(output, dim=-1)"`` is parsed
with :mod:`ast` and checked against an allowlist before any model is touched: numbers, the
variables in ``NAMES``, the functions in ``FUNCTIONS``, the tensor methods in ``TENSOR_METHODS``,
arithmetic, comparisons, indexing and tuple/list literals. Number-only arithmetic is folded at
check time with guards, so ``9 ** 9 ** 9`` is refused instead of hanging. Every attribute read,
method call, ``*`` and ``**`` is rewritten into a checked helper, so at run time ``.name`` works
only on tensors and on ``module`` (the hooked module: ``module.NAME`` reads its parameters,
buffers, submodules and numbers, nothing else), and a result that may share storage with the
module's tensors is copied, a decision made at check time.

Decisions: ``a if c else b`` is refused (it breaks on tensors; use ``where(c, a, b)``);
``and``/``or`` and chained comparisons are refused, while ``&``, ``|``, ``^`` and ``~`` are
allowed because torch combines masks with them; ``<<``/``>>`` are refused (they grow numbers
without bound); ``out=`` and ``inplace=`` are refused so nothing writes into the model;
``norm`` is ``torch.linalg.vector_norm``; ``.item()`` is allowed.
"""

from __future__ import annotations

import ast
import operator
import sys
from collections.abc import Callable, Collection
from typing import Any

from surgery.errors import ActionError, ConfigError, did_you_mean
from surgery.expr.parsing import MAX_DEPTH, check_text, parse_text
from surgery.expr.runtime import (
    FUNCTIONS,
    GLOBALS,
    MAX_ELEMENTS,
    NUMBER_TYPES,
    RESULT_FIELDS,
    SIZED_FUNCTIONS,
    SIZED_METHODS,
    TENSOR_ATTRIBUTES,
    TENSOR_METHODS,
    TUPLE_FUNCTIONS,
    is_real,
    number_power,
    shorten,
)

NAMES = ("x", "inputs", "output", "grad", "module", "kwargs")


_WRITING_KEYWORDS = frozenset({"out", "inplace"})
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.MatMult)
_BINARY_OPS = (*_ARITHMETIC, ast.BitAnd, ast.BitOr, ast.BitXor)  # torch combines boolean masks with & | ^
_REFUSED_COMPARISONS = (ast.Is, ast.IsNot, ast.In, ast.NotIn)
_REFUSED_NODES: dict[type[ast.AST], str] = {
    ast.Lambda: "lambdas are not allowed",
    **dict.fromkeys((ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp), "comprehensions are not allowed"),
    ast.JoinedStr: "f-strings are not allowed",
    ast.NamedExpr: "assignments (:=) are not allowed",
    ast.Starred: "'*' unpacking is not allowed",
    ast.Dict: "dict literals are not allowed",
    ast.Set: "set literals are not allowed",
    ast.IfExp: "'a if c else b' is not allowed; use where(c, a, b)",
    ast.BoolOp: "'and'/'or' do not work on tensors; use & and |, e.g. (x > 0) & (x < 1)",
}


_FOLDS: dict[type[ast.AST], Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: number_power, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def _helper_call(helper: str, args: list[ast.expr], like: ast.AST) -> ast.Call:
    return ast.copy_location(ast.Call(ast.Name(helper, ast.Load()), args, []), like)


def _sized(operator_name: str, left: ast.expr, right: ast.expr, like: ast.AST) -> ast.Call:
    """``_binary(_env, OP, left, right)``: a binary operation whose broadcast is bounded when it runs."""
    return _helper_call(
        "_binary", [ast.Name("_env", ast.Load()), ast.Name(operator_name, ast.Load()), left, right], like
    )


def _slice_call(part: ast.expr) -> ast.expr:
    """An index part as a plain expression: ``a:b:c`` becomes ``_slice(a, b, c)``."""
    if not isinstance(part, ast.Slice):
        return part
    bounds = [ast.Constant(None) if p is None else p for p in (part.lower, part.upper, part.step)]
    return ast.Call(ast.Name("_slice", ast.Load()), bounds, [])


def _literal(node: ast.expr) -> int | None:
    """The value of an int literal (folded, so ``-1`` and ``10**11`` count), else None."""
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def _on_module(node: ast.expr) -> bool:
    """True for ``module`` and ``module.a.b``, whose attributes are only known at run time."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "module"


_TENSOR_FUNCTIONS = frozenset(FUNCTIONS) - {"where"} - TUPLE_FUNCTIONS  # where(cond) alone returns a tuple


def einsum_problem(equation: str, operands: int) -> str | None:
    """Why an einsum equation cannot work with ``operands`` tensors, or None (checked before any model runs)."""
    if not equation or set(equation) - set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,->. "):
        return "an einsum equation uses letters, ',', '->' and '...' only, e.g. 'bij,bjk->bik'"
    text = equation.replace(" ", "")
    if text.count("->") > 1 or text.replace("->", "").count("-") or text.replace("->", "").count(">"):
        return "an einsum equation has at most one '->'"
    inputs, _, output = text.partition("->")
    terms = inputs.split(",")
    if len(terms) != operands:
        return f"the equation names {len(terms)} operand(s), the call gives {operands}"
    for term in [*terms, output]:
        if term.replace("...", "", 1).count("."):  # the character check left only letters, dots and one '->'
            return f"{term!r}: each term is letters with at most one '...'"
    if "->" in text:
        letters = output.replace("...", "")
        unknown = sorted(set(letters) - set(inputs))
        if unknown or len(set(letters)) != len(letters):
            return f"the output {output!r} must use each input letter at most once" + (
                f"; {', '.join(unknown)} is in no input" if unknown else ""
            )
    return None


def _makes_tensor(node: ast.expr) -> bool:
    """True for a call of a function that returns a tensor or raises (every one but ``where``)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _TENSOR_FUNCTIONS


def _is_number(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, NUMBER_TYPES)


class _Checker(ast.NodeTransformer):
    """One walk that refuses what is not allowed, folds numbers and inserts the runtime checks."""

    def __init__(self, text: str, where: str, names: Collection[str]) -> None:
        self.text, self.where, self.names = text, where, tuple(names)
        self.used: set[str] = set()
        self.module_reads: set[str] = set()
        self.depth = 0

    def refuse(self, node: ast.AST, reason: str) -> ConfigError:
        segment = ast.get_source_segment(self.text, node) or self.text
        context = "" if segment == self.text else f" in '{shorten(self.text)}'"
        return ConfigError(f"{self.where}: '{shorten(segment)}'{context}: {reason}")

    def visit(self, node: ast.AST) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise self.refuse(node, f"expression is nested deeper than {MAX_DEPTH} levels")
            return super().visit(node)
        finally:
            self.depth -= 1

    def generic_visit(self, node: ast.AST) -> Any:
        raise self.refuse(node, _REFUSED_NODES.get(type(node), f"{type(node).__name__} is not allowed"))

    def visit_Expression(self, node: ast.Expression) -> Any:
        node.body = self.visit(node.body)
        return node

    def visit_Constant(self, node: ast.Constant) -> Any:
        value = node.value
        if value is Ellipsis:
            raise self.refuse(node, "'...' is only allowed inside [ ]")
        if value is not None and type(value) not in (int, float, bool):
            raise self.refuse(node, f"{type(value).__name__} values are not allowed, only numbers")
        if value is not None and not is_real(value):
            raise self.refuse(node, "numbers must be finite and fit in a float")
        return node

    def visit_Name(self, node: ast.Name) -> Any:
        name = node.id
        if name == "module" and name in self.names:
            raise self.refuse(node, "module is read as module.NAME: a parameter, buffer, submodule or number")
        if name in self.names:
            self.used.add(name)
            return node
        if name in FUNCTIONS:
            raise self.refuse(node, f"function {name!r} must be called, e.g. {name}(x)")
        allowed = ", ".join(self.names)
        if name in NAMES:
            raise self.refuse(node, f"variable {name!r} is not available here; allowed: {allowed}")
        hint = did_you_mean(name, [*self.names, *FUNCTIONS])
        raise self.refuse(node, f"unknown name {name!r}.{hint} Variables: {allowed}")

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        if isinstance(node.op, ast.Not):
            raise self.refuse(node, "'not' does not work on tensors; use ~, e.g. ~(x > 0) (logical_not)")
        node.operand = self.visit(node.operand)
        if type(node.op) in _FOLDS and _is_number(node.operand):
            return self.fold(node)
        return node

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        op = type(node.op)
        if not isinstance(node.op, _BINARY_OPS):
            raise self.refuse(node, "this operator is not allowed")
        node.left, node.right = self.visit(node.left), self.visit(node.right)
        if op in _FOLDS and _is_number(node.left) and _is_number(node.right):
            return self.fold(node)
        if not (_is_number(node.left) or _is_number(node.right)):  # two values: broadcasting may grow them
            return _sized(f"_op_{op.__name__}", node.left, node.right, node)
        if _makes_tensor(node.left) or _makes_tensor(node.right):
            return node  # a tensor on either side: neither repetition nor a huge number can come of it
        if op is ast.Pow:
            return _helper_call("_pow", [node.left, node.right], node)
        if op is ast.Mult:
            return _helper_call("_mul", [node.left, node.right], node)
        return node

    def fold(self, node: ast.BinOp | ast.UnaryOp) -> ast.Constant:
        operands = [node.operand] if isinstance(node, ast.UnaryOp) else [node.left, node.right]
        try:
            value = _FOLDS[type(node.op)](*(operand.value for operand in operands if isinstance(operand, ast.Constant)))
            if not is_real(value):
                raise ValueError("the result is not a finite real number")
        except (ValueError, ArithmeticError) as error:
            raise self.refuse(node, f"cannot compute ({error})") from None
        return ast.copy_location(ast.Constant(value), node)

    def visit_Compare(self, node: ast.Compare) -> Any:
        if len(node.ops) > 1:
            raise self.refuse(node, "chained comparisons do not work on tensors; write (a < x) & (x < b)")
        if isinstance(node.ops[0], _REFUSED_COMPARISONS):
            raise self.refuse(node, "'is' and 'in' are not allowed; compare with == != < <= > >=")
        node.left = self.visit(node.left)
        node.comparators = [self.visit(node.comparators[0])]
        if not (_is_number(node.left) or _is_number(node.comparators[0])):
            return _sized(f"_op_{type(node.ops[0]).__name__}", node.left, node.comparators[0], node)
        return node

    def visit_Subscript(self, node: ast.Subscript) -> Any:
        if isinstance(node.value, ast.Constant):
            raise self.refuse(node, "numbers cannot be indexed")
        if isinstance(node.value, ast.Name) and node.value.id == "kwargs" and isinstance(node.slice, ast.Constant):
            if isinstance(node.slice.value, str):  # kwargs['bias']: a keyword input by its name
                node.value = self.visit(node.value)
                return node
        node.value = self.visit(node.value)
        if isinstance(node.slice, ast.Tuple):
            node.slice.elts = [self.check_index_part(part) for part in node.slice.elts]
        else:
            node.slice = self.check_index_part(node.slice)
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if all(isinstance(part, (ast.Slice, ast.Constant)) for part in parts):
            return node  # numbers, slices, None and ...: a view, never more elements
        index = (
            ast.Tuple([_slice_call(p) for p in parts], ast.Load())
            if isinstance(node.slice, ast.Tuple)
            else (_slice_call(node.slice))
        )
        return _helper_call("_index", [ast.Name("_env", ast.Load()), node.value, index], node)

    def check_index_part(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant) and node.value is Ellipsis:
            return node
        if isinstance(node, ast.Slice):
            node.lower, node.upper, node.step = (
                None if part is None else self.visit(part) for part in (node.lower, node.upper, node.step)
            )
            return node
        return self.visit(node)

    def visit_Tuple(self, node: ast.Tuple | ast.List) -> Any:
        node.elts = [self.visit(element) for element in node.elts]
        return node

    def visit_List(self, node: ast.List) -> Any:
        return self.visit_Tuple(node)

    def check_attribute_name(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_"):
            raise self.refuse(node, f"names starting with '_' are not allowed ('.{node.attr}')")

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        self.check_attribute_name(node)
        if isinstance(node.value, ast.Name) and node.value.id == "module":
            self.module_reads.add(node.attr)
        if node.attr not in TENSOR_ATTRIBUTES | RESULT_FIELDS and not _on_module(node.value):
            raise self.refuse(
                node,
                f"'.{node.attr}' cannot be read; tensors have {', '.join(sorted(TENSOR_ATTRIBUTES))}"
                " and module.NAME reads the module's parameters, buffers and numbers",
            )
        if isinstance(node.value, ast.Name) and node.value.id == "module" and "module" in self.names:
            self.used.add("module")
            return _helper_call("_mread", [node.value, ast.Constant(node.attr)], node)
        helper = "_mread" if _on_module(node.value) else "_attr"
        return _helper_call(helper, [self.visit(node.value), ast.Constant(node.attr)], node)

    def visit_Call(self, node: ast.Call) -> Any:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id not in FUNCTIONS:
                hint = did_you_mean(func.id, FUNCTIONS)
                raise self.refuse(node, f"unknown function {func.id!r}.{hint} Functions: {', '.join(FUNCTIONS)}")
            if func.id == "einsum":
                return self.check_einsum(node)
        elif isinstance(func, ast.Attribute):
            self.check_attribute_name(func)
            if func.attr not in TENSOR_METHODS:
                hint = did_you_mean(func.attr, TENSOR_METHODS)
                methods = ", ".join(sorted(TENSOR_METHODS))
                reason = f"unknown tensor method '.{func.attr}()'.{hint} In-place methods are never allowed."
                raise self.refuse(node, f"{reason} Methods: {methods}")
            node.func = _helper_call("_method", [self.visit(func.value), ast.Constant(func.attr)], func)
        else:
            raise self.refuse(node, "only functions and tensor methods can be called")
        node.args = [self.visit(arg) for arg in node.args]
        for keyword in node.keywords:
            if keyword.arg is None:
                raise self.refuse(keyword, "'**' unpacking is not allowed")
            if keyword.arg.startswith("_") or keyword.arg in _WRITING_KEYWORDS:
                raise self.refuse(keyword, f"keyword {keyword.arg!r} is not allowed")
            keyword.value = self.visit(keyword.value)
        if isinstance(func, ast.Attribute) and func.attr == "expand":
            self.check_literal_sizes(node)
        env = ast.Name("_env", ast.Load())
        if isinstance(func, ast.Name) and func.id in SIZED_FUNCTIONS:  # may make more elements than it is given
            node.args = [env, ast.Name(func.id, ast.Load()), ast.Constant(func.id), *node.args]
            node.func = ast.Name("_sized_call", ast.Load())
        elif isinstance(func, ast.Attribute) and func.attr in SIZED_METHODS:
            obj = node.func.args[0]  # type: ignore[attr-defined]
            node.args = [env, obj, ast.Constant(func.attr), *node.args]
            node.func = ast.Name("_sized_method", ast.Load())
        return node

    def check_einsum(self, node: ast.Call) -> Any:
        """``einsum('EQUATION', a, b, ...)``: the equation a string literal, checked now; operands as any call's."""
        first = node.args[0] if node.args else None
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)) or node.keywords:
            raise self.refuse(node, "einsum takes a literal equation first, then tensors: einsum('ij,jk->ik', a, b)")
        problem = einsum_problem(first.value, len(node.args) - 1)
        if problem is not None:
            raise self.refuse(node, problem)
        operands = [self.visit(arg) for arg in node.args[1:]]
        env = ast.Name("_env", ast.Load())
        node.args = [env, ast.Name("einsum", ast.Load()), ast.Constant("einsum"), first, *operands]
        node.func = ast.Name("_sized_call", ast.Load())
        return node

    def check_literal_sizes(self, node: ast.Call) -> None:
        """Refuse ``.expand(...)`` to literal sizes past the absolute bound now, rather than when the hook runs."""
        sizes = (
            node.args[0].elts if len(node.args) == 1 and isinstance(node.args[0], (ast.Tuple, ast.List)) else node.args
        )
        values = [_literal(size) for size in sizes]
        if not values or None in values:
            return
        count = 1
        for value in values:
            count *= max(value or 0, 1)
        if count > MAX_ELEMENTS:
            raise self.refuse(
                node, f"{count:,} elements are more than {MAX_ELEMENTS:,}, the most an expression may ever create"
            )


# Tensor methods whose result is always a new tensor (or a number); any other may be a view of its tensor.
_FRESH_METHODS = frozenset(
    "mean sum amax amin max min abs exp log sqrt clamp relu sigmoid tanh softmax log_softmax norm std var"
    " clone sign pow matmul argmax argmin square sin cos item size dim numel".split()
)


def _may_share_storage(node: ast.expr) -> bool:
    """True when a checked, rewritten expression's value can be a module tensor or a view of one."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):  # helpers and torch functions; only _mread and view attributes pass through
            if func.id == "_mread":
                return True
            if func.id in ("_index", "_sized_method"):  # a view of its tensor unless the method makes a new one
                fresh = func.id == "_sized_method" and node.args[2].value in _FRESH_METHODS  # type: ignore[attr-defined]
                return not fresh and _may_share_storage(node.args[1])
            if func.id == "_attr" and node.args[1].value in ("T", "mT"):  # type: ignore[attr-defined]
                return _may_share_storage(node.args[0])
            return False
        if isinstance(func, ast.Call) and func.args[1].value not in _FRESH_METHODS:  # type: ignore[attr-defined]
            return _may_share_storage(func.args[0])  # _method(tensor, "view")(...)
        return False
    if isinstance(node, ast.Subscript):
        return _may_share_storage(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):  # +t is t itself
        return _may_share_storage(node.operand)
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_may_share_storage(element) for element in node.elts)
    return False


_PYTHON_312 = sys.version_info >= (3, 12)


def _function(params: tuple[str, ...], body: list[ast.stmt]) -> ast.FunctionDef:
    signature = ast.arguments(
        posonlyargs=[], args=[ast.arg(name) for name in params], kwonlyargs=[], kw_defaults=[], defaults=[]
    )
    extra: dict[str, Any] = {"type_params": []} if _PYTHON_312 else {}
    return ast.FunctionDef(name="expression", args=signature, body=body, decorator_list=[], returns=None, **extra)


class Expr:
    """A checked expression compiled once; hooks call ``bind(...)``'s plain function, tests call it by name.

    >>> scale = compile_expr("x * module.W + module.b", where="actions.scale.expr")
    >>> y = scale(x=tensor, module=layer)  # doctest: +SKIP
    >>> hook_fn = scale.bind("module", "inputs", "output")  # x is inputs[0]  # doctest: +SKIP
    """

    __slots__ = ("text", "where", "names_used", "module_reads", "_names", "_body", "_owns", "_sized", "_bound")

    def __init__(
        self, text: str, where: str, names: Collection[str], used: frozenset[str], body: ast.expr, reads: frozenset[str]
    ) -> None:
        self.text, self.where, self._names = text, where, tuple(names)
        self.names_used = used
        self.module_reads = reads  # names read as module.NAME, so a plan can check each module has them
        self._body = body
        self._owns = _may_share_storage(body)  # copy the result: it may be the module's own tensor
        # operations that may grow tensors get the arguments, to bound them by the largest (runtime.element_limit)
        self._sized = any(isinstance(n, ast.Name) and n.id == "_env" for n in ast.walk(body))
        self._bound: dict[tuple[str, ...], Callable[..., Any]] = {}

    def bind(self, *params: str) -> Callable[..., Any]:
        """A plain function of ``params`` (positional) for a hook's hot path; ``x`` defaults to ``inputs[0]``."""
        function = self._bound.get(params)
        if function is None:
            function = self._bound[params] = self._build(params)
        return function

    def _build(self, params: tuple[str, ...]) -> Callable[..., Any]:
        derive_x = "x" in self.names_used and "x" not in params
        missing = self.names_used - set(params) - ({"x"} if derive_x and "inputs" in params else set())
        if missing or not set(params) <= set(NAMES):
            raise ValueError(f"{self.where}: cannot bind {params} for '{self.text}' (uses {sorted(self.names_used)})")
        statements: list[ast.stmt] = []
        if derive_x:
            first = ast.Subscript(ast.Name("inputs", ast.Load()), ast.Constant(0), ast.Load())
            statements.append(ast.Assign([ast.Name("x", ast.Store())], first))
        if self._sized:
            arguments = ast.Tuple([ast.Name(name, ast.Load()) for name in params], ast.Load())
            statements.append(ast.Assign([ast.Name("_env", ast.Store())], arguments))
        value = _helper_call("_owned", [self._body], self._body) if self._owns else self._body
        statements.append(ast.Return(value))
        failed = ast.Call(ast.Name("_failed", ast.Load()), [ast.Name("_error", ast.Load()), ast.Constant(self.where),
                          ast.Constant(self.text)], [])  # fmt: skip
        handler = ast.ExceptHandler(ast.Name("_Exception", ast.Load()), "_error",
                                    [ast.Raise(failed, ast.Name("_error", ast.Load()))])  # fmt: skip
        guarded = ast.Try(body=statements, handlers=[handler], orelse=[], finalbody=[])
        tree = ast.fix_missing_locations(ast.Module([_function(params, [guarded])], type_ignores=[]))
        namespace = dict(GLOBALS)
        exec(compile(tree, "<expr>", "exec"), namespace)  # a function around the checked, rewritten AST only
        return namespace["expression"]  # type: ignore[no-any-return]

    def __call__(self, **env: Any) -> Any:
        """Evaluate with ``x``, ``inputs``, ``output``, ``grad``, ``module`` given by name."""
        derive_x = "x" in self.names_used and "x" not in env and "inputs" in env
        missing = self.names_used - env.keys() - ({"x"} if derive_x else set())
        if missing:
            first = sorted(missing)[0]
            raise ActionError(f"{self.where}: '{self.text}' uses {first!r}, which this hook does not provide")
        wanted = self.names_used - {"x"} | {"inputs"} if derive_x else self.names_used
        params = tuple(name for name in NAMES if name in wanted)
        return self.bind(*params)(*(env[name] for name in params))

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # code objects do not pickle; checking again is cheap and keeps the guarantee
        return compile_expr, (self.text, self.where, self._names)


def compile_expr(text: str, where: str, names: Collection[str] = NAMES) -> Expr:
    """Parse and check ``text`` once and return a fast callable; refusals are ConfigErrors naming ``where``.

    >>> compile_expr("relu(x) * 2", "actions.act.expr").names_used
    frozenset({'x'})
    """
    text = check_text(text, where)
    checker = _Checker(text, where, names)
    body = checker.visit(parse_text(text, text, where)).body
    return Expr(text, where, names, frozenset(checker.used), body, frozenset(checker.module_reads))
