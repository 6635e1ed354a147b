"""Pick and replace one element of a module's input or output, whatever its container.

A plain tensor is used as it is whatever ``item`` says, so one recipe serves models that
return a tensor and models that return a tuple. Tuples, lists and mappings (including
Hugging Face ``ModelOutput``, which is an ordered dict) are indexed by ``item``: an int, or a
key for mappings; an int on a mapping picks the i-th value as ``ModelOutput`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch


def get_item(value: Any, item: Any) -> Any:
    """The element ``item`` of ``value`` (``value`` itself when it is a tensor)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        return value[_key(value, item)]
    if isinstance(value, (tuple, list)):
        if not isinstance(item, int):
            raise TypeError(f"a {type(value).__name__} is indexed by position, got item {item!r}")
        return value[item]
    raise TypeError(f"cannot pick item {item!r} from a {type(value).__name__}")


def not_a_tensor_to_cut(what: str, value: Any) -> str:
    """Why ``index`` cannot cut the whole ``what`` (``value``, not a tensor), and the key that would work."""
    return f"the {what} is a {type(value).__name__}, and index cuts a tensor; pick one with item (e.g. item: 0)"


def replace_item(value: Any, item: Any, new: Any) -> Any:
    """A copy of ``value`` with element ``item`` replaced by ``new`` (``new`` for a tensor)."""
    if isinstance(value, torch.Tensor):
        return new
    if isinstance(value, Mapping):
        out = copy.copy(value)
        out[_key(value, item)] = new  # type: ignore[index]
        return out
    if isinstance(value, tuple):
        items = list(value)
        items[item] = new
        return _tuple_like(value, items)
    if isinstance(value, list):
        out_list = list(value)
        out_list[item] = new
        return out_list
    raise TypeError(f"cannot replace item {item!r} in a {type(value).__name__}")


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor inside; tuples (named ones and structseqs too), lists and
    dicts (``ModelOutput`` too) are rebuilt as the same type, so ``.values`` or ``.logits`` still read."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return _tuple_like(value, [map_tensors(v, fn) for v in value])
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: map_tensors(v, fn) for k, v in value.items()}
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = map_tensors(v, fn)
        return out
    return value


def _tuple_like(value: tuple, items: list[Any]) -> tuple:
    """``items`` as a tuple of ``value``'s type: a plain tuple, a namedtuple or a structseq."""
    if type(value) is tuple:  # the common case (Hugging Face outputs): no attribute lookups
        return tuple(items)
    if hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*items)
    if hasattr(type(value), "n_sequence_fields"):  # a structseq: torch.max(x, dim), sort, topk, ...
        return type(value)(items)
    return tuple(items)


def _key(mapping: Mapping, item: Any) -> Any:
    if item in mapping:
        return item
    if isinstance(item, int):
        return list(mapping)[item]
    raise KeyError(f"no key {item!r}; keys are {', '.join(map(str, mapping))}")


def find_logits(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: the tensor itself, its ``logits`` (attribute or key), else the first tensor
    of a tuple, list or mapping; None when it holds none (each caller refuses in its own words)."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, Mapping):
        found = output.get("logits")
    if isinstance(found, torch.Tensor):
        return found
    items = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in items if isinstance(v, torch.Tensor)), None)
