"""What checked expressions run with: the allowlisted functions, methods and attributes, the
number guards, and the checked helpers that :mod:`surgery.expr.check`'s rewritten AST calls, each
operation charged to the evaluation's :class:`surgery.expr.work.Work`.

``GLOBALS`` is the whole namespace an expression's function sees; the checker guarantees that
expression text can name nothing in it that starts with ``_``.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from surgery.errors import ActionError, did_you_mean
from surgery.expr.work import (
    CHARGED_BEFORE,
    COUNTING,
    ENV,
    MADE,
    MIN_ELEMENTS,
    MIN_LIVE,
    MIN_WORK,
    SPENT,
    VIEWS,
    Work,
    broadcast_count,
    charge_before,
    grown,
    index_count,
    made,
    matmul_count,
    over,
    spend,
)
from surgery.expr.work import SIZED_FUNCTIONS as SIZED_FUNCTIONS  # re-exported: tests classify the allowlists
from surgery.expr.work import SIZED_METHODS as SIZED_METHODS

MAX_EXPONENT = 64


# F.silu, F.leaky_relu and F.elu take a positional `inplace` flag that would write into the model.
def _silu(input: torch.Tensor) -> torch.Tensor:
    return F.silu(input)


def _leaky_relu(input: torch.Tensor, negative_slope: float = 0.01) -> torch.Tensor:
    return F.leaky_relu(input, negative_slope)


def _elu(input: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return F.elu(input, alpha)


_TORCH_FUNCTIONS = (
    "relu sigmoid tanh softmax log_softmax matmul clamp where abs exp log sqrt rsqrt square sign erf pow sin cos"
    " maximum minimum mean sum amax amin std var cat stack"
    " topk kthvalue sort cumsum quantile einsum"  # topk, kthvalue, sort give (values, indices): .values / [0]
    " zeros_like ones_like full_like randn_like rand_like"  # sizes come from a tensor, never from the config
)
FUNCTIONS: dict[str, Callable[..., Any]] = {name: getattr(torch, name) for name in _TORCH_FUNCTIONS.split()}
FUNCTIONS |= {
    "gelu": F.gelu,
    "silu": _silu,
    "softplus": F.softplus,
    "leaky_relu": _leaky_relu,
    "elu": _elu,
    "linear": F.linear,
    "layer_norm": F.layer_norm,
    "norm": torch.linalg.vector_norm,
}

# No in-place methods (trailing `_`), no device moves, no hooks, nothing that leaves torch.
TENSOR_METHODS = frozenset(
    "reshape view flatten unflatten mean sum amax amin max min abs exp log sqrt clamp relu"
    " sigmoid tanh softmax log_softmax transpose permute unsqueeze squeeze norm std var detach"
    " clone float size dim numel expand expand_as sign pow matmul t contiguous chunk split"
    " narrow roll flip argmax argmin square sin cos item topk kthvalue sort cumsum quantile".split()
)
TENSOR_ATTRIBUTES = frozenset({"T", "mT", "shape", "ndim", "dtype"})
RESULT_FIELDS = frozenset({"values", "indices"})  # of what topk, kthvalue and sort return
TUPLE_FUNCTIONS = frozenset({"topk", "kthvalue", "sort"})  # they return a (values, indices) named tuple

NUMBER_TYPES = (int, float)  # bool is an int

BINARY_OPERATORS = {  # ast operator class name -> operator function, for _binary
    "Add": "add", "Sub": "sub", "Mult": "mul", "Div": "truediv", "FloorDiv": "floordiv", "Mod": "mod",
    "Pow": "pow", "MatMult": "matmul", "BitAnd": "and_", "BitOr": "or_", "BitXor": "xor",
    "Eq": "eq", "NotEq": "ne", "Lt": "lt", "LtE": "le", "Gt": "gt", "GtE": "ge",
}  # fmt: skip


def is_real(value: Any) -> bool:
    """True for a finite int or float; huge ints count as infinite."""
    try:
        return isinstance(value, NUMBER_TYPES) and math.isfinite(value)
    except OverflowError:
        return False


def number_power(base: float, exponent: float) -> float:
    """``base ** exponent`` for plain numbers, guarded so it can neither hang nor overflow."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is larger than {MAX_EXPONENT} in absolute value")
    result = base**exponent
    if not is_real(result):
        raise ValueError(f"({base}) ** {exponent} is not a finite real number")
    return result


