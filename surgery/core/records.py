"""What captures hold: one ``Record`` per (action, module or parameter), one ``Call`` per call."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from surgery.core.running import Running
from surgery.core.structure import map_tensors
from surgery.errors import SurgeryError


@dataclass(slots=True)
class Call:
    """One forward or backward call as seen by a hook; fields not captured stay None."""

    input: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    output: Any = None
    grad_input: tuple[torch.Tensor | None, ...] | None = None
    grad_output: tuple[torch.Tensor | None, ...] | None = None
    grad: torch.Tensor | None = None
    features: Any = None  # a splice's feature activations (or {values, indices} with features_top)
    stamps: tuple[tuple[torch.Tensor, int], ...] | None = None  # (recorded tensor, its version when recorded)


class RecordChangedWarning(UserWarning):
    """A recorded tensor was changed in place after it was captured (capture it with ``clone: true``)."""


def stamps_of(value: Any) -> tuple[tuple[torch.Tensor, int], ...]:
    """(tensor, version) for a tensor or the tensors of a tuple/list/dict, to tell later in-place changes."""
    items = (value,) if isinstance(value, torch.Tensor) else value.values() if isinstance(value, dict) else value
    if not isinstance(items, (tuple, list)) and not isinstance(value, dict):
        return ()
    versions = [(t, version_of(t)) for t in items if isinstance(t, torch.Tensor)]
    return tuple((t, v) for t, v in versions if v is not None)


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, or None for an inference-mode tensor (Lightning's eval loops), which has none.

    A try rather than ``is_inference()``, which torch.compile cannot trace.
    """
    try:
        return tensor._version
    except RuntimeError:
        return None


