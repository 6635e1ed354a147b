"""Apply a plan all-or-nothing and own the result: ``Surgery.remove`` restores the model exactly."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

from surgery.core.compiled import RAN, WRAPPER, compiled_state
from surgery.core.compiler import Plan, compile_plan
from surgery.core.ledger import Ledger, values_of
from surgery.core.records import Record, _caller_outside_surgery, flatten_captures
from surgery.core.restore import ModelState
from surgery.core.steps import SAVE_FORMATS
from surgery.core.tensors import unshared
from surgery.core.wrapped import inner_module
from surgery.errors import ActionError, CompiledModelWarning, ConfigError, SurgeryError


class Surgery:
    """An applied plan: its captures, and ``remove()`` which undoes every change.

    >>> with surgery.apply(model, "capture_block3") as s:
    ...     model(x)
    ...     s.captures["capture_block3"]["block3"].output
    """

    def __init__(self, model: nn.Module, plan: Plan, ledger: Ledger, before: ModelState | None = None) -> None:
        self.model = model
        self.plan = plan
        self._ledger = ledger
        self._before = before  # the model's state before apply, when applied with verify=True
        self.active = True

    @property
    def captures(self) -> dict[str, dict[str, Record]]:
        """``captures[ACTION][MODULE or PARAMETER]`` → Record with ``.input/.output/.calls`` etc."""
        return self._ledger.captures

    @property
    def plotted(self) -> set[str]:
        """Capture actions configured with ``plot: true``."""
        return set(self._ledger.plotted)

    @property
    def hook_count(self) -> dict[str, int]:
        """Hooks registered per action (while active)."""
        return dict(self._ledger.hook_count)

    def added_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer this surgery added, by ``MODULE.NAME`` (detached, sharing their storage).

        ``add_parameter ... init: {from: {file: PATH}}`` reads them back (its default key is ``MODULE.NAME``).
        """
        if not self.active:
            raise ActionError("added_state_dict: this surgery was removed, and its added tensors with it")
        found: dict[str, torch.Tensor] = {}
        for step in self.plan.steps:
            if not (step.enabled and step.traits.adds):
                continue
            own = getattr(step.config, "name", None)  # add_parameter's one name; other kinds list theirs in added
            for target in step.targets:
                for name in step.added or ((own,) if isinstance(own, str) else ()):
                    module = target.module
                    tensor: torch.Tensor | None = module._parameters.get(name)
                    tensor = module._buffers.get(name) if tensor is None else tensor
                    if tensor is not None:
                        found[name if target.name == "<root>" else f"{target.name}.{name}"] = tensor.detach()
        return found

    def save_added(self, path: Any, format: str = "safetensors") -> None:  # noqa: A002 - the config key's name
        """Write what this surgery added: ``safetensors`` (one file of ``added_state_dict()``), ``peft`` (a PEFT
        LoRA adapter directory of its ``kind: lora`` actions) or ``saelens`` (a SAELens directory per splice).

        Files are written atomically: a failed write leaves no half file.
        """
        from pathlib import Path

        if not self.active:
            raise ActionError("save_added: this surgery was removed, and its added tensors with it")
        SAVE_FORMATS.get(str(format), "save_added.format")(self, Path(path))

    def take_streamed(self) -> dict[str, torch.Tensor]:
        """The calls of ``to: disk`` captures since the last take, keyed ``ACTION/MODULE/WHAT[/CALL]``, then forgotten.

        Taken after each batch (the CLI writes them as one shard), this bounds capture memory by about one batch.
        No two tensors share memory, so ``safetensors.torch.save_file(s.take_streamed(), path)`` works.
        """
        streamed = {a: self._ledger.captures.get(a, {}) for a in self._ledger.streamed}
        flat = unshared(flatten_captures(streamed))
        for records in streamed.values():
            for record in records.values():
                record.calls.clear()
        return flat

    def reset_calls(self) -> None:
        """Count calls from 0 again for ``calls:`` (the CLI does it before each batch; ``generate``'s prompt is 0)."""
        for counter in self._ledger.counters:
            counter.n = 0

    @contextmanager
    def source_pass(self) -> Iterator[None]:
        """Run a source pass inside: captures record it, actions reading ``from: {capture}`` change nothing,
        and on exit the calls recorded inside (only those) become their source for the calls after.

        Calls recorded before the pass stay in ``captures``; a pass that raises changes no record.
        ``calls:`` counts from 0 inside the pass and again after it (``reset_calls()`` on entry and exit).

        >>> with surgery.apply(model, actions) as s:
        ...     with s.source_pass():
        ...         model(clean)
        ...     patched = model(corrupted)
        """
        records = [r for records in self._ledger.captures.values() for r in records.values()]
        before = [r.set_aside() for r in records]  # the calls recorded before stay in calls, and are not sources
        self.reset_calls()  # calls: numbers the source pass's calls from 0, and the main pass's after it
        self._ledger.sourcing = True
        try:
            yield
        except BaseException:  # a failed source pass leaves every record as it was before it
            for record, kept in zip(records, before):
                record.calls[:] = kept
            raise
        finally:
            self._ledger.sourcing = False
            self.reset_calls()
        for record, kept in zip(records, before):
            record.freeze(kept)

    def freeze_sources(self) -> None:
        """Every call each capture holds now becomes what ``from: {capture: ACTION}`` reads.

        Captures then record afresh; in each forward of the model the k-th call of a module reads the
        k-th frozen call of the same module (a ``keep: last`` capture's one call serves every call).
        ``source_pass()`` does this for the calls made inside it only. The frozen calls stay readable
        as ``Record.sources``.
        """
        for records in self._ledger.captures.values():
            for record in records.values():
                record.freeze()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a checkpoint into the surgered model through its ``on_load`` hooks; ``remove()`` undoes it."""
        if not self.active:
            raise ActionError("load_state_dict: this surgery was removed; apply it again first")
        tensors = values_of(self.model.state_dict(keep_vars=True))
        return self._ledger.overwrite_by(tensors, lambda: self.model.load_state_dict(state, strict=strict))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Turn this surgery's hooks off without removing them: inside, the model runs as without them.

        The hooks leave PyTorch's hook dicts and come back in the same order on exit, so nothing is
        checked per call. Changes made in an apply pass (weights, flags, added tensors, swapped
        modules) stay. Removing the surgery inside is allowed; nothing is put back then.
        """
        if not self.active or self._ledger.paused:
            yield
            return
        self._ledger.pause()
        try:
            yield
        finally:
            if self.active:
                self._ledger.resume()

    def remove(self, verify: bool | None = None) -> None:
        """Remove every hook, delete added tensors, restore changed ones; safe to call twice.

        ``verify`` (default: when applied with ``verify=True``) then checks the model equals its state
        before apply in every hook attribute, module, tensor slot, flag and value, and raises an
        ActionError naming what differs.
        """
        if verify and self._before is None:
            raise ActionError(
                "remove(verify=True): this surgery was applied without verify; apply it with verify=True to keep"
                " the state to compare with"
            )
        if self.active:
            self._remove()
        if verify is not False and self._before is not None:
            diffs = self._before.differences(ModelState.of(self.model), self._ledger.originals)
            if diffs:
                more = f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else ""
                written = any("in place" in d or "values differ" in d for d in diffs)
                hint = (
                    " (a model trained, or run in train mode, while the surgery was applied changes its tensors)"
                    if written
                    else ""
                )
                raise ActionError(f"remove: the model is not restored exactly: {'; '.join(diffs[:5])}{more}{hint}")

    def _remove(self) -> None:
        refs = _ACTIVE.get(self.model, [])
        stack = [s for s in (ref() for ref in refs) if s is not None and s.active]
        later = stack[stack.index(self) + 1 :] if self in stack else []
        clash = [s for s in later if s._ledger.touched & self._ledger.touched]
        if clash:
            raise ActionError(
                f"remove the later surgery first ({', '.join(st.name for st in clash[-1].plan.steps)}): it changed"
                " the same tensors or modules after this one, so removing this one first could not restore the"
                " model exactly; remove surgeries in reverse order"
            )
        self.active = False
        refs[:] = [ref for ref in refs if ref() is not None and ref() is not self]
        warn_if_compiled(self.model, "removed")
        errors = self._ledger.rollback()
        if errors:
            raise ActionError(f"removing the surgery hit {len(errors)} error(s); first: {errors[0]!r}")

    def __enter__(self) -> Surgery:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.remove(verify=None if kind is None else False)  # a failed check must not hide the error in flight

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<Surgery {state}: {', '.join(s.name for s in self.plan.steps)}>"


