"""A checked expression as a plain Python function: built once per set of parameters, with each
evaluation's work budget and a copy of any result that may be the module's own tensor."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Collection
from typing import Any

from surgery.errors import ActionError
from surgery.expr.runtime import GLOBALS

NAMES = ("x", "inputs", "output", "grad", "module", "kwargs")


def helper_call(helper: str, args: list[ast.expr], like: ast.AST) -> ast.Call:
    return ast.copy_location(ast.Call(ast.Name(helper, ast.Load()), args, []), like)


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
            if func.id in ("_index", "_call_method"):  # a view of its tensor unless the method makes a new one
                fresh = func.id == "_call_method" and node.args[2].value in _FRESH_METHODS  # type: ignore[attr-defined]
                return not fresh and _may_share_storage(node.args[1])
            if func.id == "_attr" and node.args[1].value in ("T", "mT"):  # type: ignore[attr-defined]
                return _may_share_storage(node.args[0])
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
        # operations are charged to one Work per evaluation, bounded by the largest argument (surgery.expr.work)
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
            zero = ast.Constant(0)
            work = ast.List([arguments, zero, zero, zero, ast.Constant(None)], ast.Load())  # work.new_work, inlined
            statements.append(ast.Assign([ast.Name("_env", ast.Store())], work))
        value = helper_call("_owned", [self._body], self._body) if self._owns else self._body
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
