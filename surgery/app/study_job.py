"""``python -m surgery ... +study=NAME``: a study as one job, written into the run directory.

Writes ``study.safetensors`` (``values/M`` ``[*grid, examples]``, ``mean/M``, ``ci_low/M``,
``ci_high/M``), ``study.csv`` (a row per cell and metric), ``plots/study_M.png``, ``report.json``
(its ``study`` section) and ``report.md`` (the plots first).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from surgery.app.batches import Batches, input_spec, make_batches
from surgery.app.build import build_model, resolve_device, run_dtype, seed_everything, settings_of
from surgery.app.job import write_vectors
from surgery.app.prepare import run_vectors, source_batches
from surgery.app.report import environment, fingerprint
from surgery.core.compiler import load_actions
from surgery.core.output import say
from surgery.core.schema import validate
from surgery.errors import ConfigError
from surgery.files.gate import remove_file
from surgery.files.write import write_json, write_tensors, write_text
from surgery.report import study_markdown, write_report_html
from surgery.study.config import StudyConfig
from surgery.study.grid import cells, check_uses, grid_cells
from surgery.study.plots import undrawn
from surgery.study.result import StudyResult
from surgery.study.resume import PARTIAL, Progress, load_partial, saver
from surgery.study.run import check_method, grid_of, plan_cells, run_study
from surgery.vectors import named_as_vectors


def run_study_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Build the model and inputs, run every cell, write the study's files; returns report.json's dict."""
    clock = time.perf_counter()
    settings = settings_of(cfg)
    study = validate(StudyConfig, _plain(settings.study), "study")
    check_method(study.method, study.steps, study.verify_top)
    if settings.mode not in ("run", "plan"):
        raise ConfigError(f"mode: a study runs with mode=run (or mode=plan to check every cell); got {settings.mode}")
    grid_cells(study.grid)  # the grid's size from its arithmetic, before the model is built
    seed_everything(settings.seed)
    device = resolve_device(settings.device)
    actions = load_actions(cfg.get("actions"))
    model = build_model(cfg.model, settings, device)
    spec = input_spec(_plain(cfg.model.get("input") or {}), _plain(cfg.get("input") or {}), model)
    data = make_batches(spec, settings.seed, run_dtype(settings, model), device, model, cfg.model.get("path"))
    source = source_batches(cfg, settings, device, model, data)
    given = actions
    vectors, actions = run_vectors(cfg, settings, model, data.tokenizer, given, {})  # before any cell is planned
    if data.text is not None:  # a masked LM or T5 has no next-token loss
        from surgery.lm.kinds import STUDY_CAUSAL_ONLY, STUDY_INSTEAD, refuse_causal_metrics
        from surgery.study.metrics import parse_metrics

        named = parse_metrics(study.metrics, data.tokenizer)
        refuse_causal_metrics(model, named, "study.metrics", STUDY_CAUSAL_ONLY, STUDY_INSTEAD)
    inputs, labels = gathered_inputs(data)
    loaded = time.perf_counter() - clock  # building the model, its inputs and the source
    report: dict[str, Any] = {"mode": "study" if settings.mode == "run" else "plan", "seed": settings.seed}
    report["fingerprints"] = {"config": fingerprint(OmegaConf.to_container(cfg, resolve=True)),
                              "input": fingerprint(inputs)}  # fmt: skip
    if vectors:
        report["vectors"] = write_vectors(out_dir, vectors)
    if settings.mode == "plan":
        with named_as_vectors(given):
            return _plan_only(model, actions, study, inputs, data, settings, out_dir, report)
    src = None if source is None else gathered_inputs(source)[0]
    progress = _progress(out_dir, report["fingerprints"], model, actions, study, inputs, data)
    with named_as_vectors(given):
        result = run_study(
            model, actions, study.grid, inputs, study.metrics, source=src, labels=labels, normalize=study.normalize,
            ci=study.ci, n_boot=study.n_boot, tokenizer=data.tokenizer, seed=settings.seed, strict=settings.strict,
            safe=settings.safe, batch_cells=study.batch_cells, progress=progress, ranks=_ranks(),
            method=study.method, steps=study.steps, verify_top=study.verify_top,
        )  # fmt: skip
    seconds = {"load": loaded, **result.seconds}
    write_tensors(out_dir / "study.safetensors", result.tensors())
    write_text(out_dir / "study.csv", result.csv_text())
    plots = result.plot(out_dir / "plots")
    skipped = {f"plots/{name}": why for name, why in undrawn(result).items()}
    report.update(
        complete=True,
        study=_section(result, study, data, seconds),
        model={"class": f"{type(model).__module__}.{type(model).__qualname__}"},
        data={"source": data.source, "examples": data.examples,
              **({"prompts": list(data.text.prompts)} if data.text is not None else {})},
        plots=[str(p.relative_to(out_dir)) for p in plots if p.suffix == ".png"],
        **({"plot_notes": skipped} if skipped else {}),
        environment=environment(str(device)),
    )  # fmt: skip
    write_json(out_dir / "report.json", report)
    write_text(out_dir / "report.md", study_markdown(report, result))
    write_report_html(report, out_dir, actions=actions)
    remove_file(out_dir / PARTIAL)  # every cell is in study.safetensors now
    times = ", ".join(f"{part} {value:.2f} s" for part, value in seconds.items())
    say(f"study: {len(result.cells)} cells × {data.examples} examples ({times}); {headline(result)};"
        f" wrote {out_dir}")  # fmt: skip
    return report


