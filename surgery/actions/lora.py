"""``kind: lora``: a low-rank adapter on each selected ``nn.Linear`` (or transformers' ``Conv1D``), as PEFT's LoRA.

Each module gets two parameters named as PEFT names them, ``lora_A [r, in]`` (kaiming-uniform, ``a = sqrt(5)``, as
PEFT's default) and ``lora_B [out, r]`` (zeros), and a forward hook that adds ``lora_B(lora_A(dropout(x))) * alpha / r``
to the module's output, in PEFT's order of operations (so a model with the same A and B gives PEFT's logits bit for
bit). ``init: {from: DIR}`` fills A and B from a PEFT adapter directory instead. ``remove()`` deletes both parameters
and the hook. ``Surgery.save_added(DIR, format="peft")`` writes the adapter PEFT loads (surgery/actions/peft_files.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from surgery.actions.base import (
    FORWARD_HOOK,
    KINDS,
    BindContext,
    KeyedError,
    Kind,
    Step,
    TensorSpec,
    full_name,
    generator_for,
    hook_failed,
)
from surgery.actions.peft_files import Adapter, read_adapter
from surgery.core.ledger import Ledger
from surgery.core.schema_actions import Action, FieldError
from surgery.core.select import Target
from surgery.errors import ConfigError

NAMES = ("lora_A", "lora_B")


@dataclass
class LoraInit:
    """Where A and B come from: PEFT's default start (absent), or a PEFT adapter directory."""

    from_: Any = None  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), as PEFT saves it


