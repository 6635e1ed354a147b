"""The job behind the CLI, on plain values: build the model, plan, apply, run, compare, write."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from surgery.callables import check_targets
from surgery.compiler import compile_plan, load_actions
from surgery.engine import apply_plan, hooks_on
from surgery.errors import ConfigError, SurgeryError
from surgery.inputs import loss_of, make_inputs
from surgery.io import load_checkpoint, read_tensors, write_json, write_tensors
from surgery.report import difference, environment, fingerprint, first_tensor, flatten_captures, stats
from surgery.schema import RunSettings, validate

MODEL_EXTRAS = ("checkpoint", "input")


def settings_of(cfg: DictConfig) -> RunSettings:
    """The run settings of a composed config, validated."""
    names = [f for f in RunSettings.__dataclass_fields__]
    return validate(RunSettings, {k: cfg[k] for k in names if k in cfg}, "")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(device: str) -> torch.device:
    """cpu | cuda | cuda:N | auto, refusing a GPU that is not there."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} asked for, but torch sees no CUDA GPU here; use device=cpu or auto")
    return torch.device(device)


def build_model(model_cfg: Any, settings: RunSettings, device: torch.device, load: bool = True) -> nn.Module:
    """Instantiate the model config's ``_target_``, load its checkpoint (unless ``load=False``), move it, eval."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    node = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError("model: needs a _target_ (the class to build), e.g. +model=cnn")
    target = str(node["_target_"])
    check_targets(node, "model", settings.safe)
    checkpoint = node.get("checkpoint")
    build = {k: v for k, v in node.items() if k not in MODEL_EXTRAS}
    try:
        model = instantiate(build)
    except InstantiationException as e:
        if isinstance(e.__cause__, SurgeryError):  # e.g. a missing optional extra: keep its hint
            raise e.__cause__ from None
        raise ConfigError(f"model: cannot build {target!r}: {_reason(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_: {target!r} built a {type(model).__name__}, not a torch.nn.Module")
    if checkpoint and load:
        load_checkpoint(model, checkpoint)
    model = model.to(device=device, dtype=getattr(torch, settings.dtype))
    return model.eval()


def _reason(error: Exception) -> str:
    """The most telling line of a Hydra instantiation error: its cause when there is one."""
    cause = error.__cause__
    if cause is not None:
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return str(error).strip().splitlines()[-1]


def module_table(model: nn.Module) -> str:
    """One line per module: name, type, own parameter shapes, parameter count below it."""
    from surgery.select import module_targets

    rows = [("name", "type", "params", "own tensors")]
    for t in module_targets(model):
        own = ", ".join(f"{n}{list(p.shape)}" for n, p in t.module.named_parameters(recurse=False))
        count = sum(p.numel() for p in t.module.parameters())
        rows.append((t.name, type(t.module).__name__, f"{count:,}", own or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)


def forward(model: nn.Module, inputs: tuple[torch.Tensor, ...], settings: RunSettings, target: Any) -> Any:
    """Run the model; with ``backward`` also the loss's backward pass so backward hooks fire."""
    if not settings.backward:
        with torch.no_grad():
            return model(*inputs)
    inputs = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)  # token ids stay ints
    output = model(*inputs)
    loss_of(first_tensor(output), settings.loss, target).backward()
    return output


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Everything `python -m surgery` does for one job; returns the report it wrote."""
    settings = settings_of(cfg)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    seed_everything(settings.seed)
    device = resolve_device(settings.device)
    actions = load_actions(cfg.get("actions"))
    # with on_load actions the checkpoint is loaded after applying, through their hooks
    load_late = bool(cfg.model.get("checkpoint")) and any(
        isinstance(a, Mapping) and a.get("kind") == "on_load" and a.get("enabled", True) for a in actions.values()
    )
    model = build_model(cfg.model, settings, device, load=not load_late)
    if settings.mode == "modules":
        print(module_table(model))
        return {}
    input_spec = {**_plain(cfg.model.get("input") or {}), **_plain(cfg.get("input") or {})}
    inputs = make_inputs(input_spec, settings.seed, getattr(torch, settings.dtype), device)
    timings["build_s"] = time.perf_counter() - clock

    clock = time.perf_counter()
    plan = compile_plan(
        model, actions, seed=settings.seed, strict=settings.strict, safe=settings.safe, example_inputs=inputs
    )
    timings["plan_s"] = time.perf_counter() - clock
    print(plan)
    report: dict[str, Any] = {"mode": settings.mode, "seed": settings.seed, "plan": plan.to_dict()}
    config_print = fingerprint(OmegaConf.to_container(cfg, resolve=True))
    matched_print = fingerprint(plan.to_dict())
    if settings.mode == "plan":
        report["fingerprints"] = {"config": config_print, "matched_modules": matched_print}
        write_json(out_dir / "report.json", report)
        return report

    state_before = fingerprint(model.state_dict())
    modules_before, params_before = _counts(model)
    hooks_before = hooks_on(model)
    original = forward(model, inputs, settings, input_spec.get("target")) if settings.compare else None
    model.zero_grad(set_to_none=True)

    clock = time.perf_counter()
    surgery = apply_plan(model, plan)
    timings["apply_s"] = time.perf_counter() - clock
    try:
        if load_late:
            surgery.load_state_dict(read_tensors(Path(str(cfg.model.checkpoint)), "model.checkpoint"))
        modules_after, params_after = _counts(model)
        state_after = fingerprint(model.state_dict())  # now: the dict holds live tensors
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()} if settings.save_model else {}
        clock = time.perf_counter()
        output = forward(model, inputs, settings, input_spec.get("target"))
        timings["forward_s"] = time.perf_counter() - clock
        captures = flatten_captures(surgery.captures)
        for step in report["plan"]:
            step["hooks"] = surgery.hook_count.get(step["action"], 0)
    finally:
        surgery.remove()
        model.zero_grad(set_to_none=True)
    restored = fingerprint(model.state_dict()) == state_before and hooks_on(model) == hooks_before
    if not restored:
        raise RuntimeError("the model was not restored exactly after remove(); this is a bug in surgery")

    report.update(
        model={
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "modules_before": modules_before,
            "modules_after": modules_after,
            "parameters_before": params_before,
            "parameters_after": params_after,
        },
        input=[stats(x) for x in inputs],
        output=stats(first_tensor(output)),
        original_output=stats(first_tensor(original)) if settings.compare else None,
        difference=difference(first_tensor(output), first_tensor(original)) if settings.compare else None,
        captures={"file": "captures.safetensors" if captures else None, "count": len(captures)},
        timings=timings,
        environment=environment(str(device)),
        restored=restored,
        fingerprints={
            "config": config_print,
            "matched_modules": matched_print,
            "input": fingerprint(inputs),
            "state_dict_before": state_before,
            "state_dict_after": state_after,
            "output": fingerprint(output),
        },
    )
    if captures:
        write_tensors(out_dir / "captures.safetensors", captures)
    if settings.save_model:
        write_tensors(out_dir / "model.safetensors", saved)
    write_json(out_dir / "report.json", report)
    print(summary_line(report, out_dir))
    return report


def summary_line(report: dict[str, Any], out_dir: Path) -> str:
    """One line for people: output shape, change against the original, hooks, where files went."""
    parts = [f"output {report['output'].get('shape')}"]
    diff = report.get("difference") or {}
    if diff.get("comparable"):
        parts.append(f"max |change| vs original {diff['max_abs']:.4g} (mean {diff['mean_abs']:.4g})")
    hooks = sum(step.get("hooks", 0) for step in report["plan"])
    parts.append(f"{hooks} hook(s), restored exactly")
    if report["captures"]["count"]:
        parts.append(f"{report['captures']['count']} captured tensor(s)")
    return "; ".join(parts) + f"; wrote {out_dir}"


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)  # type: ignore[return-value]


def _counts(model: nn.Module) -> tuple[int, int]:
    return sum(1 for _ in model.modules()), sum(p.numel() for p in model.parameters())
