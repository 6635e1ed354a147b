"""The one owner of everything a surgery changes: hook handles, undo records and captures.

Every change goes through one ledger call that makes it and records its undo at once, as
PyTorch's ``register_*`` returns its handle: ``hook``, ``overwrite``, ``overwrite_by``,
``set_attr``, ``swap_child``, ``add_tensor``. There is no separate "remember to undo" step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from surgery.core.records import Record

T = TypeVar("T")
_MISSING = object()

# Attributes PyTorch creates lazily on the first hook and never resets when the hook is removed:
# a module's backward-hook mode (None until a backward hook is registered; a later register_backward_hook
# raises if it stays True) and a tensor's hook dicts (None until the first hook).
MODULE_LAZY = ("_is_full_backward_hook",)
TENSOR_LAZY = ("_backward_hooks", "_post_accumulate_grad_hooks")


@dataclass
class _Claim:
    """What a lazy attribute was before any live surgery hooked the object, and how many hooks hold it."""

    ref: weakref.ref
    before: dict[str, Any]
    count: int


# id(module or tensor) -> claim, shared by all ledgers: with two surgeries on one module, the first one's
# "before" is the real one, whichever is removed last puts it back
_CLAIMS: dict[int, _Claim] = {}


def _lazy_state(owner: Any) -> dict[str, Any]:
    if isinstance(owner, nn.Module):
        return {name: getattr(owner, name, None) for name in MODULE_LAZY}
    return {name: getattr(owner, name, None) is None for name in TENSOR_LAZY}  # True: was None


def _claim(owner: Any, before: dict[str, Any]) -> None:
    claim = _CLAIMS.get(id(owner))
    if claim is None or claim.ref() is not owner:  # none, or a dead object's id reused
        _CLAIMS[id(owner)] = _Claim(weakref.ref(owner), before, 1)
    else:
        claim.count += 1


def _unhook(handle: RemovableHandle, owner: Any) -> None:
    """Remove the hook; when it was the last of ours on ``owner``, put lazy attributes back as they were."""
    handle.remove()
    claim = _CLAIMS.get(id(owner))
    if claim is None or claim.ref() is not owner:
        return
    claim.count -= 1
    if claim.count:
        return
    del _CLAIMS[id(owner)]
    if isinstance(owner, nn.Module):
        if not owner._backward_hooks:  # a backward hook the user added meanwhile keeps its mode
            owner._is_full_backward_hook = claim.before["_is_full_backward_hook"]
        return
    for name, was_none in claim.before.items():
        if was_none and getattr(owner, name, None) is not None and not getattr(owner, name):
            setattr(owner, name, None)


def _in_main_pass(ledger: Ledger, hook: Callable, *args: Any, **kwargs: Any) -> Any:
    """A ``passes: main`` action's hook: acts outside a source pass; inside it returns None (changes nothing)."""
    return None if ledger.sourcing else hook(*args, **kwargs)