class Record:
    """Every call recorded for one module (or parameter) by one action; attributes read the last.

    With ``reduce`` the calls are not kept: ``running[WHAT]`` holds statistics instead and
    ``reduced`` gives them as tensors. Hooks only append to lists (atomic) or go through a lock,
    so a model running in several threads loses no call.
    """

    def __init__(self, key: str, reduce: str = "none") -> None:
        self.key = key
        self.reduce = reduce
        self.outputs: list[Any] = []  # (output, version or None) from the output-only hook; Calls when read
        self.latest: dict[int, Any] = {}  # keep: last, output only: the hook stores latest[0] = (output, version)
        self.sources: list[Call] | None = None  # the calls frozen by Surgery.freeze_sources (a source pass)
        self._calls: list[Call] = []
        self.running: dict[str, Running] = {}
        self._lock = threading.Lock()

    def running_for(self, what: str) -> Running:
        """The running statistics of ``what``, made once even when several threads ask at the same time."""
        running = self.running.get(what)
        if running is None:
            with self._lock:
                running = self.running.setdefault(what, Running(stats=self.reduce == "stats"))
        return running

    @property
    def calls(self) -> list[Call]:
        """Every call recorded, oldest first (a hook may append to this list)."""
        outputs = self.outputs
        if outputs:  # one Call per output only when someone looks: the hook stays a bare append
            with self._lock:  # two readers at once would each move the same outputs
                taken = len(outputs)  # outputs appended meanwhile by another thread's hook stay for the next look
                self._calls.extend([_stamped(pair) for pair in outputs[:taken]])
                del outputs[:taken]
        if self.latest:
            pair = self.latest.pop(0, None)
            if pair is not None:
                self._calls[:] = [_stamped(pair)]
        self._warn_changed()
        return self._calls

    def freeze(self, kept: list[Call] | None = None) -> None:
        """Keep the calls recorded so far as this record's sources; ``calls`` then holds ``kept`` (or nothing)."""
        self.sources = list(self.calls)
        self._calls[:] = kept or []

    def set_aside(self) -> list[Call]:
        """Take the calls recorded so far out of ``calls`` (a source pass records into an empty list)."""
        taken = list(self.calls)
        self._calls.clear()
        return taken

    def _warn_changed(self) -> None:
        """Warn (once per call) when a tensor recorded without a copy was written in place afterwards."""
        for i, call in enumerate(self._calls):
            stamps = call.stamps
            if stamps and any(t._version != v for t, v in stamps):
                call.stamps = None
                warnings.warn(
                    f"{self.key}: call {i} was changed in place after it was captured (e.g. by a ReLU(inplace=True)"
                    " after the module), so it no longer holds what the module gave; capture with clone: true",
                    RecordChangedWarning,
                    stacklevel=_caller_outside_surgery(),
                )

    @property
    def reduced(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{WHAT: {"mean": ..., ["std", "min", "max"]}}`` for ``reduce: mean|stats``, plus ``count``."""
        return {what: {**r.summary(), "count": torch.tensor(r.count)} for what, r in list(self.running.items())}

    def _last(self) -> Call:
        if not self.calls:
            raise SurgeryError(f"{self.key}: no call was recorded (did the model run through it?)")
        return self.calls[-1]

    @property
    def input(self) -> tuple[Any, ...] | None:
        """Positional inputs of the last call."""
        return self._last().input

    @property
    def kwargs(self) -> dict[str, Any] | None:
        """Keyword inputs of the last call (captured with ``what: input``)."""
        return self._last().kwargs

    @property
    def output(self) -> Any:
        """Output of the last call."""
        return self._last().output

    @property
    def grad_input(self) -> tuple[torch.Tensor | None, ...] | None:
        """Gradients w.r.t. the module's inputs in the last backward call."""
        return self._last().grad_input

    @property
    def grad_output(self) -> tuple[torch.Tensor | None, ...] | None:
        """Gradients w.r.t. the module's outputs in the last backward call."""
        return self._last().grad_output

    @property
    def grad(self) -> torch.Tensor | None:
        """The parameter's gradient in the last backward call (``capture_grad`` with ``param``)."""
        return self._last().grad

    @property
    def features(self) -> Any:
        """A splice's features in the last call: ``[..., d_sae]``, or ``{values, indices}`` with ``features_top``."""
        return self._last().features

    def __repr__(self) -> str:
        return f"Record({self.key!r}, calls={len(self.calls)})"


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../surgery/


def _caller_outside_surgery() -> int:  # pragma: no mutate block (a trampolined copy would count mutmut's frames)
    """The ``stacklevel`` (as seen by our caller) of the first frame outside the surgery package: the user's line.

    A fixed level would name records.py when the record is read through ``.output`` or ``_last`` (one frame
    deeper than ``.calls``), or engine.py through ``take_streamed``.
    """
    level, frame = 1, sys._getframe(1)  # our caller: what warn's stacklevel=1 names
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


def _stamped(pair: tuple[Any, int | None]) -> Call:
    """A Call from what an output-only hook stored: ``(output, version of a tensor output or None)``."""
    output, version = pair
    return Call(output=output, stamps=None if version is None else ((output, version),))


def detached(value: Any) -> Any:
    """Detach tensors inside tuples/lists/dicts (of the same types) so records hold no autograd graph."""
    return value.detach() if isinstance(value, torch.Tensor) else map_tensors(value, torch.Tensor.detach)


def flatten_captures(captures: dict[str, dict[str, Record]]) -> dict[str, torch.Tensor]:
    """Captures as ``ACTION/MODULE/WHAT[/CALL]`` → tensor; tuple elements are ``WHAT.i``, keywords ``input.NAME``.

    A dict output (e.g. a ``ModelOutput``) gives ``output.KEY``.
    """
    flat: dict[str, torch.Tensor] = {}
    for action, records in captures.items():
        for key, record in records.items():
            for what, summary in record.reduced.items():
                for stat, tensor in summary.items():
                    flat[f"{action}/{key}/{what}/{stat}"] = tensor
            several = len(record.calls) > 1
            for i, call in enumerate(record.calls):
                suffix = f"/{i}" if several else ""
                for what in ("input", "kwargs", "output", "grad_input", "grad_output", "grad", "features"):
                    value = getattr(call, what)
                    what = "input" if what == "kwargs" else what
                    if isinstance(value, torch.Tensor):
                        flat[f"{action}/{key}/{what}{suffix}"] = value
                    elif isinstance(value, (tuple, list, dict)):
                        items = value.items() if isinstance(value, dict) else enumerate(value)
                        for j, v in items:
                            if isinstance(v, torch.Tensor):
                                flat[f"{action}/{key}/{what}.{j}{suffix}"] = v
    return flat
