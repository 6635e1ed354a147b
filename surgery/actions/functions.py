"""``function: NAME``: act on the results of calls of a torch function inside a module's forward.

Built on PyTorch's own mechanism: a ``torch.overrides.TorchFunctionMode`` that a forward pre-hook
enters and a forward hook (``always_call=True``, so an exception leaves it too) exits, both owned
by the ledger like every other hook. Only the selected modules carry these hooks, so the rest of
the model runs as before; inside a selected module every torch call passes through the mode,
and only calls of NAME (``torch.NAME``, ``torch.nn.functional.NAME`` and ``Tensor.NAME`` alike;
``a @ b`` counts as ``matmul``) are acted on. Calls made by submodules of the selected module
count too (they run inside its forward); torch calls made inside NAME itself do not (the mode is
off while it handles a call).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.overrides import TorchFunctionMode

from surgery.actions.base import Step, hook_failed
from surgery.core.calls import CallCounter, parse_calls
from surgery.core.ledger import Ledger
from surgery.core.records import Call, detached
from surgery.core.select import Target
from surgery.errors import ConfigError

FUNCTION_MODE = "torch function mode"  # the plan table's mechanism for `function:` actions
OnCall = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]  # (module, args, kwargs, result) -> result


@cache
def callables_of(name: str) -> frozenset[Any]:
    """Every torch callable that counts as the function ``name``: torch.X, F.X, Tensor.X (and ``@`` for matmul)."""
    found = {getattr(owner, name, None) for owner in (torch, F, torch.Tensor, torch.special, torch.linalg)}
    found.discard(None)
    if name == "matmul":
        found |= {torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}
    return frozenset(found)


class _Inside(TorchFunctionMode):
    """While entered, calls of the watched functions go to ``on_call``; everything else runs as it is."""

    def __init__(self, watched: frozenset[Any], on_call: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]):
        super().__init__()
        self.watched = watched
        self.on_call = on_call

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in self.watched:
            return self.on_call(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def register_inside(ledger: Ledger, action: str, target: Target, cfg: Any, on_result: OnCall) -> None:
    """Hooks that enter the mode around each selected call of ``target`` and hand NAME's results to ``on_result``."""
    module, name = target.module, target.name
    wanted = parse_calls(cfg.calls)  # every kind taking function: is Hooked, so has calls
    counter = CallCounter()
    ledger.counters.append(counter)
    entered: list[bool] = []  # one per call in flight: a module called inside itself exits the right mode

    def on_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = func(*args, **kwargs)
        try:
            return on_result(module, args, kwargs, result)
        except Exception as e:
            raise hook_failed(action, name, e) from e

    mode = _Inside(callables_of(cfg.function), on_call)

    def enter(m: nn.Module, args: tuple[Any, ...]) -> None:
        n = counter.n
        counter.n = n + 1
        selected = wanted is None or wanted(n)
        entered.append(selected)
        if selected:
            mode.__enter__()

    def leave(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if entered and entered.pop():
            mode.__exit__(None, None, None)

    ledger.hook(module.register_forward_pre_hook, enter)
    # first among the forward hooks: hooks of other actions run outside the mode, as they would without it
    ledger.hook(module.register_forward_hook, leave, always_call=True, prepend=True)


def inside_step(kind: Any, cfg: Any, targets: list[Target], ctx: Any, make: Callable[[Ledger, Target], OnCall]) -> Step:
    """The step of a kind with ``function:``: ``make(ledger, target)`` gives what to do with each result."""
    action = ctx.name

    def apply(ledger: Ledger) -> None:
        for target in ledger.each(action, targets, lambda t: t.name):
            register_inside(ledger, action, target, cfg, make(ledger, target))

    watch = partial(watch_calls, action, cfg.function)  # the probe forward checks the function runs in there
    return Step(ctx.name, kind.name, FUNCTION_MODE, cfg, targets, apply, watch=watch)


class _Seen(TorchFunctionMode):
    """Probe mode: notes which watched functions run."""

    def __init__(self, watched: frozenset[Any], seen: set[int]) -> None:
        super().__init__()
        self.watched, self.seen = watched, seen

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in self.watched:
            self.seen.add(1)
        return func(*args, **(kwargs or {}))


def probe_function(target: Target, function: str) -> tuple[list[Any], set[int], list[bool]]:
    """Hooks for the probe forward noting whether ``function`` runs inside ``target``; (handles, seen, ran)."""
    seen: set[int] = set()
    ran: list[bool] = []
    mode = _Seen(callables_of(function), seen)

    def enter(m: nn.Module, args: tuple[Any, ...]) -> None:
        ran.append(True)
        mode.__enter__()

    def leave(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        mode.__exit__(None, None, None)

    handles = [
        target.module.register_forward_pre_hook(enter),
        target.module.register_forward_hook(leave, always_call=True, prepend=True),
    ]
    return handles, seen, ran


def watch_calls(action: str, function: str, target: Target) -> tuple[list[Any], Callable[[], None]]:
    """The probe forward's hooks on ``target`` and the check after it that ``function`` ran inside (a ``Watch``)."""
    handles, seen, ran = probe_function(target, function)
    return handles, partial(check_called, action, function, target, seen, ran)


def check_called(action: str, name: str, target: Target, seen: set[int], ran: list[bool]) -> None:
    """Refuse a ``function`` the module's forward never called on the example input (it would act on nothing)."""
    if ran and not seen:
        raise ConfigError(
            f"actions.{action}.function: {type(target.module).__name__}.forward of {target.name!r} never calls"
            f" {name} on the example input (torch.{name}, torch.nn.functional.{name} or Tensor.{name}); it may use"
            " another function (e.g. scaled_dot_product_attention instead of softmax: attn_implementation='eager')"
        )


def capture_on(cfg: Any, action: str, tensors_in: Callable[[Any, str], list[tuple[str, torch.Tensor]]]) -> Callable:
    """``make`` for ``capture`` with ``function``: one Call per function call (its args as input, result as output)."""
    want_input, want_output = "input" in cfg.what, "output" in cfg.what

    def make(ledger: Ledger, target: Target) -> OnCall:
        if cfg.to == "disk":
            ledger.streamed.add(action)
        if cfg.plot:
            ledger.plotted.add(action)
        record = ledger.record(action, target.name, cfg.reduce)
        if cfg.reduce != "none":
            running_for = record.running_for

            def fold(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
                found = (tensors_in(args, "input") + tensors_in(kwargs, "input") if want_input else []) + (
                    tensors_in(result, "output") if want_output else []
                )
                for key, tensor in found:
                    running_for(key).add(tensor)
                return result

            return fold
        calls = record.calls

        def keep(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
            calls.append(
                Call(
                    input=detached(args) if want_input else None,
                    kwargs=detached(kwargs) if want_input and kwargs else None,
                    output=detached(result) if want_output else None,
                )
            )
            return result

        return keep

    return make


def modify_on(build: Callable[[], Any], item: Any) -> Callable:
    """``make`` for ``modify_output`` with ``function``: the op on each result (its ``item`` for a tuple)."""
    from surgery.core.structure import get_item, replace_item

    def make(ledger: Ledger, target: Target) -> OnCall:
        op = build()

        def change(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
            if type(result) is torch.Tensor:
                return op(result, m)
            return replace_item(result, item, op(get_item(result, item), m))

        return change

    return make


def replace_on(computes: dict[int, Callable[..., Any]], with_kwargs: bool) -> Callable:
    """``make`` for ``replace_forward`` with ``function``: each result becomes ``compute(module, args, result)``."""

    def make(ledger: Ledger, target: Target) -> OnCall:
        compute = computes[id(target.module)]
        if with_kwargs:
            return lambda m, args, kwargs, result: compute(m, args, result, kwargs)
        return lambda m, args, kwargs, result: compute(m, args, result)

    return make
