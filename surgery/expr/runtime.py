"""What checked expressions run with: the allowlisted functions, methods and attributes, the
number guards, and the checked helpers that :mod:`surgery.expr.check`'s rewritten AST calls.

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

MAX_EXPONENT = 64
# The element bound: no tensor an expression creates may have more than
# min(max(GROWTH * N, MIN_ELEMENTS), MAX_ELEMENTS) elements, N being the largest tensor it is given
# (its variables and the hooked module's own parameters and buffers). Only operations that can make
# more elements than their largest operand are checked (expand, broadcasting, matmul, cat, stack,
# indexing with tensors or lists), before they allocate; everything else cannot grow.
GROWTH = 16
MIN_ELEMENTS = 2**24
MAX_ELEMENTS = 2**36


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

# Functions and methods that can make more elements than their largest operand; calls to them are checked.
# Every other one makes at most as many as its largest operand (tests/test_expr.py lists those, so a function
# added to the allowlists must be put on one side or the other).
SIZED_FUNCTIONS = frozenset("matmul clamp where pow maximum minimum cat stack linear quantile einsum".split())
SIZED_METHODS = frozenset("expand matmul pow max min clamp quantile".split())
_META_COUNTED = frozenset({"einsum", "quantile"})  # no formula: their shape is found on meta tensors
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


def _largest(value: Any, depth: int = 0) -> int:
    """The element count of the largest tensor in a variable (tensors, containers, a module's own tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if depth > 3:
        return 0
    if isinstance(value, nn.Module):
        items: Any = [*value._parameters.values(), *value._buffers.values()]
    elif isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        return 0
    return max((_largest(item, depth + 1) for item in items if item is not None), default=0)


def element_limit(env: tuple[Any, ...]) -> int:
    """The most elements one value of an expression given ``env`` (its arguments) may have."""
    return min(max(GROWTH * max((_largest(v) for v in env), default=0), MIN_ELEMENTS), MAX_ELEMENTS)


def _grown(env: tuple[Any, ...], count: int, operands: Any) -> None:
    """Refuse ``count`` new elements when that is more than every operand has and past the bound."""
    if count <= MIN_ELEMENTS or count <= max((t.numel() for t in operands if isinstance(t, torch.Tensor)), default=1):
        return
    limit = element_limit(env)
    if count > limit:
        raise ActionError(
            f"it would create a tensor of {count:,} elements, more than the {limit:,} an expression may create here"
            f" (at most {GROWTH} × its largest input, at least {MIN_ELEMENTS:,}, never more than {MAX_ELEMENTS:,})"
        )


def _broadcast_count(*shapes: Any) -> int:
    """The element count of the broadcast of ``shapes`` (an upper bound when they do not broadcast)."""
    rank = max(map(len, shapes))
    count = 1
    for i in range(1, rank + 1):
        size = 1
        for shape in shapes:
            if i <= len(shape):
                dim = shape[-i]
                if dim == 0:
                    return 0
                size = dim if dim > size else size
        count *= size
    return count


def _matmul_count(a: Any, b: Any) -> int:
    if a.dim() == 0 or b.dim() == 0:
        return max(a.numel(), b.numel())
    rows = a.shape[-2] if a.dim() >= 2 else 1
    columns = b.shape[-1] if b.dim() >= 2 else 1
    return _broadcast_count(a.shape[:-2], b.shape[:-2]) * rows * columns


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def _new_count(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], function: Callable[..., Any]) -> int:
    """How many elements ``function(*args, **kwargs)`` (torch.NAME, or the method with self first) would create."""
    if name in _META_COUNTED:
        return _meta_count(function, args, kwargs)
    if name in ("cat", "stack"):
        items = args[0] if args else kwargs.get("tensors", ())
        return sum(t.numel() for t in items if isinstance(t, torch.Tensor))
    if name == "matmul" and len(args) == 2 and all(isinstance(t, torch.Tensor) for t in args):
        return _matmul_count(*args)
    if name == "einsum" and args and isinstance(args[0], str):
        return _einsum_count(args[0], args[1:])
    if name == "quantile" and len(args) >= 2 and isinstance(args[0], torch.Tensor):
        q = args[1]
        many = q.numel() if isinstance(q, torch.Tensor) else 1
        return many * args[0].numel()  # at most: every quantile of the whole tensor
    if name == "linear" and len(args) >= 2 and all(isinstance(t, torch.Tensor) for t in args[:2]):
        x, weight = args[:2]
        return _matmul_count(x, weight.mT if weight.dim() >= 2 else weight)
    shapes = [t.shape for t in _tensors(args, kwargs)]
    return _broadcast_count(*shapes) if len(shapes) > 1 else 0


