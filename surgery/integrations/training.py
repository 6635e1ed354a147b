"""What the training callbacks share: apply a recipe for one run, turn its captures into scalars, remove and check.

Logged statistics, keyed ``surgery/ACTION/MODULE/STAT`` (``surgery/ACTION/MODULE/WHAT/STAT`` for anything but a
capture's ``output`` or a parameter's ``grad``, e.g. ``input.0``, ``grad_output.0``):

- a capture with ``reduce: mean|stats``: every call and batch row since the last log: ``mean`` and ``std`` of all
  values, ``norm`` the root mean square of each batch row's L2 norm (dim 0 is the batch, as for ``reduce``);
- every other record (a capture keeping calls, ``capture_grad``): the last call of the logged step: ``mean`` and
  ``std`` of its values, ``norm`` its L2 norm (for a parameter's gradient: the norm ``clip_norm`` bounds).

``std`` is the population standard deviation (no NaN for one value). Records that keep calls are emptied after
every step, so a long run holds one step of them.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import surgery
from surgery.core.compiler import Shared, compile_plan
from surgery.core.engine import Surgery
from surgery.core.records import Record
from surgery.core.restore import ModelState
from surgery.core.running import Running
from surgery.core.steps import SAVE_FORMATS
from surgery.errors import ActionError, ConfigError

STAGES = ("fit", "validate", "test", "predict")
MAIN = ("output", "grad")  # logged without their WHAT segment
# module and tensor facts that training or the framework may change legitimately (mode, values, device, precision)
_MOVABLE = ("training", "version", "storage", "device", "dtype")
# validated action configs by (kind, key, plain config), kept across runs: a callback made for every fit (a sweep,
# a notebook) validates its recipe once per process; selections are made again against each run's model
_VALIDATED: dict[tuple[Any, ...], Any] = {}
_VALIDATED_MAX = 1024


def check_log_every(value: Any, owner: str) -> int:
    """``log_every_n_steps`` as a positive int (0 turns logging off), or one ConfigError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{owner}.log_every_n_steps: expected a whole number >= 0 (0: no logging), got {value!r}")
    return value


def saving(save_added: Any, owner: str) -> tuple[Any, str] | None:
    """``save_added`` as (path, format): a path (a .safetensors file), or ``{path: DIR, format: peft | saelens}``."""
    if save_added is None or isinstance(save_added, (str, os.PathLike)):
        return None if save_added is None else (save_added, "safetensors")
    if isinstance(save_added, DictConfig):
        save_added = OmegaConf.to_container(save_added, resolve=True)
    if isinstance(save_added, dict):
        extra = sorted(set(save_added) - {"path", "format"})
        if extra:
            raise ConfigError(f"{owner}.save_added.{extra[0]}: unknown key; save_added takes path and format")
        path, form = save_added.get("path"), save_added.get("format", "safetensors")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(f"{owner}.save_added.path: a file or directory to write, got {path!r}")
        SAVE_FORMATS.get(str(form), f"{owner}.save_added.format")  # an unknown format is refused now, not at the end
        return path, str(form)
    raise ConfigError(
        f"{owner}.save_added: a path for the added tensors' .safetensors, or {{path: DIR, format: peft}}, got"
        f" {save_added!r}"
    )


class TrainingSurgery:
    """One recipe applied to one model for one run; ``remove`` checks every hook, module and tensor slot is back."""

    def __init__(self, actions: Any, owner: str, save_added: Any = None) -> None:
        if actions is None:
            raise ConfigError(f"{owner}.actions: give an actions name, a dict, a DictConfig or a YAML path")
        self.actions = actions
        self.owner = owner
        # where and how remove() writes what the recipe added, first (trained add-ons kept): (path, format) or None
        self.save_added = saving(save_added, owner)
        self.surgery: Surgery | None = None
        self.added: list[nn.Parameter] = []  # trainable parameters the recipe added, for the optimizer
        self._before: ModelState | None = None
        self._set_aside: dict[int, dict[str, Running]] | None = None
        self._keeping: list[Record] = []  # the records that keep calls (emptied after every step)

    @property
    def active(self) -> bool:
        """Whether the recipe is applied now."""
        return self.surgery is not None and self.surgery.active

    def apply(self, model: nn.Module) -> Surgery:
        """Plan against ``model`` (a recipe that does not fit raises here, naming the action), then apply."""
        if len(_VALIDATED) > _VALIDATED_MAX:
            _VALIDATED.clear()
        plan = compile_plan(model, self.actions, shared=Shared(configs=_VALIDATED))  # as surgery.plan(model, actions)
        had = {id(p) for p in model.parameters()}
        self._before = ModelState.of(model)
        self.surgery = surgery.apply(model, plan)
        kept = [r for records in self.surgery.captures.values() for r in records.values()]
        self._keeping = [r for r in kept if r.reduce == "none"]
        self.added = [p for p in model.parameters() if id(p) not in had and p.requires_grad]
        return self.surgery

    def remove(self, check: bool = True) -> None:
        """Undo the recipe; with ``check``, raise an ActionError naming any hook, module or slot not back as before.

        ``Surgery.remove(verify=True)`` would also compare values, which training changes by design; this checks
        everything else it checks (every hook dict, ``_is_full_backward_hook``, children, tensor slots, flags).
        """
        s, before = self.surgery, self._before
        if s is None or not s.active:
            return
        self.resume_window()
        if self.save_added is not None:
            self._save(s, check)
        s.remove()
        if check and before is not None:
            diffs = restore_differences(before, ModelState.of(s.model))
            if diffs:
                more = f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else ""
                raise ActionError(
                    f"{self.owner}: the model is not restored after the run: {'; '.join(diffs[:5])}{more}"
                )

    def _save(self, s: Surgery, check: bool) -> None:
        """Write the added tensors before they go; on an interrupted run a failed write warns, not hides the error."""
        assert self.save_added is not None
        path, form = self.save_added
        try:
            s.save_added(path, format=form)
        except Exception as e:
            if check:
                raise
            warnings.warn(f"{self.owner}.save_added: could not write {str(path)!r}: {e}", stacklevel=2)

    def statistics(self) -> dict[str, float]:
        """``surgery/ACTION/MODULE[/WHAT]/STAT`` → value for every record; reduced windows start again."""
        if self.surgery is None:
            return {}
        out: dict[str, float] = {}
        for action, records in self.surgery.captures.items():
            for key, record in records.items():
                for what, stats in record_statistics(record).items():
                    prefix = f"surgery/{action}/{key}" + ("" if what in MAIN else f"/{what}")
                    out.update({f"{prefix}/{stat}": value for stat, value in stats.items()})
                record.running.clear()
        return out

    def end_step(self) -> None:
        """Forget the calls kept by records that keep calls: memory stays at one step."""
        for record in self._keeping:  # made at apply: every step pays for these records only
            record.calls.clear()

    def set_window_aside(self) -> None:
        """Keep the running statistics gathered so far out of reach of the batches that follow (validation in fit)."""
        if self.surgery is None or self._set_aside is not None:
            return
        self._set_aside = {}
        for records in self.surgery.captures.values():
            for record in records.values():
                self._set_aside[id(record)], record.running = record.running, {}

    def resume_window(self) -> None:
        """Put back what ``set_window_aside`` kept; what came meanwhile is dropped."""
        if self.surgery is None or self._set_aside is None:
            return
        for records in self.surgery.captures.values():
            for record in records.values():
                record.running = self._set_aside.get(id(record), {})
                if record.reduce == "none":
                    record.calls.clear()
        self._set_aside = None


