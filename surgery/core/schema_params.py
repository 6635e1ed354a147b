"""The parameter-level action schemas (init, add_parameter, add_buffer, freeze): apply passes, no hooks.

Split from ``surgery.core.schema_actions``; ``surgery.core.schema`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from surgery.core.schema_actions import Action, FieldError, one_of

NONLINEARITIES = (
    "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "sigmoid", "tanh", "relu", "leaky_relu", "selu",
)  # fmt: skip
INIT_METHODS = (
    "constant", "zeros", "ones", "normal", "uniform", "xavier_uniform", "xavier_normal",
    "kaiming_uniform", "kaiming_normal", "orthogonal", "trunc_normal", "eye", "dirac",
)  # fmt: skip
KAIMING, NORMALS = ("kaiming_uniform", "kaiming_normal"), ("normal", "trunc_normal")
INIT_KEYS = {  # the methods that use each optional key of InitSpec
    "value": ("constant",), "mean": NORMALS, "std": NORMALS, "a": ("uniform", "trunc_normal", *KAIMING),
    "b": ("uniform", "trunc_normal"), "gain": ("xavier_uniform", "xavier_normal", "orthogonal"),
    "mode": KAIMING, "nonlinearity": KAIMING,
}  # fmt: skip


@dataclass
class InitSpec:
    """How to fill a tensor: ``method`` and that method's arguments."""

    method: str | None = None  # how to fill: the methods below, or from (add_parameter/add_buffer: zeros if neither)
    value: float | None = None  # constant
    mean: float | None = None  # normal, trunc_normal (default 0)
    std: float | None = None  # normal, trunc_normal (default 1)
    a: float | None = None  # uniform low (0), trunc_normal low (-2), kaiming negative slope (0)
    b: float | None = None  # uniform high (1), trunc_normal high (2)
    gain: float | None = None  # xavier, orthogonal (default 1)
    mode: str | None = None  # kaiming: fan_in (default) | fan_out
    nonlinearity: str | None = None  # kaiming (default leaky_relu)
    from_: Any = None  # instead of a method: {file: .safetensors/.pt, key: NAME} (key default: the tensor's full name)

    def check_init(self, prefix: str = "") -> None:
        """Check the method is known, has what it needs and is given no key it would ignore; keys under ``prefix``."""
        if self.from_ is not None:
            self.check_from(prefix)
            return
        if self.method is None:
            raise FieldError(
                prefix + "method", f"give a method ({', '.join(INIT_METHODS[:5])}, ...) or from: {{file, key}}"
            )
        one_of(prefix + "method", self.method, INIT_METHODS)
        for key, methods in INIT_KEYS.items():  # a key the method ignores is a silent mistake (ones with value: 3)
            if getattr(self, key) is not None and self.method not in methods:
                raise FieldError(
                    prefix + key, f"method {self.method!r} does not use {key}; {key} is taken by {', '.join(methods)}"
                )
        if self.method == "constant" and self.value is None:
            raise FieldError(prefix + "value", "method 'constant' needs a value, e.g. value: 1.0")
        for key, choices in (("mode", ("fan_in", "fan_out")), ("nonlinearity", NONLINEARITIES)):
            if getattr(self, key) is not None:
                one_of(prefix + key, getattr(self, key), choices)
        for key in ("std", "gain"):
            if (getattr(self, key) or 0) < 0:
                raise FieldError(prefix + key, f"must be >= 0, got {getattr(self, key)}")
        low, high = self.a, self.b
        if self.method in ("uniform", "trunc_normal") and low is not None and high is not None and low > high:
            raise FieldError(prefix + "a", f"{self.method} needs a <= b, got a={low} and b={high}")

    def check_from(self, prefix: str) -> None:
        """``from``: {file, key?} with string values, and no method or method argument beside it."""
        given = [k for k in ("method", *INIT_KEYS) if getattr(self, k) is not None]
        if given:
            raise FieldError(prefix + given[0], "the tensor comes from a file (from); drop " + given[0])
        source = self.from_
        if not isinstance(source, dict) or "file" not in source:
            raise FieldError(prefix + "from", f"needs {{file: PATH, key: NAME}}, got {source!r}")
        extra = sorted(set(source) - {"file", "key"})
        if extra:
            raise FieldError(f"{prefix}from.{extra[0]}", "unknown key; from takes file and key")
        for key in ("file", "key"):
            if key in source and not (isinstance(source[key], str) and source[key]):
                raise FieldError(f"{prefix}from.{key}", f"a non-empty string, got {source[key]!r}")


@dataclass
class InitAction(Action, InitSpec):
    """init: set the selected parameters by ``method`` in an apply pass under no_grad."""

    param: str = MISSING  # parameter-name glob within each selected module, e.g. weight or "*"

    def __post_init__(self) -> None:
        Action.__post_init__(self)
        self.check_init()


@dataclass
class AddTensorAction(Action):
    """Keys shared by add_parameter and add_buffer."""

    name: str = MISSING  # attribute name of the new tensor
    shape: list[int] | None = None  # shape of the new tensor (give shape or like)
    like: str | None = None  # or: copy shape and dtype from this parameter/buffer of the module
    init: InitSpec = field(default_factory=InitSpec)  # how to fill it: {method, ...} (zeros when absent) or {from}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shape is not None and self.like is not None:
            raise FieldError("shape", "give exactly one of shape (e.g. [4]) or like (e.g. weight)")
        if self.shape is None and self.like is None and self.init.from_ is None:
            raise FieldError(
                "shape", "give exactly one of shape (e.g. [4]) or like (e.g. weight), or init: {from: {file}}"
            )
        if self.shape is not None and any(s < 0 for s in self.shape):
            raise FieldError("shape", f"sizes must be >= 0, got {self.shape}")
        if not self.name.isidentifier() or self.name.startswith("_"):
            raise FieldError("name", f"{self.name!r} is not a public Python identifier")
        if self.init.method is None and self.init.from_ is None:
            self.init.method = "zeros"
        self.init.check_init("init.")


@dataclass
class AddParameterAction(AddTensorAction):
    """add_parameter: register a new nn.Parameter on each selected module."""

    requires_grad: bool = True  # whether the new parameter trains


@dataclass
class AddBufferAction(AddTensorAction):
    """add_buffer: register a new buffer on each selected module."""

    persistent: bool = True  # part of state_dict


@dataclass
class FreezeAction(Action):
    """freeze / unfreeze: set requires_grad on the selected parameters."""

    param: str = "*"  # parameter-name glob within each selected module
