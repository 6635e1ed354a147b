"""Typed configs: run settings, the action schemas (``schema_actions``, re-exported here) and validation.

OmegaConf has no unions of structured configs, so actions are composed untyped and each
is validated here against its own kind's dataclass (``validate_action``). Cross-field
rules live in ``__post_init__`` and raise ``FieldError(key, message)``; ``validate``
turns every problem into one ``ConfigError`` that names ``WHERE.KEY``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import MISSING as MISSING_VALUE
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from surgery.core.limits import SAFE_DEFAULTS, UNBOUNDED, Limits
from surgery.core.schema_actions import (  # re-exported: the action schemas live there
    FORWARD_FNS,
    GRAD_OPS,
    OP_NEEDS,
    PLACEHOLDERS,
    TENSOR_OPS,
    Action,
    CaptureAction,
    CaptureGradAction,
    FieldError,
    LogAction,
    ModifyAction,
    ModifyGradAction,
    OnLoadAction,
    OpArgs,
    ReplaceForwardAction,
    ReplaceModuleAction,
    field_name,
    one_of,
    yaml_key,
)
from surgery.core.schema_params import (  # re-exported: the parameter-level schemas live there
    INIT_KEYS,
    INIT_METHODS,
    NONLINEARITIES,
    AddBufferAction,
    AddParameterAction,
    AddTensorAction,
    FreezeAction,
    InitAction,
    InitSpec,
)
from surgery.errors import ConfigError, did_you_mean

__all__ = [  # the action schemas are re-exported so callers need one import
    "FieldError", "one_of", "yaml_key", "field_name", "Action", "NONLINEARITIES", "INIT_METHODS", "INIT_KEYS",
    "InitSpec", "InitAction", "AddTensorAction", "AddParameterAction", "AddBufferAction", "FreezeAction",
    "FORWARD_FNS", "ReplaceForwardAction", "ReplaceModuleAction", "OnLoadAction", "TENSOR_OPS", "GRAD_OPS",
    "OP_NEEDS", "PLACEHOLDERS", "OpArgs", "ModifyAction", "ModifyGradAction", "CaptureAction", "CaptureGradAction",
    "LogAction",
    "DTYPES", "LOSSES", "MODES", "RunSettings", "check_containers", "check_keys", "validate",
]  # fmt: skip


# ---------------------------------------------------------------- run settings

MODES = ("run", "plan", "modules", "generate", "harvest")
LOSSES = ("sum", "mse", "cross_entropy", "kl_div")
LOSS_METRICS = ("logit_diff", "prob", "logit")  # per-example metrics with a gradient (surgery/study/metrics.py)
LIMIT_KEYS = ("memory_gb", "disk_gb", "count")
DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass
class RunSettings:
    """The run settings of ``conf/config.yaml`` (SPEC §2)."""

    mode: str = "run"  # run | plan (what would match, change nothing) | modules (list modules) | generate | harvest
    seed: int = 0  # seeds torch, numpy, python; every random init/noise derives from it
    device: str = "cpu"  # cpu | cuda | cuda:N | auto | meta (mode=plan|modules only: no weights are made)
    dtype: str | None = None  # model and input dtype; null: the model's (model.dtype, else as built)
    strict: bool = True  # a selector that matches nothing is an error (an action can opt out: allow_empty)
    safe: bool = False  # name only allowlisted callables (surgery/core/callables.py); Hydra's logging too
    backward: bool = False  # also run a backward pass so backward hooks fire
    loss: Any = "sum"  # loss for the backward pass, or a per-example metric {logit_diff: {...}} averaged
    compare: bool = True  # also run the unmodified model and report the difference
    metrics: Any = None  # accuracy, top5, loss, agreement, kl (null: the default for the input; [] none)
    generate: Any = None  # mode=generate: {max_new_tokens: 20, do_sample: false}
    source: Any = None  # an input run first through the same surgery; from: {capture: ...} reads its captures
    save_model: bool = False  # write the surgered state_dict as model.safetensors
    verbose: bool = False  # full tracebacks on errors; mode=plan|run also list every matched name
    distributed: Any = None  # under torchrun: {wrap: none | ddp | fsdp} (docs/distributed.md)
    study: Any = None  # a grid of interventions scored per example (SPEC §13; surgery/study/config.py)
    harvest: Any = None  # mode=harvest: {sites, exclude, dtype, shard_mb} (SPEC §17; surgery/harvest/config.py)
    limits: Any = None  # {memory_gb, disk_gb, count}: null is unbounded, or safe=true's 8, 8, 10000 (docs/sharing.md)
    vectors: Any = None  # named steering vectors computed before planning; actions add them (surgery/vectors)

    def __post_init__(self) -> None:
        one_of("mode", self.mode, MODES)
        if isinstance(self.loss, dict):
            if len(self.loss) != 1 or next(iter(self.loss)) not in LOSS_METRICS:
                raise FieldError(
                    "loss",
                    f"a per-example metric as loss is one of {', '.join(LOSS_METRICS)} with its options,"
                    f' e.g. {{logit_diff: {{correct: " Paris", wrong: " Rome"}}}}; got {self.loss!r}',
                )
        else:
            one_of("loss", self.loss, LOSSES)
        if not -(2**63) <= self.seed < 2**63:  # torch.manual_seed takes 64 bits; more is a traceback deep inside it
            text = str(self.seed) if self.seed.bit_length() <= 128 else f"a {self.seed.bit_length()}-bit int"
            raise FieldError("seed", f"{text} is out of range: a seed is an int from -2**63 to 2**63-1")
        if self.dtype is not None:
            one_of("dtype", self.dtype, DTYPES)
        if not (self.device in ("cpu", "cuda", "auto", "meta") or self.device.startswith("cuda:")):
            raise FieldError("device", f"{self.device!r} is not cpu, cuda, cuda:N, auto or meta")
        if self.distributed is not None:
            wrap = self.distributed.get("wrap", "none") if isinstance(self.distributed, dict) else self.distributed
            extra = sorted(set(self.distributed) - {"wrap"}) if isinstance(self.distributed, dict) else []
            if extra:
                raise FieldError(f"distributed.{extra[0]}", "unknown key; distributed has only wrap")
            one_of("distributed.wrap", wrap, ("none", "ddp", "fsdp"))
        if self.limits is not None:
            check_limits(self.limits)
        if self.device == "meta" and self.mode not in ("plan", "modules"):
            raise FieldError(  # meta tensors have shapes but no values: nothing can be run or compared
                "device",
                f"'meta' builds the model without weights, for mode=plan or mode=modules, not mode={self.mode}",
            )


def check_limits(limits: Any) -> None:
    """``limits`` is a mapping of memory_gb, disk_gb and count, each a positive number or null."""
    if not isinstance(limits, dict):
        raise FieldError("limits", "expected a mapping {memory_gb: N, disk_gb: N, count: N}")
    for key, value in limits.items():
        if key not in LIMIT_KEYS:
            raise FieldError(
                f"limits.{key}", f"unknown key.{did_you_mean(str(key), LIMIT_KEYS)} Keys here: {', '.join(LIMIT_KEYS)}."
            )
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise FieldError(f"limits.{key}", f"{value!r} is not a positive number (or null for the default)")


GROUP_KEYS = ("model", "actions", "input")


def settings_of(cfg: DictConfig) -> RunSettings:
    """The run settings of a composed config, validated; an unknown top-level key is refused."""
    names = list(RunSettings.__dataclass_fields__)
    for key in map(str, cfg):
        if key not in names and key not in GROUP_KEYS:
            raise ConfigError(
                f"{key}: unknown key.{did_you_mean(key, names + list(GROUP_KEYS))} Run settings: {', '.join(names)}."
            )
    values = {k: cfg[k] for k in names if k in cfg}
    if isinstance(values.get("source"), DictConfig):  # +source=text with prompts set: its prompt stays ???
        source = OmegaConf.to_container(values["source"], resolve=True)
        values["source"] = {k: v for k, v in source.items() if v != "???"}  # type: ignore[union-attr]
    return validate(RunSettings, values, "")


def limits_of(settings: RunSettings) -> Limits:
    """The limits a run enforces: the ones set, and under ``safe`` the safe defaults for those left null."""
    given = {k: v for k, v in (settings.limits or {}).items() if v is not None}
    base = SAFE_DEFAULTS if settings.safe else UNBOUNDED
    return dataclasses.replace(base, **given)


# ---------------------------------------------------------------- validation


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


@functools.cache
def _schema_fields(schema: type) -> tuple[dict[str, dataclasses.Field], list[str]]:
    """A schema's fields by name and its keys as written in YAML, sorted: read once per schema."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    return fields, sorted(yaml_key(f) for f in fields)