def _einsum_count(equation: str, operands: tuple[Any, ...]) -> int:
    """The element count of ``einsum(equation, *operands)``, worked out on meta tensors (no memory)."""
    if not all(isinstance(t, torch.Tensor) for t in operands):
        return 0
    try:
        return torch.einsum(equation, *(torch.empty(t.shape, device="meta") for t in operands)).numel()
    except Exception:  # noqa: BLE001 - shapes that do not fit: let torch say so on the real tensors
        return 0


def _sized_call(env: tuple[Any, ...], function: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """An expression function that can make more elements than it is given (``cat``, ``where``, ...), bounded."""
    _grown(env, _new_count(name, args, kwargs, function), _tensors(args, kwargs))
    return function(*args, **kwargs)


def _sized_method(env: tuple[Any, ...], obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """A tensor method that can make more elements than it is given (``expand``, ``matmul``, ...), bounded."""
    method = _find_method(obj, name)
    if name == "expand":
        count = _expand_count(obj, args)
    else:
        count = _new_count(name, (obj, *args), kwargs, getattr(torch.Tensor, name))
    _grown(env, count, (obj, *_tensors(args, kwargs)))
    return method(*args, **kwargs)


def _meta_count(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The elements ``function`` makes, run on meta tensors (no data); else the product of the operands' sizes."""

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        return [meta(v) for v in value] if isinstance(value, (list, tuple)) else value

    try:
        out = function(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
        return sum(
            t.numel() for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)
        )
    except Exception:  # noqa: BLE001 - an upper bound: no output is larger than all its operands multiplied
        return math.prod(t.numel() for t in _tensors(args, kwargs))


def _expand_count(tensor: torch.Tensor, args: tuple[Any, ...]) -> int:
    sizes = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    if not all(isinstance(s, int) for s in sizes) or len(sizes) < tensor.dim():
        return 0  # torch refuses it
    old = (1,) * (len(sizes) - tensor.dim()) + tuple(tensor.shape)
    count = 1
    for size, dim in zip(sizes, old):
        count *= dim if size == -1 else size
    return count


def _binary(env: tuple[Any, ...], op: Callable[[Any, Any], Any], left: Any, right: Any) -> Any:
    """``left OP right`` where broadcasting may make more elements than either side has, bounded."""
    if isinstance(left, _Tensor) and isinstance(right, _Tensor):
        # cheapest test first: no broadcast of the two can have more elements than this product
        if left.numel() * right.numel() > MIN_ELEMENTS and left.shape != right.shape:
            count = _matmul_count(left, right) if op is operator.matmul else _broadcast_count(left.shape, right.shape)
            _grown(env, count, (left, right))
        return _TENSOR_OPERATORS.get(op, op)(left, right)
    return op(left, right)


_Tensor = torch.Tensor


def _index(env: tuple[Any, ...], value: Any, index: Any) -> Any:
    """``value[index]``: indexing with tensors or lists can repeat elements, so it is bounded too."""
    parts = index if type(index) is tuple else (index,)
    if isinstance(value, torch.Tensor) and not all(type(p) in _BASIC_INDEX for p in parts):
        _grown(env, _index_count(value, parts), (value,))
    return value[index]


_BASIC_INDEX = (int, slice, type(None), type(Ellipsis), bool)


def _index_count(value: torch.Tensor, parts: tuple[Any, ...]) -> int:
    """The element count of ``value[parts]`` (at most), found on a meta tensor (a mask counts as all True)."""
    meta: list[Any] = []
    for part in parts:
        if isinstance(part, (list, tuple)) or (isinstance(part, torch.Tensor) and part.dim() > 0):
            part = torch.as_tensor(part) if not isinstance(part, torch.Tensor) else part
            if part.dtype == torch.bool:  # a mask picks at most what it covers: count it as whole dims
                meta += [slice(None)] * part.dim()
                continue
            meta.append(torch.empty(part.shape, dtype=torch.long, device="meta"))
        elif isinstance(part, torch.Tensor):
            meta.append(0)
        else:
            meta.append(part)
    try:
        return torch.empty(value.shape, device="meta")[tuple(meta)].numel()
    except Exception:  # noqa: BLE001 - a bad index: let torch say so on the real tensor
        return 0


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
    "_pow": _power,
    "_mul": _multiply,
    "_sized_call": _sized_call,
    "_sized_method": _sized_method,
    "_binary": _binary,
    "_index": _index,
    "_slice": slice,
    **{f"_op_{node}": getattr(operator, name) for node, name in BINARY_OPERATORS.items()},
    "_op_Pow": _power,  # the number guards of ** and * hold for checked operands too
    "_op_Mult": _multiply,
}
_TENSOR_OPERATORS = {_power: operator.pow, _multiply: operator.mul}  # two tensors need no number guard