def warn_if_compiled(model: nn.Module, done: str) -> None:
    """Warn when torch.compile may not see this change: a compiled wrapper, or a model that has run compiled."""
    state = compiled_state(model)
    if state == WRAPPER:
        message = (
            f"surgery {done} on a torch.compile-d model: if it has already run compiled, torch keeps using the"
            " graph it compiled and ignores this change. Apply surgery before the first compiled call, or call"
            " torch._dynamo.reset() after applying and after removing."
        )
    elif state == RAN and done == "applied":  # removing is seen: Dynamo guards the hooks it compiled with
        message = (
            "surgery applied to a model that has already run compiled (torch.compile, .compile() or a compiled"
            " function calling it) while Dynamo still holds its graphs: compiled calls keep using the graph"
            " compiled before and may ignore this change (eager calls see it). Apply surgery before the first"
            " compiled call, or call torch._dynamo.reset() after applying (compiling again reuses the old graph)."
        )
    else:
        return
    # the user's line, however deep (apply, remove, a with block's exit): a fixed level named surgery's own files
    warnings.warn(message, CompiledModelWarning, stacklevel=_caller_outside_surgery())


def apply_plan(model: nn.Module, plan: Any = None, *, verify: bool = False, **plan_options: Any) -> Surgery:
    """Apply every step of ``plan`` (a Plan, or actions to compile) or none of them.

    ``verify=True`` first notes the model's state (structure, hook attributes, flags, tensor versions;
    no copy of the weights) so that ``remove()`` checks the model came back exactly.
    """
    model = inner_module(model)
    if not isinstance(plan, Plan):
        plan = compile_plan(model, plan, **plan_options)
    elif plan.model is not model:
        raise ConfigError("apply: this plan was compiled for another model; compile it for this one")
    elif plan_options:
        raise ConfigError(f"apply: options {sorted(plan_options)} only apply when compiling; the plan is compiled")
    warn_if_compiled(model, "applied")
    before = ModelState.of(model) if verify else None
    ledger = Ledger()
    ledger.keep_originals = verify
    for step in plan.steps:
        if not step.enabled:
            continue
        try:
            ledger.main_only = getattr(step.config, "passes", "both") == "main"
            step.apply(ledger)
        except BaseException as e:
            where = ledger.where
            ledger.rollback()
            if isinstance(e, SurgeryError) or not isinstance(e, Exception):
                raise
            raise ActionError(
                f"actions.{step.name}: failed on {where!r}: {type(e).__name__}: {str(e).rstrip('.')}."
                " Nothing was changed."
            ) from e
        finally:
            ledger.main_only = False
    surgery = Surgery(model, plan, ledger, before)
    _ACTIVE.setdefault(model, []).append(weakref.ref(surgery))
    return surgery


# surgeries applied per model, oldest first (weakly held), so remove() can refuse an order it cannot undo exactly
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref[Surgery]]] = weakref.WeakKeyDictionary()


@SAVE_FORMATS.register("safetensors")
def save_safetensors(surgery: Surgery, path: Any) -> None:
    """``save_added``'s default: every added tensor, keyed ``MODULE.NAME``, in one .safetensors file."""
    from surgery.files.write import write_tensors

    write_tensors(path, surgery.added_state_dict(), "save_added")
