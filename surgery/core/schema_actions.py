"""The action schemas: one dataclass per action kind, with its cross-field checks (``__post_init__``).

Split from ``surgery.core.schema`` (which re-exports every name here) to keep each file readable.
A check raises ``FieldError(key, message)``; ``schema.validate`` turns it into one ``ConfigError``
naming ``WHERE.KEY``.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import MISSING

from surgery.core.calls import parse_calls
from surgery.core.limits import count_refusal
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


PASSES = ("both", "main")


@dataclass
class Action:
    """Keys every action has (SPEC §3)."""

    kind: str = MISSING  # which action
    select: Any = None  # module-name glob or list of globs, or @sites (@mlp.3; docs/architectures.md); absent: all
    type: Any = None  # class-name glob(s): Conv2d, Function_*, torch.nn.Conv2d
    exclude: Any = None  # name glob(s) removed from the match
    allow_empty: bool = False  # matching nothing is not an error
    enabled: bool = True  # false skips the action
    passes: str = "both"  # main: the hooks act in the main pass only, not in a source pass (a causal trace's noise)

    def __post_init__(self) -> None:
        one_of("passes", self.passes, PASSES)
        for key in ("select", "type", "exclude"):
            value = getattr(self, key)
            if value is None or isinstance(value, str):
                continue
            if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                raise FieldError(key, f"must be a glob string or a non-empty list of them, got {value!r}")


@dataclass
class Hooked:
    """Keys of every kind that runs as hooks in a call: which calls, and where among hooks already there."""

    calls: Any = None  # which calls of each module, from 0: a slice "1:", ":2", "::2" or a list [0, 2]; absent: all
    prepend: bool = False  # register before the hooks already on the module (PyTorch's prepend=True)

    def check_hooked(self) -> None:
        """Refuse a ``calls`` value that is malformed or can never match."""
        try:
            parse_calls(self.calls)
        except ValueError as e:
            raise FieldError("calls", str(e)) from None
        if isinstance(self.calls, (list, tuple)):
            refused = count_refusal(len(self.calls), "call numbers")
            if refused is not None:
                raise FieldError("calls", refused)


# torch functions `function:` can act on inside a module's forward (torch.X, torch.nn.functional.X and Tensor.X alike)
FUNCTIONS = (
    "softmax", "log_softmax", "scaled_dot_product_attention", "matmul", "bmm", "baddbmm", "einsum", "linear",
    "layer_norm", "gelu", "relu", "silu", "sigmoid", "tanh", "dropout", "embedding", "conv1d", "conv2d", "addmm",
)  # fmt: skip


@dataclass
class Inside:
    """``function:``: act on the results of calls of a torch function inside the module's forward."""

    function: str | None = None  # e.g. softmax: each call of it inside the selected module's forward, not its output

    def check_inside(self) -> None:
        """The function must be one ``function:`` knows."""
        if self.function is not None:
            one_of("function", self.function, FUNCTIONS)
            if self.prepend:  # type: ignore[attr-defined]
                raise FieldError("prepend", "function: hooks enter around the forward itself; drop prepend")


FORWARD_FNS = ("identity", "zero", "linear")


@dataclass
class ReplaceForwardAction(Hooked, Inside, Action):
    """replace_forward: the module's output becomes ``expr`` or a built-in ``fn``."""

    objects: ClassVar[tuple[str, ...]] = ("fn",)  # Python dict recipes: fn may be a callable

    fn: Any = None  # identity | zero | linear | pkg.module:function | a _target_ node: fn(module, inputs, output)
    expr: str | None = None  # e.g. "x * module.W + module.b"; may read kwargs (keyword inputs): kwargs['bias']

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hooked()
        self.check_inside()
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
    "noise": ("std",), "expr": ("expr",), "clip_norm": ("max_norm",), "clip_value": ("value",), "fn": ("fn",),
    "patch": ("from_",),
}  # fmt: skip
SOURCE_OPS = ("add", "mul", "set", "patch")  # the ops that take from: (add, mul, set: value or from)
SOURCE_FORMS = (
    "{file: PATH, key: ACTION/MODULE/WHAT}, {capture: ACTION, what: output, reduce: none|mean, dim: 0}"
    " or (Python recipes) a tensor"
)
# Python objects a dict recipe may give (the keys of the schemas listing them in ``objects``); while OmegaConf
# checks the rest, each stands in as a value of the field's type, then __post_init__ checks again with the object.
PLACEHOLDERS: dict[str, Any] = {"value": 0.0, "fn": "python:object", "from_": {"file": "-", "key": "-"}}