def check_keys(schema: type, node: dict, where: str) -> None:
    """Refuse keys the schema does not have, with a did-you-mean; recurse into nested schemas."""
    fields, keys = _schema_fields(schema)
    for key, value in node.items():
        if field_name(str(key)) not in fields:
            raise ConfigError(
                f"{_at(where, key)}: unknown key.{did_you_mean(str(key), keys)} Keys here: {', '.join(keys)}.",
                options=keys,
            )
        nested = fields[field_name(str(key))].default_factory
        if isinstance(value, dict) and nested is not dataclasses.MISSING:
            sample = nested()
            if dataclasses.is_dataclass(sample):
                check_keys(type(sample), value, _at(where, key))


def check_containers(schema: type, node: dict, where: str) -> None:
    """A list or mapping field given something else gets a message in the user's words, not OmegaConf's."""
    containers = _containers(schema)
    for name, value in node.items():
        if value is None:
            continue
        kinds = containers[name]
        if list in kinds and not isinstance(value, list):
            raise ConfigError(f"{_at(where, yaml_key(name))}: must be a list, e.g. [{value}], got {value!r}")
        if dict in kinds and not isinstance(value, dict):
            raise ConfigError(f"{_at(where, yaml_key(name))}: must be a mapping such as {{old: new}}, got {value!r}")