def _read_module(obj: Any, name: str) -> Any:
    """Runtime check behind ``module.name``: a parameter, buffer, submodule or plain number; else list them."""
    if not isinstance(obj, nn.Module):
        return _read_attribute(obj, name)  # module.weight.T and the like: the tensor rules apply
    if name in obj._parameters:
        return obj._parameters[name]
    if name in obj._buffers:
        return obj._buffers[name]
    if name in obj._modules:
        return obj._modules[name]
    value = obj.__dict__.get(name)
    if _is_plain(value):
        return value
    readable = [*obj._parameters, *obj._buffers, *obj._modules]
    readable += [k for k, v in obj.__dict__.items() if _is_plain(v) and not k.startswith("_")]
    raise ActionError(
        f"{type(obj).__name__} has no readable attribute {name!r}.{did_you_mean(name, readable)}"
        f" Readable: {', '.join(sorted(readable)) or 'nothing'}."
    )


def _is_plain(value: Any) -> bool:
    """True for an int, float or bool, or a tuple of them (e.g. ``LayerNorm.normalized_shape``)."""
    if type(value) is tuple:
        return all(type(item) in (int, float, bool) for item in value)
    return type(value) in (int, float, bool)


def _read_attribute(obj: Any, name: str) -> Any:
    """Runtime check behind every ``a.name`` that is not a method call."""
    if isinstance(obj, torch.Tensor):
        if name in TENSOR_ATTRIBUTES:
            return getattr(obj, name)
        raise ActionError(f"tensors have no readable '.{name}'; readable: {', '.join(sorted(TENSOR_ATTRIBUTES))}")
    if name in RESULT_FIELDS and type(obj).__module__ == "torch.return_types":
        return getattr(obj, name)
    raise ActionError(f"cannot read '.{name}' of a {type(obj).__name__}; only of tensors and module")


def _find_method(obj: Any, name: str) -> Any:
    """Runtime check behind every ``a.name(...)``: only allowlisted tensor methods."""
    if isinstance(obj, torch.Tensor) and name in TENSOR_METHODS:
        return getattr(obj, name)
    raise ActionError(f"cannot call '.{name}()' on a {type(obj).__name__}; only on tensors")


def _power(base: Any, exponent: Any) -> Any:
    """Runtime ``**``: Python numbers (e.g. ``x.ndim``) get the same guard as at check time."""
    if isinstance(base, NUMBER_TYPES) and isinstance(exponent, NUMBER_TYPES):
        return number_power(base, exponent)
    return base**exponent


def _multiply(left: Any, right: Any) -> Any:
    """Runtime ``*``: refuse ``inputs * 10**9``-style repetition of tuples and lists."""
    if isinstance(left, (tuple, list)) or isinstance(right, (tuple, list)):
        raise ActionError("repeating a tuple or list with '*' is not allowed")
    return left * right