@dataclass
class OpArgs:
    """An op on a tensor, shared by the modify kinds."""

    op: str = MISSING  # which op: see the ops listed below
    objects: ClassVar[tuple[str, ...]] = ("value", "fn", "from_")  # Python dict recipes: a tensor, a callable

    value: float | None = None  # add, mul, set (or a tensor in Python recipes), clip_value
    min: float | None = None  # clamp
    max: float | None = None  # clamp
    std: float | None = None  # noise
    seed: int | None = None  # noise: the stream's key (0 to 2**63-1); null: sha256 of "RUN_SEED/ACTION_NAME"
    dim: Any = 0  # mean_ablate: dim or list of dims to average over
    max_norm: float | None = None  # clip_norm
    expr: str | None = None  # expr: the new value; the tensor is named output, x or grad
    fn: Any = None  # fn: pkg.module:function or a _target_ node, called fn(tensor) -> tensor
    from_: Any = None  # add, mul, set, patch: {file, key} | {capture: ACTION, what, reduce, dim} | a tensor
    index: str | None = None  # subscript such as "[:, 3:5]": only that slice changes
    scale: float | None = None  # add, mul, set, patch: the value or source is multiplied by this first
    vector: Any = None  # a vector of the run's vectors: block, put in as value before planning (surgery/vectors)

    def check_op(self, ops: tuple[str, ...]) -> None:
        """Check the op is known here and has the values it needs."""
        one_of("op", self.op, ops)
        for key in OP_NEEDS.get(self.op, ()):
            if getattr(self, key) is None:
                raise FieldError(yaml_key(key), f"op {self.op!r} needs {yaml_key(key)}")
        if self.vector is not None:  # surgery.vectors puts the vector in as value; a name left here has none
            raise FieldError(
                "vector",
                f"{self.vector!r} is not a vector here: name one of the run's vectors: block"
                " (docs/vectors.md); in Python, surgery.vectors.steering(actions, {name: tensor})",
            )
        self.check_source()
        if self.scale is not None and self.op not in SOURCE_OPS:
            takers = ", ".join(SOURCE_OPS)
            raise FieldError("scale", f"multiplies the value or source of ops {takers}, not op {self.op!r}")
        if self.op == "noise" and (self.std or 0) < 0:
            raise FieldError("std", f"must be >= 0 (the noise's standard deviation), got {self.std}")
        if self.seed is not None and (self.op != "noise" or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63):
            raise FieldError("seed", f"op noise takes a seed from 0 to 2**63-1 (its stream's key), got {self.seed!r}")
        if self.op == "clamp" and self.min is None and self.max is None:
            raise FieldError("min", "op 'clamp' needs min, max or both")
        if self.op == "clamp" and self.min is not None and self.max is not None and self.min > self.max:
            raise FieldError("min", f"clamp needs min <= max, got min={self.min} and max={self.max}")
        if self.op == "clip_norm" and self.max_norm is not None and self.max_norm <= 0:
            raise FieldError("max_norm", f"must be > 0, got {self.max_norm}")
        dims = self.dim if isinstance(self.dim, list) else [self.dim]
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise FieldError("dim", f"a dim or a list of dims (ints) to average over, got {self.dim!r}")

    def check_source(self) -> None:
        """``from``: one of SOURCE_FORMS, on an op that takes it; add, mul, set take value or from, not both."""
        source, op = self.from_, self.op
        if op in ("add", "mul", "set") and (self.value is None) == (source is None):
            if source is None:
                raise FieldError("value", f"op {op!r} needs value (a number) or from (a tensor source)")
            raise FieldError("from", f"op {op!r} takes value or from, not both")
        if isinstance(self.value, torch.Tensor) and op not in ("add", "mul", "set"):
            raise FieldError("value", f"a tensor value is taken by ops add, mul and set, not op {op!r}")
        if source is None:
            return
        if op not in SOURCE_OPS:  # it would be ignored: the op would run on the model's own tensor
            raise FieldError("from", f"only ops {', '.join(SOURCE_OPS)} take from (a tensor source), not op {op!r}")
        if isinstance(source, torch.Tensor) or (isinstance(source, dict) and set(source) == {"file", "key"}):
            return
        if not (isinstance(source, dict) and "capture" in source):
            raise FieldError("from", f"needs {SOURCE_FORMS}, got {source!r}")
        extra = sorted(set(source) - {"capture", "what", "reduce", "dim"})
        if extra:
            raise FieldError(f"from.{extra[0]}", "unknown key; a capture source takes capture, what, reduce, dim")
        if not isinstance(source["capture"], str):
            raise FieldError("from.capture", f"the name of a capture action listed before, got {source['capture']!r}")
        one_of("from.what", source.get("what", "output"), ("input", "output"))
        one_of("from.reduce", source.get("reduce", "none"), ("none", "mean"))
        dims = source.get("dim", 0)
        if not all(
            isinstance(d, int) and not isinstance(d, bool) for d in (dims if isinstance(dims, list) else [dims])
        ):
            raise FieldError("from.dim", f"a dim or a list of dims (ints) to average over, got {dims!r}")


