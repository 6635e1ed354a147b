"""A job as prepared before anything changes: settings, model, batches, the plan; what a job reached."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from surgery.app.batches import Batches, input_spec, make_batches
from surgery.app.build import (
    build_model,
    input_device,
    module_table,
    on_device,
    resolve_device,
    run_dtype,
    seed_everything,
    settings_of,
)
from surgery.app.interrupt import Interrupts
from surgery.app.scoring import metric_names
from surgery.app.splice_metrics import split_metrics
from surgery.core.compiler import Plan, compile_plan, load_actions
from surgery.core.limits import check_count
from surgery.core.output import say
from surgery.core.schema import RunSettings
from surgery.data.metrics import Metric
from surgery.dist.run import wrapped
from surgery.vectors import Vector, compute_vectors, named_as_vectors, steering


@dataclass
class Reached:
    """How far a job got: what an interrupted run's report says."""

    mode: str = ""
    batches: int = 0
    done: int = 0  # batches finished
    report: dict[str, Any] | None = None  # the report.json written, once it is


@dataclass
class Job:
    """One run's settings, model, inputs and plan, as prepared before anything is changed."""

    cfg: DictConfig
    settings: RunSettings
    model: nn.Module
    input_spec: dict[str, Any]
    data: Batches  # every batch, batch 0 (``inputs``) first
    plan: Plan
    load_late: bool  # a checkpoint loaded after applying, through on_load hooks
    source: Batches | None = None  # run first through the same surgery (source pass), then frozen for from: capture
    metrics: tuple[str | Metric, ...] = ()  # scored on every batch for the surgered and the unmodified model
    timings: dict[str, float] = field(default_factory=dict)
    interrupts: Interrupts = field(default_factory=Interrupts)  # run_job's, checked after every batch
    reached: Reached = field(default_factory=Reached)
    losses: list[float] = field(default_factory=list)  # with backward: the surgered model's loss, per batch
    loss_metric: Any = None  # loss: {logit_diff: ...}: the per-example metric the backward starts from
    vectors: dict[str, Vector] = field(default_factory=dict)  # the vectors: block, computed before planning
    splice_metrics: tuple[str, ...] = ()  # l0, ... of the plan's splices, after the run (surgery/app/splice_metrics.py)
    remake: Any = None  # makes the run's batches again (the splice metrics' own pass over them)

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Batch 0's input tensors (positional, then keyword): fingerprinted and described in the report."""
        return self.data.tensors()

    @property
    def batches(self) -> int:
        """How many batches the run has."""
        return self.data.count


def prepare(cfg: DictConfig) -> Job | None:
    """Settings, seed, model, inputs and plan; None in ``mode=modules`` (the table is printed)."""
    settings = settings_of(cfg)
    clock = time.perf_counter()
    seed_everything(settings.seed)
    device = resolve_device(settings.device)
    actions = load_actions(cfg.get("actions"))
    check_count(len(actions), "actions", "actions")
    load_late = bool(cfg.model.get("checkpoint")) and any(
        isinstance(a, Mapping) and a.get("kind") == "on_load" and a.get("enabled", True) for a in actions.values()
    )
    model = build_model(cfg.model, settings, device, load=not load_late)
    model = wrapped(model)  # distributed.wrap=ddp|fsdp on a torchrun rank; as it is otherwise (surgery/dist/run.py)
    if settings.mode == "modules":
        say(module_table(model))
        from surgery.arch import site_map_text  # where each @ site lives in this model (SPEC §16)

        say(site_map_text(model) or "sites: none (no known architecture and no repeated block list)")
        return None
    spec = input_spec(_plain(cfg.model.get("input") or {}), _plain(cfg.get("input") or {}), model)
    made_on = input_device(device)  # meta: drawn on cpu, batch 0 moved to meta for the probe (surgery/app/build.py)
    data = on_device(make_batches(spec, settings.seed, run_dtype(settings, model), made_on, model,
                                  cfg.model.get("path")), device)  # fmt: skip
    logit_metrics, splice_names = split_metrics(settings.metrics)
    metrics = metric_names(logit_metrics, data, settings.compare, model)
    source = source_batches(cfg, settings, device, model, data)
    batches = data.count
    timings = {"build_s": time.perf_counter() - clock}
    vectors, steered = run_vectors(cfg, settings, model, data.tokenizer, actions, timings)
    clock = time.perf_counter()
    with named_as_vectors(actions):
        plan = compile_plan(
            model, steered, seed=settings.seed, strict=settings.strict, safe=settings.safe,
            example_inputs=data.first.args, example_kwargs=data.first.kwargs, batches=batches,
        )  # fmt: skip
    timings["plan_s"] = time.perf_counter() - clock
    job = Job(cfg, settings, model, spec, data, plan, load_late, source, metrics, timings, vectors=vectors)
    if splice_names:
        job.splice_metrics = splice_names
        job.remake = lambda: on_device(make_batches(spec, settings.seed, run_dtype(settings, model), made_on, model,
                                                    cfg.model.get("path")), device)  # fmt: skip
    if isinstance(settings.loss, dict):  # its tokens resolved now, with the run's tokenizer: refused before running
        from surgery.study.metrics import per_example

        name, options = next(iter(settings.loss.items()))
        job.loss_metric = per_example(str(name), options, data.tokenizer, where="loss")
    return job


def run_vectors(
    cfg: DictConfig, settings: RunSettings, model: nn.Module, tokenizer: Any, actions: dict[str, Any],
    timings: dict[str, float],
) -> tuple[dict[str, Vector], dict[str, Any]]:  # fmt: skip
    """The ``vectors:`` block computed on the model (before any surgery), and the actions adding them."""
    clock = time.perf_counter()
    vectors = compute_vectors(model, settings.vectors, tokenizer, settings.safe)
    if vectors:
        timings["vectors_s"] = time.perf_counter() - clock
    return vectors, steering(actions, vectors)


def source_batches(
    cfg: DictConfig, settings: RunSettings, device: torch.device, model: nn.Module, data: Batches
) -> Batches | None:
    """The ``source`` input (one batch, run first through the surgery), checked against the main input."""
    given = cfg.get("source")
    if given is None:
        return None
    spec = input_spec(_plain(cfg.model.get("input") or {}), _plain(given), model)
    dtype = run_dtype(settings, model)
    source = make_batches(spec, settings.seed, dtype, device, model, cfg.model.get("path"), where="source")
    if source.text is not None and data.text is not None:
        from surgery.lm.text import require_equal_lengths

        require_equal_lengths(data.text, source.text, "source.prompt")
    return source


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)  # type: ignore[return-value]