def _copy_back(tensor: torch.Tensor, old: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.copy_(old)


def _put_back(obj: Any, name: str, old: Any) -> None:
    if old is _MISSING:
        delattr(obj, name)
    else:
        setattr(obj, name, old)


def _unshadow(obj: Any, name: str, old: Any) -> None:
    if old is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        object.__setattr__(obj, name, old)


class Ledger:
    """Makes every change of a surgery and keeps its undo, so ``rollback`` restores the model exactly."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], object]] = []
        self._handles: list[RemovableHandle] = []
        self._paused: list[tuple[dict, list, dict]] | None = None  # (hook dict, its order, our hooks taken out)
        self.hook_count: dict[str, int] = {}
        self.captures: dict[str, dict[str, Record]] = {}
        self.touched: set[Hashable] = set()  # tensors, flags and module slots whose old state undo restores
        self.originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, value before 1st write)
        self.keep_originals = False  # keep them past rollback, for Surgery.remove(verify=True)
        self.streamed: set[str] = set()  # capture actions written to disk batch by batch
        self.plotted: set[str] = set()  # capture actions whose records are plotted
        self.sourcing = False  # inside Surgery.source_pass(): ops reading from: {capture} change nothing
        self.main_only = False  # while applying a `passes: main` action: its hooks do nothing in a source pass
        self.counters: list[Any] = []  # call counters of hooks with `calls:` (calls.CallCounter), for reset_calls
        self.action = ""
        self.where = ""

    def each(self, action: str, targets: Iterable[T], name: Callable[[T], str]) -> Iterator[T]:
        """Iterate targets while remembering which one is being changed, for error messages."""
        self.action = action
        for target in targets:
            self.where = name(target)
            yield target

    # ---- changes: each call makes one change and owns its undo

    def hook(
        self, register: Callable[..., RemovableHandle], hook: Callable, *args: Any, **kwargs: Any
    ) -> RemovableHandle:
        """Register ``hook`` with ``register`` (a bound ``register_*`` method of a module or tensor) and own it.

        ``ledger.hook(module.register_forward_hook, fn, with_kwargs=True)``; undo removes the hook and, with
        the last of ours on that module or tensor, the attributes PyTorch set on the first hook.
        """
        owner = getattr(register, "__self__", None)
        before = _lazy_state(owner) if owner is not None else {}
        if self.main_only:
            hook = partial(_in_main_pass, self, hook)
        handle = register(hook, *args, **kwargs)
        if owner is not None:
            _claim(owner, before)
            self._own(partial(_unhook, handle, owner))
        else:
            self._own(handle.remove)
        self._handles.append(handle)
        self.hook_count[self.action] = self.hook_count.get(self.action, 0) + 1
        return handle

    def overwrite(self, tensor: torch.Tensor, new: torch.Tensor | Callable[[torch.Tensor], object]) -> None:
        """Write ``new`` (values, or a function filling the tensor in place) into ``tensor`` under no_grad."""
        self._keep(tensor)
        with torch.no_grad():
            if isinstance(new, torch.Tensor):
                tensor.copy_(new)
            else:
                new(tensor)

    def overwrite_by(self, tensors: Iterable[torch.Tensor], change: Callable[[], T]) -> T:
        """Run ``change``, which writes into ``tensors`` in place (e.g. ``load_state_dict``); undo restores them."""
        for tensor in tensors:
            self._keep(tensor)
        return change()

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)`` (a flag such as a tensor's ``requires_grad``); undo puts the old one back."""
        old = getattr(obj, name, _MISSING)
        setattr(obj, name, value)
        self.touched.add(("attr", id(obj), name))
        self._own(partial(_put_back, obj, name, old))

    def shadow(self, obj: Any, name: str, value: Any) -> None:
        """Set instance attribute ``name`` over the class's (a wrapped ``forward``); undo deletes it again.

        ``set_attr`` would put back the bound method it read as an instance attribute; this puts back
        exactly what ``obj.__dict__`` held, or nothing.
        """
        old = obj.__dict__.get(name, _MISSING)
        object.__setattr__(obj, name, value)
        self.touched.add(("attr", id(obj), name))
        self._own(partial(_unshadow, obj, name, old))

    def swap_child(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        """Put ``new`` in ``parent`` as child ``name`` (same place in its children); undo puts the old one back."""
        if name not in parent._modules:
            raise KeyError(f"{type(parent).__name__} has no child module {name!r}")
        self.set_attr(parent, name, new)

    def add_tensor(
        self, module: nn.Module, name: str, tensor: torch.Tensor, kind: str, persistent: bool = True
    ) -> None:
        """Register a new parameter (``kind="parameters"``) or buffer on ``module``; undo deletes it."""
        if kind == "parameters":
            module.register_parameter(name, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor))
        else:
            module.register_buffer(name, tensor, persistent=persistent)
        self.touched.add(("attr", id(module), name))
        self._own(partial(delattr, module, name))

    def _keep(self, tensor: torch.Tensor) -> None:
        """Copy the values now and own the undo that writes them back (before the change, so a failure undoes it)."""
        old = tensor.detach().clone()
        self.originals.setdefault(id(tensor), (tensor, old))
        self.touched.add(("value", id(tensor)))
        self._own(partial(_copy_back, tensor, old))

    def _own(self, undo: Callable[[], object]) -> None:
        """Record one undo: every change above passes here once (fault-injection tests fail it here)."""
        self._undo.append(undo)

    # ---- captures

    def record(self, action: str, key: str, reduce: str = "none") -> Record:
        """The capture record for (action, key), created on first use."""
        per_action = self.captures.setdefault(action, {})
        if key not in per_action:
            per_action[key] = Record(f"{action}/{key}", reduce)
        return per_action[key]

    # ---- pausing: hooks out of their dicts and back in the same place; nothing is checked per call

    @property
    def paused(self) -> bool:
        """Whether ``pause`` took the hooks out."""
        return self._paused is not None

    def pause(self) -> None:
        """Take our hooks out of PyTorch's hook dicts, remembering each dict's order."""
        if self._paused is not None:
            return
        taken: dict[int, tuple[dict, list, dict]] = {}
        for handle in self._handles:
            hooks = handle.hooks_dict_ref()
            if hooks is None or handle.id not in hooks:
                continue
            entry = taken.setdefault(id(hooks), (hooks, list(hooks), {}))
            entry[2][handle.id] = hooks.pop(handle.id)
        self._paused = list(taken.values())

    def resume(self) -> None:
        """Put the hooks back where they were; hooks added while paused stay after them."""
        for hooks, order, ours in self._paused or ():
            now = dict(hooks)
            rebuilt = [(k, ours[k] if k in ours else now.pop(k)) for k in order if k in ours or k in now]
            hooks.clear()
            hooks.update(rebuilt)
            hooks.update(now)
        self._paused = None

    def rollback(self) -> list[BaseException]:
        """Undo everything in reverse order; keep going past failures and return them."""
        self._paused = None  # hooks taken out by pause are simply not put back
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - every other undo must still run
                errors.append(e)
        self._handles.clear()
        self.hook_count.clear()
        if not self.keep_originals:
            self.originals.clear()
        return errors

    def __len__(self) -> int:
        return len(self._undo)


def values_of(tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The distinct tensors of a state dict (tied weights appear once)."""
    return list({id(t): t for t in tensors.values()}.values())
