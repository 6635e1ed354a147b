"""The hooks behind ``capture``'s keys: ``detach``, ``clone``, ``item``/``index``, ``keep``, ``stop``, ``always``.

``output_hook`` is the common case (outputs only, every call or the last) and stays as cheap as a
hand-written ``store[name] = output`` hook. ``register_calls`` records whole calls (inputs, keyword
inputs, parts). ``stop`` raises ``StopForward`` after the last selected module; the root's forward,
wrapped through the ledger (``Ledger.shadow``: an instance attribute removed again exactly), catches
it and returns None, so ``model(x)`` inside ``with surgery.apply(...)`` returns None and the block goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.actions.base import KeyedError, hook_failed, hook_on, input_at
from surgery.core.ledger import Ledger
from surgery.core.records import Call, Record, detached, stamps_of, version_of
from surgery.core.select import Target
from surgery.core.structure import get_item, map_tensors, not_a_tensor_to_cut


class StopForward(Exception):  # noqa: N818 - not an error: the way a forward ends early (baukit's name)
    """Raised by a ``stop: true`` capture after its module; caught by the root's wrapped forward."""


def item_of(cfg: Any, what: str) -> Any:
    """The element a capture's ``item``/``index`` applies to: ``item``, else input 0, else the whole output."""
    if cfg.item is not None:
        return cfg.item
    return 0 if what == "input" else None


def output_hook(record: Record, detach: bool, last: bool) -> Callable[..., None]:
    """A forward hook storing ``(output, version)``: appended to ``record.outputs``, or ``record.latest[0]``."""
    outputs, latest = record.outputs, record.latest
    if last:

        def keep_last(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if type(output) is torch.Tensor:
                t = output.detach() if detach else output
                latest[0] = (t, version_of(t))
            else:
                latest[0] = (detached(output) if detach else output, None)

        return keep_last

    def keep_all(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if type(output) is torch.Tensor:
            t = output.detach() if detach else output
            outputs.append((t, version_of(t)))
        else:
            outputs.append((detached(output) if detach else output, None))

    return keep_all


def input_hook(record: Record, last: bool) -> Callable[..., None]:
    """A forward hook storing each call's inputs (and keyword inputs) detached, with their versions: ``what:
    [input]`` with no ``item``, ``index``, ``clone`` or ``always``, as cheap as a hand-written hook."""
    calls = record.calls

    def keep(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if kwargs or not all(type(a) is torch.Tensor for a in args):
            held, named = detached(args), detached(kwargs) if kwargs else None
            stamps = stamps_of(held) + stamps_of(named or {})
        else:  # the usual call: positional tensors only
            held, named = tuple(a.detach() for a in args), None
            stamps = tuple((t, v) for t in held if (v := version_of(t)) is not None)
        call = Call(input=held, kwargs=named, stamps=stamps)
        if last:
            calls[:] = [call]
        else:
            calls.append(call)

    return keep


def _part(value: Any, item: Any, index: tuple | None, detach: bool, clone: bool, heads: int | None = None) -> Any:
    """What a record keeps of an input/output: ``item``, viewed as ``heads``, then ``index`` (a copy)."""
    if item is not None:
        value = get_item(value, item)
    if heads is not None and isinstance(value, torch.Tensor):
        value = value.unflatten(-1, (heads, -1))
    if index is not None:
        value = value[index]
    if clone or index is not None:
        return _copied(value, detach)
    return detached(value) if detach else value


def _copied(value: Any, detach: bool) -> Any:
    """A copy of every tensor in ``value`` (detached too with ``detach``), containers of the same types."""
    return map_tensors(value, (lambda t: t.detach().clone()) if detach else torch.Tensor.clone)


def register_calls(
    ledger: Ledger, record: Record, cfg: Any, target: Target, index: tuple | None, position: int | None
) -> None:
    """Hooks recording whole calls: inputs (and keyword inputs), output, each cut to ``item``/``index``.

    With ``always`` a pre-hook records the inputs before the forward runs, so a forward that raises still
    leaves its call (output None); the forward hook then adds the output to that call.
    """
    want_input, want_output = "input" in cfg.what, "output" in cfg.what
    detach, clone, last, action, name = cfg.detach, cfg.clone, cfg.keep == "last", ledger.action, target.name
    calls = record.calls
    viewed = cfg.item is not None or index is not None or cfg.heads is not None
    in_item, out_item, heads = item_of(cfg, "input") if viewed else None, cfg.item, cfg.heads

    def store(call: Call) -> None:
        if last:
            calls[:] = [call]
        else:
            calls.append(call)

    def inputs(call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if in_item is not None:  # a position, or a name: by keyword, else at its place in forward's signature
            came, at = input_at(args, kwargs, in_item, position)
            call.input = _part(came, at, index, detach, clone, heads)
        else:
            call.input = _part(args, None, None, detach, clone)
            call.kwargs = _part(kwargs, None, None, detach, clone) if kwargs else None
        if not (clone or index is not None):
            call.stamps = (call.stamps or ()) + stamps_of(call.input) + stamps_of(call.kwargs or {})

    def outputs(call: Call, output: Any) -> None:
        if index is not None and out_item is None and not isinstance(output, torch.Tensor):
            raise KeyedError("index", not_a_tensor_to_cut("output", output))
        call.output = _part(output, out_item, index, detach, clone, heads)
        if not (clone or index is not None):
            call.stamps = (call.stamps or ()) + stamps_of(call.output)

    pending: list[Call] = []

    def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            call = Call()
            inputs(call, args, kwargs)
            store(call)
            pending.append(call)
        except Exception as e:
            raise hook_failed(action, name, e) from e

    def after(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        try:
            if cfg.always:
                if pending and want_output:
                    outputs(pending.pop(), output)
                elif pending:
                    pending.pop()
                return
            call = Call()
            if want_input:
                inputs(call, args, kwargs)
            if want_output:
                outputs(call, output)
            store(call)
        except Exception as e:
            raise hook_failed(action, name, e) from e

    if cfg.always:
        hook_on(ledger, target.module.register_forward_pre_hook, before, cfg, with_kwargs=True)
    hook_on(ledger, target.module.register_forward_hook, after, cfg, with_kwargs=True)


def stop_hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """End the forward here: the root's wrapped forward catches this and returns None."""
    raise StopForward


def stop_at_root(ledger: Ledger, root: nn.Module) -> None:
    """Wrap the root's forward (once per ledger) so that StopForward ends it with None; undo removes the wrapper."""
    if getattr(root.forward, "_surgery_stop", None) is ledger:
        return
    forward = root.forward  # the bound method, or whatever instance forward is already there

    def stop_forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except StopForward:
            return None

    stop_forward._surgery_stop = ledger  # type: ignore[attr-defined]
    ledger.shadow(root, "forward", stop_forward)