def python_objects(schema: type, node: dict, where: str) -> dict[str, Any]:
    """The tensors and callables of a Python dict recipe, on the keys the schema takes them (``objects``)."""
    found = {
        name: value
        for name, value in node.items()
        if isinstance(value, torch.Tensor) or (callable(value) and not isinstance(value, (str, dict, list)))
    }
    taken = getattr(schema, "objects", ())
    for name, value in found.items():
        if name not in taken:
            here = f"; here only {', '.join(yaml_key(t) for t in taken)} may be one" if taken else ""
            raise ConfigError(
                f"{_at(where, yaml_key(name))}: a Python {type(value).__name__} is not a config value{here}"
            )
    return found


def _fields_of(node: Any) -> Any:
    """A nested schema's keys as field names too (``init: {from: ...}`` → ``from_``)."""
    return {field_name(str(k)): v for k, v in node.items()} if isinstance(node, dict) else node


@functools.cache
def _nested_schemas(schema: type) -> frozenset[str]:
    """The fields of ``schema`` that are themselves schemas (``init``): their keys are renamed like the top's."""
    found = set()
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory()):
            found.add(f.name)
    return frozenset(found)


@functools.cache
def _containers(schema: type) -> dict[str, set[Any]]:
    """Each field's outer types (``list``, ``dict``, ``str`` ...), its Union's options taken apart: read once."""
    found = {}
    for name, (hint, _) in _field_types(schema).items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        found[name] = {typing.get_origin(t) or t for t in options}
    return found


def _json_copy(value: Any) -> Any:
    """A copy of JSON-like data (what ``_plain_fit`` accepted): lists and dicts anew, scalars as they are."""
    if type(value) is list:
        return [_json_copy(v) for v in value]
    if type(value) is dict:
        return {k: _json_copy(v) for k, v in value.items()}
    return value


@functools.cache
def _field_types(schema: type) -> dict[str, tuple[Any, bool]]:
    """Each field's type hint and whether it is required (no default), read once per schema."""
    hints = typing.get_type_hints(schema)
    return {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                 or f.default is MISSING_VALUE)
        for f in dataclasses.fields(schema)
    }  # fmt: skip


def _plain_fit(schema: type, node: dict[str, Any]) -> bool:
    """Whether OmegaConf would take ``node`` as it is: every required key given, each value exactly its type.

    Then the dataclass can be built directly, with the same result and ``__post_init__`` checks; any
    doubt (a conversion, an interpolation, a nested schema) leaves it to OmegaConf and its messages.
    """
    types_ = _field_types(schema)
    if any(required and name not in node for name, (_, required) in types_.items()):
        return False
    return all(_fits(types_[name][0], value) for name, value in node.items())


def _fits(hint: Any, value: Any) -> bool:
    if hint is Any:
        return _json_like(value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(option, value) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (list, dict) or hint in (list, dict):
        args = typing.get_args(hint)
        if type(value) is not (origin or hint) or not _json_like(value):
            return False
        if not args:
            return True
        if origin is list:
            return all(_fits(args[0], v) for v in value)
        return all(_fits(args[0], k) and _fits(args[1], v) for k, v in value.items())
    return hint in (str, int, float, bool) and type(value) is hint and (hint is not str or _json_like(value))


def _json_like(value: Any) -> bool:
    if value is None or type(value) in (int, float, bool):
        return True
    if type(value) is str:
        return "${" not in value and value != MISSING_VALUE
    if type(value) is list:
        return all(_json_like(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _json_like(v) for k, v in value.items())
    return False


@functools.cache
def structured(schema: type) -> DictConfig:
    """The OmegaConf template of a schema, built once (building it is most of the cost of ``validate``)."""
    return OmegaConf.structured(schema)


def validate(schema: type, node: Any, where: str) -> Any:
    """Validate a mapping against a dataclass schema; return the dataclass instance."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {type(node).__name__} {node!r}")
    check_keys(schema, node, where)
    nested = _nested_schemas(schema)
    node = {field_name(str(k)): _fields_of(v) if field_name(str(k)) in nested else v for k, v in node.items()}
    objects = python_objects(schema, node, where)
    node = {**node, **{name: PLACEHOLDERS[name] for name in objects}}
    check_containers(schema, node, where)
    try:
        if not objects and _plain_fit(schema, node):  # every value already its field's type: no OmegaConf needed
            return schema(**_json_copy(node))
        merged = OmegaConf.merge(structured(schema), node)  # merge copies the template: it is never changed
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            key = ".".join(yaml_key(part) for part in missing[0].split("."))
            raise ConfigError(f"{_at(where, key)}: a value is required here (it is ???)")
        result = OmegaConf.to_object(merged)
        if objects:  # OmegaConf holds no tensors or functions: put them in, then run the checks again on them
            for name, value in objects.items():
                setattr(result, name, value)
            result.__post_init__()  # type: ignore[union-attr]
        return result
    except FieldError as e:
        raise ConfigError(f"{_at(where, e.key)}: {e}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0]
        raise ConfigError(f"{_at(where, yaml_key(str(key)))}: {reason}") from None
