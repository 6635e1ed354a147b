"""The safe expression language of config files: parse and check once, then run fast in hooks.

An expression such as ``"x * module.W + module.b"`` or ``"softmax(output, dim=-1)"`` is parsed
with :mod:`ast` and checked against an allowlist before any model is touched: numbers, the
variables in ``NAMES``, the functions in ``FUNCTIONS``, the tensor methods in ``TENSOR_METHODS``,
arithmetic, comparisons, indexing and tuple/list literals. Number-only arithmetic is folded at
check time with guards, so ``9 ** 9 ** 9`` is refused instead of hanging. Every attribute read,
call, operator and index with tensors is rewritten into a checked helper, so at run time ``.name``
works only on tensors and on ``module`` (the hooked module: ``module.NAME`` reads its parameters,
buffers, submodules and numbers, nothing else), each operation is charged to the evaluation's
bounded work (:mod:`surgery.expr.work`), and a result that may share storage with the module's
tensors is copied, a decision made at check time (:mod:`surgery.expr.compiled`).

Decisions: ``a if c else b`` is refused (it breaks on tensors; use ``where(c, a, b)``);
``and``/``or`` and chained comparisons are refused, while ``&``, ``|``, ``^`` and ``~`` are
allowed because torch combines masks with them; ``<<``/``>>`` are refused (they grow numbers
without bound); ``out=`` and ``inplace=`` are refused so nothing writes into the model;
``norm`` is ``torch.linalg.vector_norm``; ``.item()`` is allowed.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Collection
from typing import Any

from surgery.errors import ConfigError, did_you_mean
from surgery.expr.compiled import NAMES, Expr, helper_call
from surgery.expr.parsing import MAX_DEPTH, check_text, einsum_problem, parse_program
from surgery.expr.runtime import (
    FUNCTIONS,
    NUMBER_TYPES,
    RESULT_FIELDS,
    TENSOR_ATTRIBUTES,
    TENSOR_METHODS,
    is_real,
    number_power,
    shorten,
)
from surgery.expr.work import MAX_ELEMENTS, MAX_PIECES

__all__ = ["FUNCTIONS", "NAMES", "TENSOR_ATTRIBUTES", "TENSOR_METHODS", "Expr", "compile_expr"]


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


def _sized(operator_name: str, left: ast.expr, right: ast.expr, like: ast.AST) -> ast.Call:
    """``_binary(_env, OP, left, right)``: a binary operation whose broadcast is bounded when it runs."""
    return helper_call(
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


def _is_number(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, NUMBER_TYPES)


class _Checker(ast.NodeTransformer):
    """One walk that refuses what is not allowed, folds numbers and inserts the runtime checks."""

    def __init__(self, text: str, where: str, names: Collection[str]) -> None:
        self.text, self.where, self.names = text, where, tuple(names)
        self.used: set[str] = set()
        self.module_reads: set[str] = set()
        self.bound: set[str] = set()  # names bound by NAME = expr before the result
        self.bound_used: set[str] = set()
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
        if name in self.bound:
            self.bound_used.add(name)
            return node
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
        if isinstance(node.op, (ast.USub, ast.Invert)):  # a new tensor: charged to the evaluation
            op = ast.Name(f"_op_{type(node.op).__name__}", ast.Load())
            return helper_call("_unary", [ast.Name("_env", ast.Load()), op, node.operand], node)
        return node  # +value is value itself

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        op = type(node.op)
        if not isinstance(node.op, _BINARY_OPS):
            raise self.refuse(node, "this operator is not allowed")
        node.left, node.right = self.visit(node.left), self.visit(node.right)
        if op in _FOLDS and _is_number(node.left) and _is_number(node.right):
            return self.fold(node)
        # bounded (broadcasting may grow), charged, and guarded for numbers and tuples (** and *)
        return _sized(f"_op_{op.__name__}", node.left, node.right, node)

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
        if not (_is_number(node.left) and _is_number(node.comparators[0])):
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
        return helper_call("_index", [ast.Name("_env", ast.Load()), node.value, index], node)

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
            return helper_call("_mread", [node.value, ast.Constant(node.attr)], node)
        helper = "_mread" if _on_module(node.value) else "_attr"
        return helper_call(helper, [self.visit(node.value), ast.Constant(node.attr)], node)

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
            obj = self.visit(func.value)
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
        elif isinstance(func, ast.Attribute) and func.attr == "chunk":
            self.check_literal_pieces(node)
        env = ast.Name("_env", ast.Load())
        if isinstance(func, ast.Name):  # every call is charged to the evaluation's work, and bounded
            node.args = [env, ast.Name(func.id, ast.Load()), ast.Constant(func.id), *node.args]
            node.func = ast.Name("_call", ast.Load())
        else:
            node.args = [env, obj, ast.Constant(func.attr), *node.args]
            node.func = ast.Name("_call_method", ast.Load())
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
        node.func = ast.Name("_call", ast.Load())
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

    def check_literal_pieces(self, node: ast.Call) -> None:
        """Refuse ``.chunk(N)`` into more literal pieces than one evaluation may split off, now."""
        given = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "chunks"), None)
        chunks = None if given is None else _literal(given)
        if chunks is not None and chunks > MAX_PIECES:
            raise self.refuse(
                node, f"{chunks:,} pieces are more than {MAX_PIECES:,}, the most tensors an expression may split off"
            )


def compile_expr(text: str, where: str, names: Collection[str] = NAMES) -> Expr:
    """Parse and check ``text`` once and return a fast callable; refusals are ConfigErrors naming ``where``.

    >>> compile_expr("relu(x) * 2", "actions.act.expr").names_used
    frozenset({'x'})
    """
    text = check_text(text, where)
    checker = _Checker(text, where, names)
    program, result = parse_program(text, where)
    bindings: list[tuple[str, ast.expr]] = []
    for name, node in program:
        checked = checker.visit(ast.Expression(node)).body  # checked before its name is bound: no self-reference
        if name in checker.bound or name in NAMES or name in FUNCTIONS or name.startswith("_"):
            why = "is a function of the language"
            if name in checker.bound or name.startswith("_") or name in NAMES:
                why = "is bound twice" if name in checker.bound else "starts with '_'" if name.startswith("_") else why
                why = "is a variable of the language" if name in NAMES else why
            raise ConfigError(f"{where}: '{name} = ...' in '{shorten(text)}': the name {name!r} {why}; pick another")
        bindings.append((name, checked))
        checker.bound.add(name)
    body = checker.visit(ast.Expression(result)).body
    unused = [name for name, _ in bindings if name not in checker.bound_used]
    if unused:
        raise ConfigError(f"{where}: '{unused[0]} = ...' in '{shorten(text)}': {unused[0]!r} is bound but never used")
    reads = frozenset(checker.module_reads)
    return Expr(text, where, names, frozenset(checker.used), body, reads, tuple(bindings))
