"""A checked expression as a plain Python function: built once per set of parameters, with each
evaluation's work budget and a copy of any result that may be the module's own tensor."""

from __future__ import annotations

import ast
import copy
import sys
from collections.abc import Callable, Collection
from typing import Any

from surgery.errors import ActionError
from surgery.expr.runtime import GLOBALS
from surgery.expr.work import CHARGED_BEFORE, UNCOUNTED_VALUES, VIEWS

NAMES = ("x", "inputs", "output", "grad", "module", "kwargs")


def helper_call(helper: str, args: list[ast.expr], like: ast.AST) -> ast.Call:
    return ast.copy_location(ast.Call(ast.Name(helper, ast.Load()), args, []), like)


# Tensor methods whose result is always a new tensor (or a number); any other may be a view of its tensor.
_FRESH_METHODS = frozenset(
    "mean sum amax amin max min abs exp log sqrt clamp relu sigmoid tanh softmax log_softmax norm std var"
    " clone sign pow matmul argmax argmin square sin cos item size dim numel".split()
)


def _may_share_storage(node: ast.expr, bound: dict[str, bool] | None = None) -> bool:
    """True when a checked, rewritten expression's value can be a module tensor or a view of one.

    ``bound``: for each name bound before (``NAME = expr;``), whether its value may.
    """
    if isinstance(node, ast.Name):
        return bool(bound and bound.get(node.id, False))
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):  # helpers and torch functions; only _mread and view attributes pass through
            if func.id == "_mread":
                return True
            if func.id in ("_index", "_call_method"):  # a view of its tensor unless the method makes a new one
                fresh = func.id == "_call_method" and node.args[2].value in _FRESH_METHODS  # type: ignore[attr-defined]
                return not fresh and _may_share_storage(node.args[1], bound)
            if func.id == "_attr" and node.args[1].value in ("T", "mT"):  # type: ignore[attr-defined]
                return _may_share_storage(node.args[0], bound)
        return False
    if isinstance(node, ast.Subscript):
        return _may_share_storage(node.value, bound)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):  # +t is t itself
        return _may_share_storage(node.operand, bound)
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_may_share_storage(element, bound) for element in node.elts)
    return False


_TWO_VALUES = frozenset({"sort", "topk", "kthvalue"})  # (values, indices)


def counts_values(body: ast.expr) -> bool:
    """Whether an evaluation must count the elements it makes: not when it makes at most UNCOUNTED_VALUES
    values, as each is within the one-value bound (einsum's intermediates and where(cond)'s tuple always count)."""
    values = 0
    for node in ast.walk(body):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        helper = node.func.id
        if helper in ("_binary", "_unary", "_index"):
            values += 1
        elif helper in ("_call", "_call_method"):
            name = node.args[2].value  # type: ignore[attr-defined]
            if name == "einsum" or (name == "where" and len(node.args) + len(node.keywords) == 4):
                return True
            values += 0 if helper == "_call_method" and name in VIEWS else 2 if name in _TWO_VALUES else 1
    return values > UNCOUNTED_VALUES


# helper operator name -> the plain AST operator, where a number operand needs no guard (unlike * and **)
_RAW_WITH_A_NUMBER: dict[str, type[ast.operator] | type[ast.cmpop]] = {
    **{f"_op_{op.__name__}": op for op in (ast.Add, ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)},
    **{f"_op_{op.__name__}": op for op in (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)},
}


class _Uncounted(ast.NodeTransformer):
    """The hot path of an evaluation that need not count what it makes: what is charged nothing before it runs
    is called directly (``relu(x)``, ``x.view(...)``, ``-x``, ``x + 1``), as plain Python would."""

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        helper = node.func.id if isinstance(node.func, ast.Name) else None
        if helper in ("_call", "_call_method") and node.args[2].value not in CHARGED_BEFORE:  # type: ignore[attr-defined]
            if helper == "_call":
                return ast.copy_location(ast.Call(node.args[1], node.args[3:], node.keywords), node)
            method = helper_call("_method", node.args[1:3], node)
            return ast.copy_location(ast.Call(method, node.args[3:], node.keywords), node)
        if helper == "_unary":
            unary = ast.USub() if node.args[1].id == "_op_USub" else ast.Invert()  # type: ignore[attr-defined]
            return ast.copy_location(ast.UnaryOp(unary, node.args[2]), node)
        if helper == "_binary" and node.args[1].id in _RAW_WITH_A_NUMBER:  # type: ignore[attr-defined]
            left, right = node.args[2:]
            if any(isinstance(side, ast.Constant) and type(side.value) in (int, float) for side in (left, right)):
                op = _RAW_WITH_A_NUMBER[node.args[1].id]()  # type: ignore[attr-defined]
                if isinstance(op, ast.cmpop):
                    return ast.copy_location(ast.Compare(left, [op], [right]), node)
                return ast.copy_location(ast.BinOp(left, op, right), node)
        return node


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

    __slots__ = ("text", "where", "names_used", "module_reads", "_names", "_body", "_owns", "_bound", "_bindings")

    def __init__(
        self,
        text: str,
        where: str,
        names: Collection[str],
        used: frozenset[str],
        body: ast.expr,
        reads: frozenset[str],
        bindings: tuple[tuple[str, ast.expr], ...] = (),
    ) -> None:
        self.text, self.where, self._names = text, where, tuple(names)
        self.names_used = used
        self.module_reads = reads  # names read as module.NAME, so a plan can check each module has them
        self._body = body
        self._bindings = bindings  # NAME = expr, evaluated in order before the result
        shares: dict[str, bool] = {}
        for name, value in bindings:
            shares[name] = _may_share_storage(value, shares)
        self._owns = _may_share_storage(body, shares)  # copy the result: it may be the module's own tensor
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
        everything = ast.List([*(value for _, value in self._bindings), self._body], ast.Load())
        counting = counts_values(everything)
        if not counting:
            everything = ast.fix_missing_locations(_Uncounted().visit(copy.deepcopy(everything)))
        *values, body = everything.elts
        if any(isinstance(n, ast.Name) and n.id == "_env" for n in ast.walk(everything)):
            arguments = ast.Tuple([ast.Name(name, ast.Load()) for name in params], ast.Load())
            zero = ast.Constant(0)
            work = ast.List([arguments, zero, zero, zero, ast.Constant(None), ast.Constant(counting)], ast.Load())
            statements.append(ast.Assign([ast.Name("_env", ast.Store())], work))  # a surgery.expr.work.Work
        for (name, _), bound in zip(self._bindings, values):
            statements.append(ast.Assign([ast.Name(name, ast.Store())], bound))
        value = helper_call("_owned", [body], body) if self._owns else body
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
        from surgery.expr.check import compile_expr

        return compile_expr, (self.text, self.where, self._names)
