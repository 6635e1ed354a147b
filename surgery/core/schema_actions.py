"""The action schemas: one dataclass per action kind, with its cross-field checks (``__post_init__``).

Split from ``surgery.core.schema`` (which re-exports every name here) to keep each file readable.
A check raises ``FieldError(key, message)``; ``schema.validate`` turns it into one ``ConfigError``
naming ``WHERE.KEY``.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from surgery.errors import did_you_mean


class FieldError(ValueError):
    """A cross-field check failed on one key; ``validate`` adds where it is."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def one_of(key: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise FieldError unless ``value`` is one of ``choices``."""
    if value not in choices:
        hint = did_you_mean(str(value), choices)
        raise FieldError(key, f"{value!r} is not one of {', '.join(choices)}.{hint}")


def yaml_key(name: str) -> str:
    """The config key of a field: ``with_`` is written ``with`` (Python keywords need the ``_``)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def field_name(key: str) -> str:
    """The field of a config key: ``with`` → ``with_``."""
    return f"{key}_" if keyword.iskeyword(key) else key


# ---------------------------------------------------------------- actions


@dataclass
class Action:
    """Keys every action has (SPEC §3)."""

    kind: str = MISSING  # which action
    select: Any = None  # module-name glob or list of globs; absent: every module
    type: Any = None  # class-name glob(s): Conv2d, Function_*, torch.nn.Conv2d
    exclude: Any = None  # name glob(s) removed from the match
    allow_empty: bool = False  # matching nothing is not an error
    enabled: bool = True  # false skips the action

    def __post_init__(self) -> None:
        for key in ("select", "type", "exclude"):
            value = getattr(self, key)
            if value is None or isinstance(value, str):
                continue
            if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                raise FieldError(key, f"must be a glob string or a non-empty list of them, got {value!r}")


FORWARD_FNS = ("identity", "zero", "linear")


@dataclass
class ReplaceForwardAction(Action):
    """replace_forward: the module's output becomes ``expr`` or a built-in ``fn``."""

    fn: Any = None  # identity | zero | linear | pkg.module:function | a _target_ node: fn(module, inputs, output)
    expr: str | None = None  # e.g. "x * module.W + module.b"

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.fn is None) == (self.expr is None):
            raise FieldError("fn", "give exactly one of fn (identity, zero, linear, pkg.module:function) or expr")
        if isinstance(self.fn, str) and ":" not in self.fn:
            one_of("fn", self.fn, FORWARD_FNS)


@dataclass
class ReplaceModuleAction(Action):
    """replace_module: swap each selected module for a new one built from ``with``."""

    with_: Any = MISSING  # a _target_ node, e.g. {_target_: torch.nn.GELU}; one instance per module

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.with_, dict) and "_target_" in self.with_):
            raise FieldError("with", f"needs a _target_ node such as {{_target_: torch.nn.GELU}}, got {self.with_!r}")


@dataclass
class OnLoadAction(Action):
    """on_load: load_state_dict pre/post hooks on the selected module (the root by default)."""

    select: Any = "<root>"  # the module whose load_state_dict keys are rewritten
    rename: dict[str, str] = field(default_factory=dict)  # checkpoint key glob -> new name, wildcards kept in order
    ignore_added: bool = True  # tensors added by this plan are not reported missing


TENSOR_OPS = ("add", "mul", "set", "zero", "clamp", "noise", "mean_ablate", "expr", "fn", "patch")
GRAD_OPS = TENSOR_OPS + ("clip_norm", "clip_value")
OP_NEEDS = {
    "add": ("value",), "mul": ("value",), "set": ("value",), "noise": ("std",),
    "expr": ("expr",), "clip_norm": ("max_norm",), "clip_value": ("value",), "fn": ("fn",), "patch": ("from_",),
}  # fmt: skip


