"""What checked expressions run with: the allowlisted functions, methods and attributes, the
number guards, and the checked helpers that :mod:`surgery.expr.check`'s rewritten AST calls.

``GLOBALS`` is the whole namespace an expression's function sees; the checker guarantees that
expression text can name nothing in it that starts with ``_``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from surgery.errors import ActionError, did_you_mean

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
    " narrow roll flip argmax argmin square sin cos item".split()
)
TENSOR_ATTRIBUTES = frozenset({"T", "mT", "shape", "ndim", "dtype"})

NUMBER_TYPES = (int, float)  # bool is an int


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
}
