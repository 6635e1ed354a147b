"""The ``splice`` action's config: which file, where it reads and writes, error term, capture, feature edits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from surgery.core.schema_actions import Action, FieldError, Hooked, one_of

SIDES = ("output", "input")
FEATURE_OPS = ("zero", "set", "mul", "add")
ACTIVATIONS = ("relu", "topk", "jumprelu")
MODULE_KEYS = ("path",)


@dataclass
class SpliceAction(Hooked, Action):
    """splice: the selected module's output (or input) becomes a sparse autoencoder's reconstruction of it."""

    module: dict = field(default_factory=dict)  # {path: a SAELens directory or .safetensors}; {name}: module name
    at: str = "output"  # output | input: what the reconstruction replaces
    read: str | None = None  # input | output: what the SAE encodes (absent: as at); input + at output: transcoder
    item: Any = None  # a tuple/list/dict output's element to splice (int or key); input: the position (default 0)
    activation: str | None = None  # relu | topk | jumprelu, for a plain .safetensors file (cfg.json says it otherwise)
    k: int | None = None  # topk: how many features stay active per position (cfg.json's k otherwise)
    apply_b_dec_to_input: bool | None = None  # subtract b_dec before encoding (absent: cfg.json's, or true as SAELens)
    error_term: bool = False  # add back x - reconstruction, so the model's output is unchanged without feature edits
    capture: bool = False  # record the feature activations: captures[ACTION][MODULE].features
    features_top: int | None = None  # capture only the K largest features per position: {values, indices}
    to: str = "memory"  # memory | disk: captured features written batch by batch (the CLI's shards)
    features: Any = None  # an edit of some features before decoding: {index: int | [ints], op: zero|set|mul|add, value}
    train: bool = False  # the SAE's tensors become the module's parameters (W_enc, b_enc, ...) to train and save

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hooked()
        if not isinstance(self.module, dict) or "path" not in self.module:
            raise FieldError(
                "module", f"needs {{path: DIR_OR_FILE}} (a SAELens directory or .safetensors), got {self.module!r}"
            )
        extra = sorted(set(self.module) - set(MODULE_KEYS))
        if extra:
            raise FieldError(f"module.{extra[0]}", f"unknown key; module takes {', '.join(MODULE_KEYS)}")
        path = self.module["path"]
        if not (isinstance(path, str) and path) and not (
            isinstance(path, list) and path and all(isinstance(p, str) and p for p in path)
        ):
            raise FieldError(
                "module.path", f"a path (may hold {{name}}) or a list of paths, one per module; got {path!r}"
            )
        one_of("at", self.at, SIDES)
        if self.read is not None:
            one_of("read", self.read, SIDES)
        if self.at == "input" and self.read == "output":
            raise FieldError("read", "the output is made after the input is used; read: output needs at: output")
        if self.activation is not None:
            one_of("activation", self.activation, ACTIVATIONS)
        if self.k is not None and (isinstance(self.k, bool) or self.k < 1):
            raise FieldError("k", f"topk keeps k >= 1 features, got {self.k}")
        if self.item is not None and (not isinstance(self.item, (int, str)) or isinstance(self.item, bool)):
            raise FieldError("item", f"must be an int position or a str key, got {self.item!r}")
        if self.at == "input" and isinstance(self.item, str):
            raise FieldError("item", "at: input takes a positional input by number (0 by default)")
        one_of("to", self.to, ("memory", "disk"))
        if self.features_top is not None and (isinstance(self.features_top, bool) or self.features_top < 1):
            raise FieldError("features_top", f"keeps K >= 1 features per position, got {self.features_top}")
        if not self.capture and (self.features_top is not None or self.to != "memory"):
            key = "features_top" if self.features_top is not None else "to"
            raise FieldError(key, "applies to captured features; add capture: true")
        if self.features is not None:
            check_features(self.features)

    @property
    def reads(self) -> str:
        """What the SAE encodes: ``read``, or ``at`` when absent."""
        return self.read or self.at


def check_features(features: Any) -> None:
    """``features``: {index, op, value}; index an int or a non-empty list of ints >= 0; value for set/mul/add."""
    if not isinstance(features, dict):
        raise FieldError("features", f"a mapping {{index: [12, 40], op: zero}}, got {features!r}")
    extra = sorted(set(features) - {"index", "op", "value"})
    if extra:
        raise FieldError(f"features.{extra[0]}", "unknown key; features takes index, op, value")
    if "index" not in features:
        raise FieldError("features.index", "which features to edit: an int or a list of ints")
    index = features["index"]
    indices = index if isinstance(index, list) else [index]
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices):
        raise FieldError("features.index", f"an int >= 0 or a non-empty list of them, got {index!r}")
    op = features.get("op", "zero")
    one_of("features.op", op, FEATURE_OPS)
    value = features.get("value")
    if op == "zero":
        if value is not None:
            raise FieldError("features.value", "op zero takes no value; use op: set to write a number")
        return
    values = value if isinstance(value, list) else [value]
    if value is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise FieldError("features.value", f"op {op!r} needs a number (or one per index), got {value!r}")
    if isinstance(value, list) and len(value) != len(indices):
        raise FieldError("features.value", f"{len(value)} values for {len(indices)} indices; give one each, or one")