def check_heads(heads: Any, function: Any) -> None:
    """``heads``: a positive number of heads, and not with ``function:`` (which acts inside a forward)."""
    if heads is None:
        return
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise FieldError("heads", f"the number of attention heads the last dim splits into (1 or more), got {heads!r}")
    if function is not None:
        raise FieldError("heads", "views a module's input or output, not the calls of function:; drop one")


@dataclass
class ModifyAction(Hooked, Inside, Action, OpArgs):
    """modify_output / modify_input: an op on one item of the output or positional input."""

    item: Any = 0  # output: tuple/list/dict element (int or key); input: position; a plain tensor is used as is
    heads: int | None = None  # view the last dim as [heads, d_head] for the op and index (set by the @heads site)

    def __post_init__(self) -> None:
        Action.__post_init__(self)
        self.check_op(TENSOR_OPS)
        self.check_hooked()
        self.check_inside()
        check_heads(self.heads, self.function)


GRAD_WHAT = ("grad_input", "grad_output")


@dataclass
class ModifyGradAction(Hooked, Action, OpArgs):
    """modify_grad: an op on grad_input (full backward hook) or on a parameter's grad."""

    param: str | None = None  # set: Tensor.register_hook on these parameters
    item: int | None = None  # which grad_input (grad_output) element; absent: every tensor element
    what: str = "grad_input"  # grad_input (full backward hook) | grad_output (full backward pre-hook: reaches
    # the module's own parameter gradients)

    def __post_init__(self) -> None:
        Action.__post_init__(self)
        self.check_op(GRAD_OPS)
        self.check_hooked()
        one_of("what", self.what, GRAD_WHAT)
        if self.param is not None and self.what != "grad_input":
            raise FieldError("what", "a parameter's gradient is one tensor; drop what when param is set")