def headline(result: StudyResult, top: int = 3) -> str:
    """The first metric's cells that moved it most from the unmodified run, e.g. ``layer=0 pos=5 1.00``."""
    name = result.metrics[0]
    means = result.mean[name].reshape(-1)
    unmodified = 0.0 if result.normalized == name else float(result.baselines["unmodified"][name].nanmean())
    order = torch.argsort((means - unmodified).abs().nan_to_num(-1.0), descending=True)[:top].tolist()
    cells = ", ".join(
        " ".join(f"{k}={v}" for k, v in result.cells[i].items()) + f" {float(means[i]):.4g}" for i in order
    )
    what = f"{name} (normalized)" if result.normalized == name else f"{name} (unmodified {unmodified:.4g})"
    return f"{what} moved most at {cells}"


def _ranks() -> tuple[int, int] | None:
    """(rank, world size) under torchrun: the ranks split the cells; None in one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _progress(
    out_dir: Path,
    prints: dict[str, str],
    model: Any,
    actions: dict[str, Any],
    study: StudyConfig,
    inputs: Any,
    data: Batches,
) -> Progress:
    """An interrupted study's progress in ``out_dir`` (refused if another config, model or input), else a fresh one."""
    from surgery.study.inputs import Inputs
    from surgery.study.metrics import parse_metrics

    grid = grid_of(study.grid, actions, model, Inputs.of(inputs, "input").positions())
    names = [m.name for m in parse_metrics(study.metrics, data.tokenizer)]
    prints = {**prints, "model": fingerprint(model.state_dict())}
    size = len(cells(grid))
    partial = out_dir / PARTIAL
    progress = load_partial(partial, prints, names, size, data.examples) or Progress.fresh(names, size, data.examples)
    if progress.done.any():
        say(f"study: resuming; {int(progress.done.all(dim=1).sum())} of {size} cells were scored before ({partial})")
    progress.save_with = saver(partial, prints)
    return progress


def _plan_only(
    model: Any, actions: dict[str, Any], study: StudyConfig, inputs: Any, data: Batches, settings: Any,
    out_dir: Path, report: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """mode=plan: every cell planned and probed, nothing run; the count and the first cell's plan are printed."""
    from surgery.study.inputs import Inputs
    from surgery.study.run import probe_cells

    given = Inputs.of(inputs, "input")
    grid = grid_of(study.grid, actions, model, given.positions())
    check_uses(grid, actions)
    grid_cells = cells(grid)
    _, plans = plan_cells(model, actions, grid_cells, settings.seed, settings.strict, settings.safe)
    probe_cells(model, plans, grid_cells, given.rows(0, min(1, given.examples)))
    say(f"study: {len(plans)} cells, each planned and checked; the first ({grid_cells[0]}):")
    say(plans[0])
    report.update(complete=True, study={"grid": grid, "cells": len(plans), "first": plans[0].to_dict()})
    write_json(out_dir / "report.json", report)
    write_report_html(report, out_dir, actions=actions)
    return report


def gathered_inputs(data: Batches) -> tuple[Any, torch.Tensor | None]:
    """Every batch's inputs joined along the examples (a dict for keyword inputs), and the labels (non-text)."""
    batches = list(data)
    if not batches:
        raise ConfigError("input: no examples to study")
    first = batches[0]
    labels = None
    if data.text is None and all(b.labels is not None for b in batches):
        labels = torch.cat([b.labels for b in batches if b.labels is not None])
    if first.kwargs and not first.args:
        return {k: torch.cat([b.kwargs[k] for b in batches]) for k in first.kwargs}, labels
    if len(first.args) != 1 or first.kwargs:
        raise ConfigError("input: a study takes one positional input or keyword inputs (token ids and their mask)")
    return torch.cat([b.args[0] for b in batches]), labels


def _section(result: StudyResult, study: StudyConfig, data: Batches, seconds: dict[str, float]) -> dict[str, Any]:
    """report.json's study section: the grid, files, and each metric's means (and baselines) as lists."""
    return {
        "grid": result.grid,
        "cells": len(result.cells),
        "examples": data.examples,
        "metrics": result.metrics,
        "normalized": result.normalized,
        "normalization": result.normalization,
        "ci": result.ci,
        "n_boot": study.n_boot if result.ci is not None else None,
        "method": study.method,
        "files": {"tensors": "study.safetensors", "csv": "study.csv"},
        "mean": {name: result.mean[name].tolist() for name in result.metrics},
        "baselines": {
            which: {name: float(v.nanmean()) for name, v in table.items()} for which, table in result.baselines.items()
        },  # fmt: skip
        "tokens": result.tokens,
        "verify": result.verify,
        "seconds": seconds,
    }


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