def _call(work: Work, function: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """An expression function, charged to the evaluation's work (``cat``, ``@``, sorts checked before they run)."""
    if name in CHARGED_BEFORE:
        charge_before(work, name, args, kwargs, function)
    result = function(*args, **kwargs)
    if not work[COUNTING]:
        return result
    if not isinstance(result, _Tensor):
        made(work, result)  # a tuple of tensors (sort, topk) or nothing to count
        return result
    count = result.numel()  # made(), inlined on the hot path
    work[MADE] += count
    work[SPENT] += count
    if work[MADE] > MIN_LIVE or work[SPENT] > MIN_WORK:
        over(work)
    return result


def _call_method(work: Work, obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """An allowlisted tensor method, charged like a function; views (``expand``, ``transpose``) make nothing."""
    method = _find_method(obj, name)
    if name in CHARGED_BEFORE:
        charge_before(work, name, (obj, *args), kwargs, getattr(torch.Tensor, name))
    result = method(*args, **kwargs)
    if name not in VIEWS:
        made(work, result)
    return result


def _binary(work: Work, op: Callable[[Any, Any], Any], left: Any, right: Any) -> Any:
    """``left OP right``: broadcasting and ``@`` are bounded before they run, and what they make is charged."""
    if isinstance(left, _Tensor):
        if isinstance(right, _Tensor):
            if op is operator.matmul:
                count = matmul_count(left, right)
                grown(work[ENV], count, (left, right))
                spend(work, 2 * count * (left.shape[-1] if left.dim() else 1))
            elif left.numel() * right.numel() > MIN_ELEMENTS and left.shape != right.shape:  # the cheap test first
                grown(work[ENV], broadcast_count(left.shape, right.shape), (left, right))
        elif type(right) not in _NUMBERS:
            return _charged(work, op(left, right))
    elif not (isinstance(right, _Tensor) and type(left) in _NUMBERS):
        return _charged(work, op(left, right))  # numbers, tuples: the guards of ** and *
    result = _TENSOR_OPERATORS.get(op, op)(left, right)  # a tensor and a tensor or a number: no guard needed
    if not work[COUNTING]:
        return result
    count = result.numel()  # made(), inlined: this is the hot path of most expressions
    work[MADE] += count
    work[SPENT] += count
    if work[MADE] > MIN_LIVE or work[SPENT] > MIN_WORK:
        over(work)
    return result


_NUMBERS = (int, float, bool)


def _charged(work: Work, result: Any) -> Any:
    if isinstance(result, _Tensor):
        made(work, result)
    return result


def _unary(work: Work, op: Callable[[Any], Any], value: Any) -> Any:
    """``-value`` or ``~value``, charged for what it makes."""
    result = op(value)
    made(work, result)
    return result


_Tensor = torch.Tensor


def _index(work: Work, value: Any, index: Any) -> Any:
    """``value[index]``: indexing with tensors or lists can repeat elements, so it is bounded and charged too."""
    parts = index if type(index) is tuple else (index,)
    if isinstance(value, torch.Tensor) and not all(type(p) in _BASIC_INDEX for p in parts):
        grown(work[ENV], index_count(value, parts), (value,))
        result = value[index]
        made(work, result)
        return result
    return value[index]


_BASIC_INDEX = (int, slice, type(None), type(Ellipsis), bool)


def _loaded_module(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """``__import__`` for torch's C code, which re-imports ``torch`` from the calling frame: loaded modules only."""
    if level or name not in sys.modules:
        raise ImportError(f"{name!r}: expressions cannot import")
    return sys.modules[name] if fromlist else sys.modules[name.partition(".")[0]]


def _owned(value: Any) -> Any:
    """A copy of a value that may share storage with the module's tensors, so the model cannot write into them.

    Inserted at check time around expressions whose result can be a module tensor or a view of one.
    """
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_owned(item) for item in value)
    if isinstance(value, nn.Module):
        raise ActionError(f"the result is the submodule {type(value).__name__}, not a value; read one of its tensors")
    return value


def _failed(error: Exception, where: str, text: str) -> ActionError:
    """The error an expression raises: where it is configured, its text, and the first line of the cause."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ActionError(f"{where}: '{shorten(text)}' failed: {first}")


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


GLOBALS: dict[str, Any] = {
    # Only torch's own lazy imports can reach this: expression text cannot name `_` names.
    "__builtins__": {"__import__": _loaded_module},
    **FUNCTIONS,
    "_attr": _read_attribute,
    "_mread": _read_module,
    "_owned": _owned,
    "_failed": _failed,
    "_Exception": Exception,
    "_method": _find_method,
    "_call": _call,
    "_call_method": _call_method,
    "_binary": _binary,
    "_unary": _unary,
    "_index": _index,
    "_op_USub": operator.neg,
    "_op_Invert": operator.invert,
    "_slice": slice,
    **{f"_op_{node}": getattr(operator, name) for node, name in BINARY_OPERATORS.items()},
    "_op_Pow": _power,  # the number guards of ** and * hold for checked operands too
    "_op_Mult": _multiply,
}
_TENSOR_OPERATORS = {_power: operator.pow, _multiply: operator.mul}  # two tensors need no number guard