@dataclass
class LoraAction(Action):
    """lora: a low-rank adapter on each selected Linear or Conv1D: output + dropout(x) @ A.T @ B.T * alpha / r."""

    r: int | None = None  # rank: lora_A is [r, in], lora_B [out, r] (with init.from: the adapter's when absent)
    alpha: float | None = None  # PEFT's lora_alpha: the update is scaled by alpha / r (init.from: the adapter's)
    dropout: float | None = None  # dropout on the adapter's input in train mode (default 0; init.from: the adapter's)
    requires_grad: bool = True  # whether lora_A and lora_B train
    init: LoraInit = field(default_factory=LoraInit)  # {from: DIR}: A and B from a PEFT adapter; absent: PEFT's start

    def __post_init__(self) -> None:
        super().__post_init__()
        source = self.init.from_
        if source is not None and not (isinstance(source, str) and source):
            raise FieldError("init.from", f"a PEFT adapter directory (a path), got {source!r}")
        if self.r is not None and (isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1):
            raise FieldError("r", f"the rank is a whole number >= 1, got {self.r!r}")
        if source is None and self.r is None:
            raise FieldError("r", "give the rank, e.g. r: 8 (or init: {from: DIR} to take a PEFT adapter's)")
        if source is None and self.alpha is None:
            raise FieldError("alpha", "give alpha (PEFT's lora_alpha; the update is scaled by alpha / r), e.g. 16")
        if self.alpha is not None and not math.isfinite(self.alpha):
            raise FieldError("alpha", f"a finite number, got {self.alpha!r}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise FieldError("dropout", f"a probability in [0, 1), got {self.dropout!r}")


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's ``x @ weight + bias``, weight ``[in, out]``), known without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(module.weight, torch.Tensor)


def weight_of(module: nn.Module) -> torch.Tensor:
    """The module's ``weight`` tensor (a Linear's or Conv1D's)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def widths(target: Target, where: str) -> tuple[int, int]:
    """(in, out) of a Linear or Conv1D; anything else is a ConfigError naming the module and its type."""
    module = target.module
    if isinstance(module, nn.Linear):
        return int(module.weight.shape[1]), int(module.weight.shape[0])
    if is_conv1d(module):
        return int(weight_of(module).shape[0]), int(weight_of(module).shape[1])
    raise ConfigError(
        f"{where}.select: {target.name!r} is a {type(module).__name__}; lora adapts nn.Linear and transformers' Conv1D"
        " layers only (add type: [Linear, Conv1D] to keep those)"
    )


def settings(cfg: LoraAction, adapter: Adapter | None, module: str, where: str) -> tuple[int, float, float]:
    """(r, alpha, dropout) of ``module``: the action's, else the adapter's (its patterns included); an action value
    the adapter contradicts is refused."""
    if adapter is None:
        assert cfg.r is not None and cfg.alpha is not None  # the schema requires them without init.from
        return cfg.r, float(cfg.alpha), float(cfg.dropout or 0.0)
    r, alpha = adapter.settings_for(module)
    given = {"r": cfg.r, "alpha": cfg.alpha, "dropout": cfg.dropout}
    theirs = {"r": r, "alpha": alpha, "dropout": adapter.dropout}
    for key, value in given.items():
        if value is not None and float(value) != float(theirs[key]):
            patterned = f" for {module!r}" if adapter.ranks or adapter.alphas else ""
            raise ConfigError(
                f"{where}.{key}: {value} contradicts the adapter {adapter.path!r}, whose adapter_config.json says"
                f" {theirs[key]}{patterned}; drop {key} (the adapter's is used) or give its value"
            )
    return r, alpha, adapter.dropout


def lora_hook(action: str, name: str, a: nn.Parameter, b: nn.Parameter, scaling: float, p: float) -> Any:
    """``hook(module, args, output)``: output + lora_B(lora_A(dropout(x))) * scaling, as PEFT's ``Linear.forward``."""

    def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        try:
            if not (args and isinstance(args[0], torch.Tensor)) or type(output) is not torch.Tensor:
                raise KeyedError("select", "lora reads the input passed by position and adds to a tensor output")
            x = args[0].to(a.dtype)
            if p > 0.0:
                x = F.dropout(x, p, training=m.training)
            return output + F.linear(F.linear(x, a), b) * scaling
        except Exception as e:
            raise hook_failed(action, name, e) from e

    return hook


@KINDS.register()
class Lora(Kind):
    """Add ``lora_A [r, in]`` and ``lora_B [out, r]`` and ``dropout(x) @ A.T @ B.T * alpha / r`` to the output."""

    name = "lora"
    schema = LoraAction
    mechanism = FORWARD_HOOK
    adds = True

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check each module is a Linear or Conv1D with free names and the adapter (if any) fits it; touch nothing."""
        adapter = read_adapter(cfg.init.from_, f"{ctx.where}.init.from") if cfg.init.from_ is not None else None
        plans: list[tuple[Target, tuple[int, int, int], torch.dtype, torch.device, Any]] = []
        live: dict[str, dict[str, Any]] = {}
        for target in targets:
            module = target.module
            r, alpha, dropout = settings(cfg, adapter, target.name, ctx.where)
            fan_in, fan_out = widths(target, ctx.where)
            taken = ctx.added.get(id(module), {})
            for name in NAMES:
                if name in taken or hasattr(module, name):
                    raise ConfigError(
                        f"{ctx.where}.select: {target.name!r} already has {name!r} (another lora on it, or PEFT's);"
                        " one lora per module"
                    )
            weight = weight_of(module)
            dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
            loaded = adapter.pair(target.name, (r, fan_in), (fan_out, r)) if adapter is not None else None
            plans.append((target, (r, fan_in, fan_out), dtype, weight.device, loaded))
            live[target.name] = {"r": r, "alpha": alpha, "dropout": dropout, "conv1d": is_conv1d(module)}
            added = ctx.added.setdefault(id(module), {})
            added["lora_A"] = TensorSpec((r, fan_in), dtype, "parameters")
            added["lora_B"] = TensorSpec((fan_out, r), dtype, "parameters")
        if adapter is not None:
            adapter.check_covered([t.name for t in targets], ctx.where)
        action, seed, train = ctx.name, ctx.seed, cfg.requires_grad

        def apply(ledger: Ledger) -> None:
            generators: dict[torch.device, torch.Generator] = {}
            for target, (r, fan_in, fan_out), dtype, device, loaded in ledger.each(action, plans, lambda p: p[0].name):
                a = torch.empty((r, fan_in), dtype=dtype, device=device)
                b = torch.zeros((fan_out, r), dtype=dtype, device=device)
                with torch.no_grad():
                    if loaded is not None:
                        a.copy_(loaded[0])
                        b.copy_(loaded[1])
                    else:
                        if device not in generators:
                            generators[device] = generator_for(seed, action, device)
                        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generators[device])
                pa, pb = nn.Parameter(a, requires_grad=train), nn.Parameter(b, requires_grad=train)
                ledger.add_tensor(target.module, "lora_A", pa, "parameters")
                ledger.add_tensor(target.module, "lora_B", pb, "parameters")
                found = live[target.name]
                hook = lora_hook(action, target.name, pa, pb, found["alpha"] / r, found["dropout"])
                ledger.hook(target.module.register_forward_hook, hook)

        names = [full_name(t, n) for t in targets for n in NAMES]
        step = Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, names, added=NAMES)
        step.live.update(live)
        return step
