"""What a CLI job should report, computed in plain PyTorch on the job's own model and inputs (for exact checks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from torch import nn

from surgery.app.prepare import Job, prepare
from surgery.app.report import first_tensor
from surgery.core.paths import config_dir

ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU)  # conf/actions/linearize.yaml


def prepared(*overrides: str) -> Job:
    """The job (model, inputs, plan) the CLI builds from these overrides (same seed, same order)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    job = prepare(cfg)
    assert job is not None
    return job


def job_of(*overrides: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model and batch-0 inputs the CLI job builds from these overrides."""
    job = prepared(*overrides)
    return job.model, job.inputs


def outputs_of(model: nn.Module, names: list[str], inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Each named module's output on one forward, recorded by hand-written hooks."""
    seen: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, out))
        for name in names
    ]
    try:
        logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def logits(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        return first_tensor(model(*inputs)).detach()


def max_abs(new: torch.Tensor, old: torch.Tensor) -> float:
    """The report's ``difference.max_abs``: in float64."""
    return (new.double() - old.double()).abs().max().item()


def linearized(model: nn.Module) -> nn.Module:
    """Every activation module swapped for nn.Identity, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, ACTIVATIONS):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, nn.Identity())
    return model


def with_hooks(model: nn.Module, hooks: dict[str, Callable[[nn.Module, Any, Any], Any]]) -> list[Any]:
    """Hand-written forward hooks on the named modules; returns the handles."""
    return [model.get_submodule(name).register_forward_hook(hook) for name, hook in hooks.items()]


def zero_output(m: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(output)


def scale_item0(value: float) -> Callable[[nn.Module, Any, Any], Any]:
    def hook(m: nn.Module, args: Any, output: Any) -> Any:
        return output * value if isinstance(output, torch.Tensor) else (output[0] * value, *output[1:])

    return hook
