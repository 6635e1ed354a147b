"""Everything before the surgery: settings, seeding, device, the model (and its checkpoint)."""

from __future__ import annotations

import gc
import random
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from surgery.core.callables import check_targets, instantiate_reason
from surgery.core.limits import check_built
from surgery.core.schema import RunSettings, settings_of  # noqa: F401 - settings_of re-exported (it lives in core)
from surgery.errors import ConfigError, SurgeryError
from surgery.files.checkpoints import load_checkpoint

# The keys of a model config that surgery reads itself; every other key is an argument of _target_.
MODEL_KEYS = {
    "_target_": "the class or function that builds the model, e.g. mynet.TinyNet: imported from the directory"
    " you started in, or from PYTHONPATH",
    "checkpoint": "weights loaded after building: .safetensors, or a .pt/.pth state_dict (weights_only=True)",
    "input": "the model's input defaults (the input keys below); the run's input overrides them",
}
MODEL_EXTRAS = ("checkpoint", "input")  # read by surgery, not passed to _target_


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(device: str) -> torch.device:
    """cpu | cuda | cuda:N | auto | meta, refusing a GPU that is not there."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} asked for, but torch sees no CUDA GPU here; use device=cpu or auto")
    return torch.device(device)


def build_model(model_cfg: Any, settings: RunSettings, device: torch.device, load: bool = True) -> nn.Module:
    """Instantiate the model config's ``_target_``, load its checkpoint (unless ``load=False``), move it, eval."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if isinstance(model_cfg, DictConfig):
        missing = sorted(str(k) for k in model_cfg if OmegaConf.is_missing(model_cfg, str(k)))
        if missing:
            raise ConfigError(f"model.{missing[0]}: required by this model config; give model.{missing[0]}=VALUE")
    node = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError("model: needs a _target_ (the class to build), e.g. +model=cnn")
    target = str(node["_target_"])
    check_targets(node, "model", settings.safe)
    check_dtypes(node, settings)
    checkpoint = node.get("checkpoint")
    build = {k: v for k, v in node.items() if k not in MODEL_EXTRAS}
    meta = device.type == "meta"
    _freeze_once()
    if not meta:  # under limits.memory_gb: built on meta first, so a huge one is refused before allocating
        check_built(lambda: instantiate(build), "model", target)
    try:
        if meta:  # every tensor is made on meta from the start: shapes and dtypes, never values or memory
            with torch.device("meta"):
                model = instantiate(build)
        else:
            model = instantiate(build)
    except InstantiationException as e:
        if isinstance(e.__cause__, SurgeryError):  # e.g. a missing optional extra: keep its hint
            raise e.__cause__ from None
        raise ConfigError(f"model: cannot build {target!r}: {instantiate_reason(e, target)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_: {target!r} built a {type(model).__name__}, not a torch.nn.Module")
    if meta:  # a 70B-class tree is ~10k modules of Python objects and no tensor memory: out of the collector too
        gc.freeze()
    first = next(iter(model.parameters()), None)
    if not meta and first is not None and first.is_meta:
        raise ConfigError(
            f"model: {target!r} builds on the meta device (shapes, no weights); use device=meta with mode=plan or"
            " mode=modules"
        )
    if checkpoint and load and not meta:  # a plan on meta needs the names and shapes, which the config gives
        load_checkpoint(model, checkpoint)
    if settings.dtype is None:  # the model's own: model.dtype as loaded, or as built
        return model.to(device=device).eval()
    return model.to(device=device, dtype=getattr(torch, settings.dtype)).eval()


def check_dtypes(node: Mapping[Any, Any], settings: RunSettings) -> None:
    """Refuse a run ``dtype`` that contradicts the model config's own ``dtype`` (``model.dtype=bfloat16``)."""
    own = node.get("dtype")
    if isinstance(own, str) and settings.dtype is not None and settings.dtype != own:
        raise ConfigError(
            f"dtype: the run's dtype={settings.dtype} contradicts model.dtype={own}; drop dtype (it follows"
            f" model.dtype), or set both to the same, e.g. dtype={own} model.dtype={own}"
        )


def run_dtype(settings: RunSettings, model: nn.Module) -> torch.dtype:
    """The dtype inputs are made in: the run's ``dtype``, else the model's first floating tensor's, else float32."""
    if settings.dtype is not None:
        return getattr(torch, settings.dtype)  # type: ignore[no-any-return]
    tensors = (t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point())
    first = next(tensors, None)
    return first.dtype if first is not None else torch.float32


def _freeze_once() -> None:
    """Move what the imports made (torch alone ~200k objects, alive as long as the process) out of the collector.

    A full collection then no longer walks them (0.3-0.4 s, which landed in the 70B meta plan). Once per
    process: a later job of an in-process sweep would also freeze the garbage its predecessor left.
    """
    global _FROZEN
    if not _FROZEN:
        gc.freeze()
        _FROZEN = True


_FROZEN = False


def module_table(model: nn.Module) -> str:
    """One line per module: name, type, own parameter shapes, parameter count below it."""
    from surgery.core.select import module_targets

    rows = [("name", "type", "params", "own tensors")]
    for t in module_targets(model):
        own = ", ".join(f"{n}{list(p.shape)}" for n, p in t.module.named_parameters(recurse=False))
        count = sum(p.numel() for p in t.module.parameters())
        rows.append((t.name, type(t.module).__name__, f"{count:,}", own or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)


def input_device(device: torch.device) -> torch.device:
    """Where the inputs are made: on cpu for a meta model (seeded draws need a generator), else ``device``."""
    return torch.device("cpu") if device.type == "meta" else device


def on_device(batches: Any, device: torch.device) -> Any:
    """A meta model's batch 0 moved onto meta, for the plan's probe forward (shapes only); other devices as they are."""
    if device.type != "meta":
        return batches
    first = batches.first
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in first.args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in first.kwargs.items()}
    batches.first = first._replace(args=args, kwargs=kwargs)
    return batches