@dataclass
class OpArgs:
    """An op on a tensor, shared by the modify kinds."""

    op: str = MISSING  # which op: see the ops listed below
    value: float | None = None  # add, mul, set, clip_value
    min: float | None = None  # clamp
    max: float | None = None  # clamp
    std: float | None = None  # noise
    dim: Any = 0  # mean_ablate: dim or list of dims to average over
    max_norm: float | None = None  # clip_norm
    expr: str | None = None  # expr: the new value; the tensor is named output, x or grad
    fn: Any = None  # fn: pkg.module:function or a _target_ node, called fn(tensor) -> tensor
    from_: Any = None  # patch: {file: captures.safetensors of an earlier run, key: ACTION/MODULE/WHAT}
    index: str | None = None  # subscript such as "[:, 3:5]": only that slice changes

    def check_op(self, ops: tuple[str, ...]) -> None:
        """Check the op is known here and has the values it needs."""
        one_of("op", self.op, ops)
        for key in OP_NEEDS.get(self.op, ()):
            if getattr(self, key) is None:
                raise FieldError(yaml_key(key), f"op {self.op!r} needs {yaml_key(key)}")
        if self.op == "patch":
            source = self.from_
            if not (isinstance(source, dict) and set(source) == {"file", "key"}):
                raise FieldError("from", f"needs {{file: PATH, key: ACTION/MODULE/WHAT}}, got {source!r}")
        elif self.from_ is not None:  # it would be ignored: the op would run on the model's own tensor
            raise FieldError("from", f"only op 'patch' takes from (a captured tensor), not op {self.op!r}")
        if self.op == "noise" and (self.std or 0) < 0:
            raise FieldError("std", f"must be >= 0 (the noise's standard deviation), got {self.std}")
        if self.op == "clamp" and self.min is None and self.max is None:
            raise FieldError("min", "op 'clamp' needs min, max or both")
        if self.op == "clamp" and self.min is not None and self.max is not None and self.min > self.max:
            raise FieldError("min", f"clamp needs min <= max, got min={self.min} and max={self.max}")
        if self.op == "clip_norm" and self.max_norm is not None and self.max_norm <= 0:
            raise FieldError("max_norm", f"must be > 0, got {self.max_norm}")
        dims = self.dim if isinstance(self.dim, list) else [self.dim]
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise FieldError("dim", f"a dim or a list of dims (ints) to average over, got {self.dim!r}")


@dataclass
class ModifyAction(Action, OpArgs):
    """modify_output / modify_input: an op on one item of the output or positional input."""

    item: Any = 0  # output: tuple/list/dict element (int or key); input: position; a plain tensor is used as is

    def __post_init__(self) -> None:
        Action.__post_init__(self)
        self.check_op(TENSOR_OPS)


@dataclass
class ModifyGradAction(Action, OpArgs):
    """modify_grad: an op on grad_input (full backward hook) or on a parameter's grad."""

    param: str | None = None  # set: Tensor.register_hook on these parameters
    item: int | None = None  # which grad_input element; absent: every tensor element

    def __post_init__(self) -> None:
        Action.__post_init__(self)
        self.check_op(GRAD_OPS)


@dataclass
class CaptureAction(Action):
    """capture: record inputs and/or outputs of every call."""

    what: list[str] = field(default_factory=lambda: ["output"])  # input, output
    to: str = "memory"  # memory (s.captures, then captures.safetensors) | disk (one shard per batch)
    reduce: str = "none"  # none: every call | mean | stats: running elementwise stats over calls and batch
    max_bytes: int | None = None  # refuse, before running, a capture that would hold more than this
    plot: bool = False  # write plots/*.png of the last call: feature-map grid or histogram

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.what:
            raise FieldError("what", "list at least one of input, output")
        for w in self.what:
            one_of("what", w, ("input", "output"))
        one_of("to", self.to, ("memory", "disk"))
        one_of("reduce", self.reduce, ("none", "mean", "stats"))
        if self.reduce != "none" and self.to == "disk":
            raise FieldError("to", "reduce keeps running statistics in memory; drop to: disk or reduce")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise FieldError("max_bytes", f"must be a positive number of bytes, got {self.max_bytes}")


@dataclass
class CaptureGradAction(Action):
    """capture_grad: record grad_input/grad_output, or a parameter's gradient with ``param``."""

    param: str | None = None  # set: Tensor.register_hook on these parameters
    plot: bool = False  # write plots/*.png of the last call's gradients


@dataclass
class LogAction(Action):
    """log: print module name, input/output shapes and stats per call."""

    stats: bool = True  # also print mean/std/min/max