def record_statistics(record: Record) -> dict[str, dict[str, float]]:
    """``{WHAT: {"mean", "std", "norm"}}`` for one record (see the module docstring for what each means)."""
    if record.reduce != "none":
        return {what: _window_stats(running) for what, running in list(record.running.items()) if running.count}
    calls = record.calls
    if not calls:
        return {}
    last = calls[-1]
    out: dict[str, dict[str, float]] = {}
    for field in ("input", "kwargs", "output", "grad_input", "grad_output", "grad"):
        what = "input" if field == "kwargs" else field
        for name, tensor in _tensors(getattr(last, field), what):
            if tensor.is_floating_point() and tensor.numel():
                out[name] = _tensor_stats(tensor)
    return out


def _tensors(value: Any, what: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(what, value)]
    if isinstance(value, dict):
        return [(f"{what}.{k}", v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    if isinstance(value, (tuple, list)):
        return [(f"{what}.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _tensor_stats(tensor: torch.Tensor) -> dict[str, float]:
    x = tensor.detach().double()
    return {
        "mean": x.mean().item(),
        "std": x.std(correction=0).item(),
        "norm": torch.linalg.vector_norm(x).item(),
    }


def _window_stats(running: Running) -> dict[str, float]:
    """Pooled over every row and element: the law of total variance over the elementwise mean and M2."""
    (mean, m2), rows = running.moments(), running.count
    elements = mean.numel()
    overall = mean.mean()
    if mean.device.type == "cpu" and type(mean) is torch.Tensor and type(m2) is torch.Tensor:
        # the elementwise steps in numpy (the same IEEE operations, a microsecond each), the sums in torch's order
        centre, values, spread = overall.item(), mean.numpy(), m2.numpy()
        deviation = values - centre
        total_m2 = m2.sum().item() + rows * torch.from_numpy(np.asarray(deviation * deviation)).sum().item()
        square_norm = torch.from_numpy(np.asarray(spread / rows + values * values)).sum().item()
    else:
        centre = overall.item()
        total_m2 = (m2.sum() + rows * ((mean - overall) ** 2).sum()).item()
        square_norm = (m2 / rows + mean**2).sum().item()  # E over rows of ||row||^2
    return {
        "mean": centre,
        "std": math.sqrt(max(total_m2, 0.0) / (rows * elements)),
        "norm": math.sqrt(max(square_norm, 0.0)),
    }


def restore_differences(before: ModelState, now: ModelState) -> list[str]:
    """Hook dicts, flags, children and tensor slots that differ; values, mode, device and dtype may move."""
    diffs = [f"module {n}: gone" for n in before.modules if n not in now.modules]
    diffs += [f"module {n}: new" for n in now.modules if n not in before.modules]
    diffs += [f"tensor {n}: gone" for n in before.tensors if n not in now.tensors]
    diffs += [f"tensor {n}: new" for n in now.tensors if n not in before.tensors]
    for kind, was, is_now in (("module", before.modules, now.modules), ("tensor", before.tensors, now.tensors)):
        for name, facts in was.items():
            after = is_now.get(name, facts)
            diffs += [
                f"{kind} {name}: {key} was {value!r}, now {after.get(key)!r}"
                for key, value in facts.items()
                if key not in _MOVABLE and after.get(key) != value
            ]
    diffs += [f"torch global {k} changed" for k, v in before.globals.items() if now.globals.get(k) != v]
    return diffs
