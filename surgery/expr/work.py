"""What one evaluation of an expression may cost: the elements of each value, the elements of all values
together, the operations it runs and the pieces it splits off, each bounded by its largest input.

Every operation a checked expression runs goes through :mod:`surgery.expr.runtime`'s helpers, which
charge it to the evaluation's :class:`Work` here: before it runs when it can grow a tensor, take many
operations for few elements (``@``, ``einsum``, reductions, sorts) or split off many tensors; after it
runs for the elements it made. Views (``expand``, ``transpose``, basic slices) cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.errors import ActionError

# N is the element count of the largest tensor an expression is given (its variables and the hooked
# module's own parameters and buffers); each bound is min(max(FACTOR * f(N), MIN), MAX).
# One value: GROWTH * N elements. Only operations that can make more elements than their largest
# operand are checked before they allocate (SIZED_*); everything else cannot grow.
GROWTH = 16
MIN_ELEMENTS = 2**24
MAX_ELEMENTS = 2**36
# All the values of one evaluation together (each counted when made, even once freed): LIVE * N elements.
LIVE = 64
MIN_LIVE = 2**26
MAX_LIVE = 2**38
# Operations, estimated from shapes (2mnk for a matrix product): WORK * N**1.5. One matrix product of
# two operands of N elements each, whose result has at most GROWTH * N, takes at most 8 * N**1.5.
WORK = 64
MIN_WORK = 2**30
MAX_WORK = 2**50
MAX_PIECES = 2**16  # tensors split off by .split and .chunk in one evaluation
SORT_COST = 4  # operations per element and level of a sort (compare, move, and the indices it also returns)

# Functions and methods that can make more elements than their largest operand; calls to them are checked.
# Every other one makes at most as many as its largest operand (tests/test_expr.py lists those, so a function
# added to the allowlists must be put on one side or the other).
SIZED_FUNCTIONS = frozenset("matmul clamp where pow maximum minimum cat stack linear quantile einsum".split())
SIZED_METHODS = frozenset("expand matmul pow max min clamp quantile".split())
_META_COUNTED = frozenset({"quantile"})  # no formula: its shape is found on meta tensors
_REDUCING = frozenset("mean sum amax amin std var norm max min argmax argmin".split())  # work: every element read
_SORTING = frozenset("sort topk kthvalue quantile".split())  # work: SORT_COST * n log n
_SPLITTING = frozenset({"split", "chunk"})
CHARGED_BEFORE = SIZED_FUNCTIONS | SIZED_METHODS | _REDUCING | _SORTING | _SPLITTING
# Methods whose result is a view of their tensor (or a number): they make no elements.
VIEWS = frozenset(
    "view unflatten transpose permute unsqueeze squeeze detach t narrow expand expand_as size dim numel item"
    " chunk split".split()
)


# Each value is within the one-value bound, so this many values together are within the bound on all values
# (the floors and ceilings keep the same ratio): an expression making no more need not count elements.
UNCOUNTED_VALUES = LIVE // GROWTH
assert MIN_LIVE == UNCOUNTED_VALUES * MIN_ELEMENTS and MAX_LIVE == UNCOUNTED_VALUES * MAX_ELEMENTS

# One evaluation's account, a list made at the start of each by the compiled function (the cheapest thing to
# make per hook call): [its arguments, operations so far, elements made so far, tensors split off so far, its
# bounds once needed, whether it counts the elements of every value it makes]
Work = list
ENV, SPENT, MADE, PIECES, BOUNDS, COUNTING = range(6)


def limits(work: Work) -> tuple[int, int]:
    """(elements of all values, operations) this evaluation may reach, worked out once from its arguments."""
    if work[BOUNDS] is None:
        n = int(largest_input(work[ENV]))
        work[BOUNDS] = (min(max(LIVE * n, MIN_LIVE), MAX_LIVE), min(max(WORK * n * math.isqrt(n), MIN_WORK), MAX_WORK))
    return work[BOUNDS]  # type: ignore[no-any-return]


def spend(work: Work, operations: int) -> None:
    """Charge ``operations`` before they run; refuse past the bound."""
    work[SPENT] += operations
    if work[SPENT] > MIN_WORK:
        over(work)


def made(work: Work, value: Any) -> None:
    """Charge the elements of a value just made (a tensor, or the tensors of a tuple), as elements and as work."""
    if not work[COUNTING]:
        return
    if isinstance(value, torch.Tensor):
        count = value.numel()
    elif isinstance(value, tuple):  # sort, topk, kthvalue, where(cond)
        count = sum(t.numel() for t in value if isinstance(t, torch.Tensor))
    else:
        return
    work[MADE] += count
    work[SPENT] += count
    if work[MADE] > MIN_LIVE or work[SPENT] > MIN_WORK:  # the cheap test first: the bounds are never below these
        over(work)


def over(work: Work) -> None:
    """Refuse an evaluation that has made more elements or taken more operations than its bounds."""
    elements, operations = limits(work)
    if work[MADE] > elements:
        raise ActionError(
            f"its values would hold {work[MADE]:,} elements together, more than the {elements:,} an expression"
            f" may make here ({LIVE} × its largest input, at least {MIN_LIVE:,}, never more than {MAX_LIVE:,})"
        )
    if work[SPENT] > operations:
        raise ActionError(
            f"it would take about {work[SPENT]:,} operations, more than the {operations:,} an expression may take"
            f" here ({WORK} × N^1.5 for its largest input of N elements, at least {MIN_WORK:,},"
            f" never more than {MAX_WORK:,})"
        )


def charge_before(work: Work, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], function: Any) -> None:
    """Refuse ``function(*args, **kwargs)`` (torch.NAME, or the method with self first) before it runs when it
    would grow a value past its bound, take too many operations or split off too many tensors."""
    first = args[0] if args else None
    if name in SIZED_FUNCTIONS or name in SIZED_METHODS:
        count = _expand_count(first, args[1:]) if name == "expand" else _new_count(name, args, kwargs, function)
        grown(work[ENV], count, _tensors(args, kwargs))
        if name in ("matmul", "linear") and len(args) >= 2 and all(isinstance(t, torch.Tensor) for t in args[:2]):
            spend(work, 2 * count * (args[0].shape[-1] if args[0].dim() else 1))
        elif name == "einsum" and isinstance(first, str):
            operations, intermediates, _ = _einsum_work(first, args[1:])
            spend(work, operations)
            work[MADE] += intermediates  # the tensors einsum makes on its way; its result is counted when made
            if work[MADE] > MIN_LIVE:
                over(work)
    if not isinstance(first, torch.Tensor):
        return
    if name in _REDUCING:
        spend(work, first.numel())
    elif name in _SORTING:
        spend(work, SORT_COST * first.numel() * max(first.numel().bit_length(), 1))
    elif name in _SPLITTING:
        _split(work, name, first, args[1:], kwargs)


def _split(work: Work, name: str, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    how = args[0] if args else kwargs.get("split_size" if name == "split" else "chunks")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if isinstance(how, (list, tuple)):
        pieces = len(how)
    elif type(how) is int and how > 0 and type(dim) is int and -tensor.dim() <= dim < max(tensor.dim(), 1):
        size = tensor.shape[dim] if tensor.dim() else 1
        pieces = min(how, size) if name == "chunk" else -(-size // how)
    else:
        return  # torch says what is wrong
    work[PIECES] += pieces
    if work[PIECES] > MAX_PIECES:
        raise ActionError(f".{name}() would make {work[PIECES]:,} tensors in this evaluation, more than {MAX_PIECES:,}")


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


def largest_input(env: tuple[Any, ...]) -> int:
    return max((_largest(v) for v in env), default=0)


def element_limit(env: tuple[Any, ...]) -> int:
    """The most elements one value of an expression given ``env`` (its arguments) may have."""
    return min(max(GROWTH * largest_input(env), MIN_ELEMENTS), MAX_ELEMENTS)


def grown(env: tuple[Any, ...], count: int, operands: Any) -> None:
    """Refuse ``count`` new elements when that is more than every operand has and past the bound."""
    if count <= MIN_ELEMENTS or count <= max((t.numel() for t in operands if isinstance(t, torch.Tensor)), default=1):
        return
    limit = element_limit(env)
    if count > limit:
        raise ActionError(
            f"it would create a tensor of {count:,} elements, more than the {limit:,} an expression may create here"
            f" (at most {GROWTH} × its largest input, at least {MIN_ELEMENTS:,}, never more than {MAX_ELEMENTS:,})"
        )


def broadcast_count(*shapes: Any) -> int:
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


def matmul_count(a: Any, b: Any) -> int:
    if a.dim() == 0 or b.dim() == 0:
        return max(a.numel(), b.numel())
    rows = a.shape[-2] if a.dim() >= 2 else 1
    columns = b.shape[-1] if b.dim() >= 2 else 1
    return broadcast_count(a.shape[:-2], b.shape[:-2]) * rows * columns


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def _new_count(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], function: Callable[..., Any]) -> int:
    """How many elements ``function(*args, **kwargs)`` (torch.NAME, or the method with self first) would create."""
    if name in _META_COUNTED:
        return _meta_count(function, args, kwargs)
    if name in ("cat", "stack"):
        items = args[0] if args else kwargs.get("tensors", ())
        return sum(t.numel() for t in items if isinstance(t, torch.Tensor))
    if name == "einsum" and args and isinstance(args[0], str):
        return _einsum_work(args[0], args[1:])[2]
    if name == "matmul" and len(args) == 2 and all(isinstance(t, torch.Tensor) for t in args):
        return matmul_count(*args)
    if name == "linear" and len(args) >= 2 and all(isinstance(t, torch.Tensor) for t in args[:2]):
        x, weight = args[:2]
        return matmul_count(x, weight.mT if weight.dim() >= 2 else weight)
    shapes = [t.shape for t in _tensors(args, kwargs)]
    return broadcast_count(*shapes) if len(shapes) > 1 else 0


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


def _expand_count(tensor: Any, args: tuple[Any, ...]) -> int:
    sizes = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    if not isinstance(tensor, torch.Tensor) or not all(isinstance(s, int) for s in sizes) or len(sizes) < tensor.dim():
        return 0  # torch refuses it
    old = (1,) * (len(sizes) - tensor.dim()) + tuple(tensor.shape)
    count = 1
    for size, dim in zip(sizes, old):
        count *= dim if size == -1 else size
    return count


def _einsum_work(equation: str, operands: tuple[Any, ...]) -> tuple[int, int, int]:
    """(operations, elements made on the way, elements of the result) of einsum contracting left to right, as
    torch does (without opt_einsum; with it, torch picks a path no more costly).

    Each step multiplies the running result by the next operand over every index either has, then sums out
    the indices no later operand and not the output needs. Letters under ``...`` count as their broadcast.
    """
    if not operands or not all(isinstance(t, torch.Tensor) for t in operands):
        return 0, 0, 0
    text = equation.replace(" ", "")
    inputs, arrow, output = text.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        return 0, 0, 0  # torch says what is wrong
    sizes: dict[str, int] = {}
    spread: list[tuple[int, ...]] = [()]
    letters = []
    for term, tensor in zip(terms, operands):
        head, dots, tail = term.partition("...")
        shape = tuple(tensor.shape)
        if len(head) + len(tail) > len(shape):
            return 0, 0, 0
        if dots:
            spread.append(shape[len(head) : len(shape) - len(tail)])
        for letter, size in zip(head + tail, shape[: len(head)] + shape[len(shape) - len(tail) :]):
            sizes[letter] = max(sizes.get(letter, 1), size)
        letters.append(set(head + tail))
    wanted = set(output.replace("...", "")) if arrow else {letter for letter in sizes if inputs.count(letter) == 1}
    ellipsis = broadcast_count(*spread)
    running, operations, between = letters[0], 0, 0
    for i in range(1, len(letters)):
        joined = running | letters[i]
        operations += 2 * ellipsis * _product([sizes[letter] for letter in joined])
        needed = wanted.union(*letters[i + 1 :])
        running = {letter for letter in joined if letter in needed}
        if i < len(letters) - 1:
            between += ellipsis * _product([sizes[letter] for letter in running])
    operand_copies = sum(t.numel() for t in operands)  # torch may lay each operand out afresh for bmm
    if len(letters) == 1:  # a sum over indices or a diagonal: every element read once
        operations = ellipsis * _product(list(sizes.values()))
    kept = "..." in output if arrow else len(spread) > 1  # the broadcast dims stay in the result
    result = (ellipsis if kept else 1) * _product([sizes[letter] for letter in wanted])
    return operations, between + operand_copies, result


def _product(values: list[int]) -> int:
    """The product of ``values`` (a loop rather than ``math.prod``, which torch.compile cannot trace)."""
    result = 1
    for value in values:
        result *= value
    return result


def index_count(value: torch.Tensor, parts: tuple[Any, ...]) -> int:
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