@dataclass
class CaptureAction(Hooked, Inside, Action):
    """capture: record inputs and/or outputs of every call."""

    objects: ClassVar[tuple[str, ...]] = ("fn",)  # Python dict recipes: fn may be a callable

    what: list[str] = field(default_factory=lambda: ["output"])  # input, output
    to: str = "memory"  # memory (s.captures, then captures.safetensors) | disk (one shard per batch)
    reduce: str = "none"  # none: every call | mean | stats: running elementwise stats over calls and batch
    max_bytes: int | None = None  # refuse, before running, a capture that would hold more than this
    plot: bool = False  # write plots/*.png of the last call: feature-map grid or histogram
    detach: bool = True  # false: records keep the autograd graph (auxiliary and distillation losses)
    clone: bool = False  # true: records own a copy, safe from later in-place ops (ReLU(inplace=True))
    item: Any = None  # store only this element of a tuple/list/dict input or output (int or key)
    index: str | None = None  # store only this subscript of it, e.g. "[:, -1]"
    keep: str = "all"  # all: every call | last: only the last call (like a hand-written store[name] = output)
    stop: bool = False  # end the forward after the last selected module: model(x) returns None
    always: bool = False  # record the inputs even when the forward raises (what must list input)
    fn: Any = None  # record fn(module, inputs, output) as the output instead (pkg.module:function, or a callable)
    heads: int | None = None  # view the last dim as [heads, d_head] before index (set by the @heads site)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hooked()
        self.check_inside()
        self.check_capture_keys()
        check_heads(self.heads, self.function)
        if self.heads is not None and (self.fn is not None or self.reduce != "none"):
            raise FieldError("heads", "views each recorded call; drop fn and reduce")
        if self.fn is not None:
            clash = [k for k, bad in (("what", self.what != ["output"]), ("reduce", self.reduce != "none"),
                     ("item", self.item is not None), ("index", self.index is not None), ("clone", self.clone),
                     ("function", self.function is not None)) if bad]  # fmt: skip
            if clash:
                raise FieldError("fn", f"records fn(module, inputs, output) as the output; drop {clash[0]}")
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

    def check_capture_keys(self) -> None:
        """detach, clone, item, index, keep, stop, always: each with what it cannot be combined with."""
        one_of("keep", self.keep, ("all", "last"))
        if self.item is not None and (not isinstance(self.item, (int, str)) or isinstance(self.item, bool)):
            raise FieldError("item", f"must be an int position or a str key, got {self.item!r}")
        changed = [k for k, v in (("detach", not self.detach), ("keep", self.keep != "all"), ("always", self.always),
                                  ("item", self.item is not None), ("index", self.index is not None)) if v]  # fmt: skip
        if self.reduce != "none" and changed:
            raise FieldError(changed[0], f"reduce: {self.reduce} keeps running statistics, not calls; drop one")
        if not self.detach and self.to == "disk":
            raise FieldError("detach", "records written to disk hold no graph; drop detach: false or to: disk")
        if self.always and "input" not in self.what:
            raise FieldError("always", "records the inputs when the forward raises: add input to what")
        if self.function is not None and (changed or self.stop):
            key = (changed or ["stop"])[0]
            raise FieldError(key, f"is not taken with function: (it records each call of {self.function})")


@dataclass
class CaptureGradAction(Hooked, Action):
    """capture_grad: record grad_input/grad_output, or a parameter's gradient with ``param``."""

    param: str | None = None  # set: Tensor.register_hook on these parameters
    plot: bool = False  # write plots/*.png of the last call's gradients
    what: str | None = None  # absent: both; grad_input (full backward hook) | grad_output (full backward pre-hook)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hooked()
        if self.what is not None:
            one_of("what", self.what, GRAD_WHAT)
            if self.param is not None:
                raise FieldError("what", "a parameter's gradient is one tensor; drop what when param is set")


@dataclass
class LogAction(Hooked, Action):
    """log: print module name, input/output shapes and stats per call."""

    stats: bool = True  # also print mean/std/min/max

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hooked()
