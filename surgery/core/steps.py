"""What the compiler and every action kind share: the kinds registry, the bind context and the bound ``Step``.

Kinds live in ``surgery.actions`` and register into ``KINDS`` when that package is imported
(``import surgery`` does it); the compiler looks them up here, so the engine never imports its plug-ins.
A kind validates its config against the modules it matched (``bind``, at plan time, touching nothing)
and returns the ``Step`` that performs it (``apply``, given the ``Ledger`` that owns every change).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from surgery.core.ledger import Ledger
from surgery.core.registry import Registry
from surgery.core.select import Target

APPLY_PASS = "apply pass"
FORWARD_PRE_HOOK = "forward pre-hook"
FORWARD_HOOK = "forward hook"
FULL_BACKWARD_HOOK = "full backward hook"
FULL_BACKWARD_PRE_HOOK = "full backward pre-hook"
TENSOR_HOOK = "tensor hook"
STATE_DICT_HOOK = "state-dict hook"

# Hooks for the probe forward on one module, and the check to run after it: (handles, check)
Watch = Callable[[Target], tuple[list[Any], Callable[[], None]]]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor an earlier action of the same plan will add."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "parameters" or "buffers"


@dataclass
class BindContext:
    """What a kind may know while binding: names, settings, the model, earlier additions."""

    name: str
    seed: int
    strict: bool
    safe: bool
    root: nn.Module
    added: dict[int, dict[str, TensorSpec]] = field(default_factory=dict)
    requires_grad: dict[int, bool] = field(default_factory=dict)  # flags earlier freeze/unfreeze will set
    earlier: list[Step] = field(default_factory=list)  # the steps bound before this one (from: {capture} checks)

    @property
    def where(self) -> str:
        """Config path of this action, for messages: ``actions.NAME``."""
        return f"actions.{self.name}"


@dataclass(frozen=True)
class ShapeCheck:
    """What an action needs at one module's input or output, checked by a probe forward:
    that ``index`` applies, and (for a patch) that the written part has ``shape``."""

    where: str  # the action's config path, e.g. actions.p
    what: str  # "input" or "output"
    item: Any  # position or key within the input/output
    index: tuple | None  # the slice the action writes
    index_text: str | None  # the slice as configured, for the message
    shape: tuple[int, ...] | None  # a patch's shape, or None
    source: str  # what provides the shape, for the message
    heads: int | None = None  # the tensor is viewed as [..., heads, d_head] before index (the @heads site)


def fits(source: tuple[int, ...], full: tuple[int, ...], part: tuple[int, ...], sliced: bool) -> bool:
    """Whether a source of shape ``source`` can be written onto ``part`` (the whole tensor ``full`` cut by index).

    It broadcasts onto the part itself, or (``sliced``) onto the whole tensor, which is then cut like it.
    """
    return broadcasts(source, part) or (sliced and broadcasts(source, full))


def broadcasts(source: tuple[int, ...], onto: tuple[int, ...]) -> bool:
    """Whether a tensor shaped ``source`` broadcasts onto one shaped ``onto`` without changing its shape."""
    try:
        return torch.broadcast_shapes(source, onto) == onto
    except RuntimeError:
        return False


@dataclass
class Step:
    """One action bound to what it matched; ``apply(ledger)`` performs it."""

    name: str
    kind: str
    mechanism: str
    config: Any
    targets: list[Target]
    apply: Callable[[Ledger], None]
    tensors: list[str] = field(default_factory=list)  # full names, for parameter-level kinds
    enabled: bool = True
    shape_checks: list[tuple[Target, ShapeCheck]] = field(default_factory=list)
    replaced: list[Target] = field(default_factory=list)  # modules a replace_module step puts in
    after_plan: Callable[[], None] | None = None  # a check that needs every action bound (compile_plan calls it)
    streams: bool = False  # its records go to disk batch by batch (capture with to: disk)
    watch: Watch | None = None  # what the probe forward checks on each target beyond shapes (function: is called)
    added: tuple[str, ...] = ()  # names of the tensors it registers on each target, when not just ``config.name``
    live: dict[str, Any] = field(default_factory=dict)  # what apply made per target that a saver reads (by name)

    @property
    def traits(self) -> type[Kind]:
        """The kind's class, which carries its traits (``observes``, ``sized``, ...)."""
        return KINDS.get(self.kind)


class Kind:
    """An action kind: a schema, the PyTorch mechanism it compiles to, its traits, and ``bind``.

    Traits live here, not in lists elsewhere: ``observes`` (records or prints, changes nothing the
    model computes), ``choices`` (the key whose values the reference lists, and those values),
    ``sized`` (its records count against ``max_bytes`` in the probe forward), ``ddp_advice`` (why
    applying it to a model already wrapped in DistributedDataParallel goes wrong, for a plan warning),
    ``adds`` (registers new tensors on each target, ``config.name`` or the step's ``added`` names:
    ``Surgery.added_state_dict`` keeps them).
    """

    name: ClassVar[str]
    schema: ClassVar[type]
    mechanism: ClassVar[str]
    observes: ClassVar[bool] = False
    choices: ClassVar[tuple[str, tuple[str, ...]] | None] = None
    sized: ClassVar[bool] = False
    ddp_advice: ClassVar[str | None] = None
    adds: ClassVar[bool] = False

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check ``cfg`` against the matched modules and return the step that applies it."""
        raise NotImplementedError


KINDS: Registry[type[Kind]] = Registry("action kind")
# save_added formats: ``writer(surgery, path)`` writes what an applied surgery added (kinds register theirs)
SAVE_FORMATS: Registry[Callable[[Any, Any], None]] = Registry("save_added format")
