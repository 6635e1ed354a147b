"""PEFT's LoRA adapter directory, read (``kind: lora`` with ``init: {from: DIR}``) and written (``save_added`` format
``peft``): ``adapter_config.json`` and ``adapter_model.safetensors`` keyed ``base_model.model.MODULE.lora_A.weight``
and ``...lora_B.weight``, as ``PeftModel.save_pretrained`` writes them and ``PeftModel.from_pretrained`` reads them.

Only what ``kind: lora`` computes is accepted: a LoRA (``peft_type: LORA``) on Linear/Conv1D layers, one
``lora_dropout``, ``r`` and ``lora_alpha`` per module (``rank_pattern`` / ``alpha_pattern`` keyed by module names, as
PEFT matches them), no DoRA, rsLoRA, biases or extra saved modules; anything else is refused in one line naming the
key. Every read and write goes through ``surgery.files``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from surgery.core.steps import SAVE_FORMATS
from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.paths import refuse_url
from surgery.files.tensors import read_tensors
from surgery.files.write import make_dir, write_json, write_tensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json keys that change what PEFT computes, and the value under which it computes what lora does
PLAIN = {"use_dora": False, "use_rslora": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
         "target_parameters": None, "layer_replication": None, "trainable_token_indices": None, "use_qalora": False,
         "alora_invocation_tokens": None}  # fmt: skip
# transformers head classes (by name ending) -> PEFT's task_type
TASK_TYPES = (("ForCausalLM", "CAUSAL_LM"), ("LMHeadModel", "CAUSAL_LM"), ("ForSequenceClassification", "SEQ_CLS"),
              ("ForTokenClassification", "TOKEN_CLS"), ("ForQuestionAnswering", "QUESTION_ANS"),
              ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"))  # fmt: skip
PATTERNS = ("rank_pattern", "alpha_pattern")
# a pattern key kind: lora evaluates: a module name or its dotted tail, dots escaped or not (PEFT matches each key as
# the regular expression (.*\.)?(KEY)$); wider regular expressions are refused, so no file runs an expensive one
NAME_KEY = re.compile(r"\^?(?:[A-Za-z0-9_]|\\?[.\-])+")


def peft_key(module: str, which: str) -> str:
    """The adapter file's key of a module's ``lora_A`` or ``lora_B``: ``base_model.model.MODULE.lora_A.weight``."""
    return f"{PREFIX}{module}.{which}.weight"


@dataclass
class Adapter:
    """A PEFT LoRA adapter read from disk and checked: its settings and tensors by file key."""

    path: str
    where: str
    r: int
    alpha: float
    dropout: float
    tensors: dict[str, torch.Tensor]
    ranks: dict[str, int] = field(default_factory=dict)  # rank_pattern: {key: r}
    alphas: dict[str, float] = field(default_factory=dict)  # alpha_pattern: {key: lora_alpha}

    def settings_for(self, module: str) -> tuple[int, float]:
        """``(r, alpha)`` of ``module``: the first pattern key matching it as PEFT matches them, else the default."""
        r = next((v for k, v in self.ranks.items() if _matches(k, module)), self.r)
        return r, next((v for k, v in self.alphas.items() if _matches(k, module)), self.alpha)

    @property
    def modules(self) -> list[str]:
        """The modules the adapter adapts (from its tensors' keys)."""
        return sorted({key[len(PREFIX) :].rsplit(".", 2)[0] for key in self.tensors})

    def pair(self, module: str, a_shape: tuple[int, int], b_shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """``(lora_A, lora_B)`` for ``module``, shapes checked; a missing key or other shape is a ConfigError."""
        r = a_shape[0]
        found = []
        for which, shape in (("lora_A", a_shape), ("lora_B", b_shape)):
            key = peft_key(module, which)
            tensor = self.tensors.get(key)
            if tensor is None:
                adapted = ", ".join(self.modules[:6]) + (" …" if len(self.modules) > 6 else "")
                raise ConfigError(
                    f"{self.where}: {self.path!r} has no {key} for the selected module {module!r}; the adapter adapts"
                    f" {adapted or 'nothing'} (select those modules)"
                )
            if tuple(tensor.shape) != shape:
                raise ConfigError(
                    f"{self.where}: {key} in {self.path!r} has shape {list(tensor.shape)}, but {module!r} at r={r}"
                    f" needs {list(shape)}"
                )
            found.append(tensor)
        return tuple(found)

    def check_covered(self, selected: list[str], where: str) -> None:
        """Every module the adapter adapts must be selected: a part left out would be dropped silently."""
        left = sorted(set(self.modules) - set(selected))
        if left:
            raise ConfigError(
                f"{where}.select: the adapter {self.path!r} also adapts {left[0]!r}"
                f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}, which select does not match; select"
                " every module it adapts (its target_modules)"
            )


def read_adapter(path: str, where: str) -> Adapter:
    """The PEFT LoRA adapter directory at ``path``, checked against what ``kind: lora`` computes."""
    refuse_url(path, where, "lora")
    found = gate.config_path(Path(path).expanduser(), where)
    if not found.is_dir():
        raise ConfigError(f"{where}: {path!r} is not a directory; give a PEFT adapter directory ({CONFIG_FILE} +"
                          f" {WEIGHTS_FILE}, what PeftModel.save_pretrained writes)")  # fmt: skip
    names = gate.listing(found, where)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if name not in names:
            other = " (adapter_model.bin: save it with safe_serialization=True)" if "adapter_model.bin" in names else ""
            raise ConfigError(f"{where}: {path!r} has no {name}; a PEFT adapter directory holds {CONFIG_FILE} and"
                              f" {WEIGHTS_FILE}{other}")  # fmt: skip
    config_file = gate.member(found, CONFIG_FILE, where, "the adapter's config")
    config = gate.read_json_object(config_file, where)
    said = f"{where}: {str(config_file)!r}"
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{said} has peft_type {config.get('peft_type')!r}; kind: lora reads LORA adapters")
    for key, plain in PLAIN.items():
        value = config.get(key, plain)
        if value != plain and not (plain is None and value in ({}, [])):
            raise ConfigError(f"{said} has {key} {value!r}, which kind: lora does not compute (it needs {plain!r})")
    r = gate.whole(config.get("r"), f"{said}: r", 1, 2**31)
    alpha = gate.finite(config.get("lora_alpha"), f"{said}: lora_alpha")
    dropout = gate.finite(config.get("lora_dropout", 0.0), f"{said}: lora_dropout", 0.0, 1.0)
    if dropout >= 1.0:
        raise ConfigError(f"{said} has lora_dropout {dropout}; a probability in [0, 1)")
    ranks = {
        key: gate.whole(v, f"{said}: rank_pattern.{key}", 1, 2**31) for key, v in _pattern(config, 0, said).items()
    }
    alphas = {
        key: float(gate.finite(v, f"{said}: alpha_pattern.{key}")) for key, v in _pattern(config, 1, said).items()
    }
    weights_file = gate.member(found, WEIGHTS_FILE, where, "the adapter's weights")
    tensors = read_tensors(weights_file, where)
    for key, tensor in tensors.items():
        if not (key.startswith(PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ConfigError(
                f"{where}: {str(weights_file)!r} holds {key!r}; kind: lora reads {PREFIX}MODULE.lora_A.weight and"
                " .lora_B.weight only (LoRA on Linear and Conv1D layers)"
            )
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise ConfigError(f"{where}: {key} in {str(weights_file)!r} is not a floating-point matrix")
    return Adapter(path, where, r, float(alpha), float(dropout), tensors, ranks, alphas)


def _pattern(config: dict[str, Any], which: int, said: str) -> dict[str, Any]:
    """``rank_pattern`` (0) or ``alpha_pattern`` (1) of an adapter config: {module name key: value}, keys checked."""
    name = PATTERNS[which]
    found = config.get(name) or {}
    if not isinstance(found, dict):
        raise ConfigError(f"{said} has {name} {found!r}; a mapping of module names to values")
    for key in found:
        if not (isinstance(key, str) and NAME_KEY.fullmatch(key)):
            raise ConfigError(
                f"{said} has {name} key {key!r}, a regular expression kind: lora does not evaluate; key it by module"
                " names (model.layers.0.self_attn.q_proj) or their dotted ends (q_proj)"
            )
    return found


def _matches(key: str, module: str) -> bool:
    """PEFT's rule (``peft.utils.other.get_pattern_key``): the key, a regular expression, matches the name's end."""
    return re.match(rf"(.*\.)?({key})$", module) is not None


def task_type(model: Any) -> str | None:
    """PEFT's task_type for a transformers model's class (``GPT2LMHeadModel`` → ``CAUSAL_LM``), else None."""
    name = type(model).__name__
    return next((task for ending, task in TASK_TYPES if name.endswith(ending)), None)


def base_name(model: Any) -> str | None:
    """The model's ``name_or_path`` (what it was loaded from), when it has one."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    return name if isinstance(name, str) and name else None


@SAVE_FORMATS.register("peft")
def save_peft(surgery: Any, path: Path) -> None:
    """Write the surgery's ``kind: lora`` actions as a PEFT LoRA adapter directory (``PeftModel.from_pretrained``)."""
    steps = [s for s in surgery.plan.steps if s.enabled and s.kind == "lora"]
    if not steps:
        raise ConfigError("save_added.format: peft writes kind: lora actions, and this surgery has none")
    ours = {f"{t.name}.{n}" for s in steps for t in s.targets for n in s.added}
    others = [key for key in surgery.added_state_dict() if key not in ours]
    if others:
        raise ConfigError(
            f"save_added.format: peft holds LoRA weights only, but the recipe adds {others[0]!r} too; save with"
            " format: safetensors, or keep that action out of the recipe"
        )
    live = {name: settings for step in steps for name, settings in step.live.items()}
    dropouts = sorted({settings["dropout"] for settings in live.values()})
    if len(dropouts) > 1:
        raise ConfigError(
            f"save_added.format: a PEFT adapter has one lora_dropout, but these lora actions differ ({dropouts}); save"
            " each in its own surgery"
        )
    dropout = dropouts[0]
    (r, alpha), _ = Counter((s["r"], s["alpha"]) for s in live.values()).most_common(1)[0]  # the rest: patterns
    rank_pattern = {re.escape(name): s["r"] for name, s in live.items() if s["r"] != r}
    alpha_pattern = {re.escape(name): _number(s["alpha"]) for name, s in live.items() if s["alpha"] != alpha}
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    conv1d = False
    for step in steps:
        for target in step.targets:
            targets.append(target.name)
            conv1d = conv1d or step.live[target.name]["conv1d"]
            for which in ("lora_A", "lora_B"):
                tensors[peft_key(target.name, which)] = target.module._parameters[which].detach()
    config = {
        "peft_type": "LORA", "task_type": task_type(surgery.model), "base_model_name_or_path": base_name(surgery.model),
        "r": r, "lora_alpha": _number(alpha), "lora_dropout": dropout,
        "target_modules": targets, "fan_in_fan_out": conv1d, "bias": "none", "init_lora_weights": True,
        "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
    }  # fmt: skip
    for name, settings in live.items():
        if not math.isfinite(settings["alpha"]):
            raise ConfigError(f"save_added.format: lora_alpha {settings['alpha']} of {name!r} is not a finite number")
    directory = make_dir(path, "save_added.path")
    write_json(directory / CONFIG_FILE, config, "save_added.path")
    write_tensors(directory / WEIGHTS_FILE, tensors, "save_added.path")


def _number(value: float) -> float | int:
    """A whole float as an int (``4.0`` → ``4``), as PEFT's configs write lora_alpha."""
    return int(value) if float(value).is_integer() else value
