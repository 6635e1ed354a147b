"""The job behind the CLI, on plain values: build, plan, apply, run every batch, compare, write."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from surgery.app.batches import Batches
from surgery.app.forwards import run_batches, streamed_actions, unmodified_forward
from surgery.app.interrupt import Interrupted, Interrupts, exit_code, remove_temporary_files
from surgery.app.prepare import Job, Reached, prepare
from surgery.app.report import difference, environment, fingerprint, first_tensor, output_tensors, stats
from surgery.app.scoring import Scoring, summary
from surgery.arch import lens_report, site_map_text, uses_sites
from surgery.core.compiler import load_actions
from surgery.core.engine import Surgery, apply_plan
from surgery.core.output import say
from surgery.core.records import flatten_captures
from surgery.files.checkpoints import load_checkpoint
from surgery.files.gate import listing
from surgery.files.write import write_json, write_tensors
from surgery.report import write_report_html, write_report_md
from surgery.vectors import Vector, summaries

OUTPUT_FILE_MAX_BYTES = 64 * 2**20  # batch 0's output is saved for replay up to this size


def run_job(cfg: DictConfig, out_dir: Path, typed: set[str] | None = None, start: Path | None = None) -> dict[str, Any]:
    """Everything `python -m surgery` does for one job; returns the report it wrote.

    ``typed`` are the keys set on the command line (the user's own paths); under ``safe=true`` every other
    path a config names must stay inside ``start`` (the directory the run started in), checked where it is
    opened (surgery/files/gate.py). The CLI and replay pass it; ``None`` (a Python caller) confines nothing.
    Nothing is written through a symlink inside ``out_dir``.

    SIGINT or SIGTERM while batches run stops after the current batch and writes what finished,
    with ``"complete": false`` in report.json; at any other time, or a second one, it stops at once.
    Either way it prints one line on stderr and raises ``SystemExit`` (130 for SIGINT, 143 for SIGTERM).
    """
    from surgery.app.build import settings_of
    from surgery.core.limits import enforced
    from surgery.core.schema import limits_of
    from surgery.files.gate import confined, writing_into

    settings = settings_of(cfg)
    confine = settings.safe and typed is not None  # None: a Python caller, whose config paths are its own
    paths = confined(start or Path.cwd(), typed or set()) if confine else contextlib.nullcontext()
    with enforced(limits_of(settings)), paths, writing_into(out_dir):  # bounded costs, paths and writes
        return _bounded_job(cfg, out_dir)


def _bounded_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    from surgery.dist.run import run_ranks, wanted

    # A run killed at once (SIGKILL) in this directory may have left write_atomic's temporary files; none is
    # ever read as data, and none may outlive the rerun. Before any rank's first write (ranks meet later).
    remove_temporary_files(out_dir)
    if cfg.get("mode") == "harvest":  # a corpus into an activation dataset, ranks included (surgery/app/harvest_job.py)
        from surgery.app.harvest_job import run_harvest_job

        return run_harvest_job(cfg, out_dir)
    if wanted(cfg):  # torchrun: this rank's job, written with the others' into one run directory (surgery/dist)
        return run_ranks(cfg, out_dir, run_job)
    reached = Reached()
    with Interrupts() as interrupts:
        try:
            report = _run_job(cfg, out_dir, interrupts, reached)
        except Interrupted as stop:
            _stopped_at_once(out_dir, stop, interrupts, reached)
    if interrupts.requested:
        remove_temporary_files(out_dir)
        print(
            f"interrupted by {interrupts.name}: stopped after {reached.done} of {reached.batches} batches;"
            f" wrote what finished and an incomplete report to {out_dir / 'report.json'}",
            file=sys.stderr,
        )
        raise SystemExit(exit_code(interrupts.signal or 0))
    return report


def _stopped_at_once(out_dir: Path, stop: Interrupted, interrupts: Interrupts, reached: Reached) -> None:
    """The job stopped where it was: remove temporary files, mark the report incomplete, one line, exit."""
    remove_temporary_files(out_dir)
    again = interrupts.count > 1
    report = {**(reached.report or {"mode": reached.mode}), "complete": False, "interrupted": stop.args[0]}
    report.update(batches=reached.batches, batches_done=reached.done)
    if reached.mode not in ("", "modules"):
        write_json(out_dir / "report.json", report)
    where = f"; incomplete report in {out_dir / 'report.json'}" if reached.mode not in ("", "modules") else ""
    print(
        f"interrupted by {stop.args[0]}{' again' if again else ''}: stopped at once after {reached.done} of"
        f" {reached.batches} batches{where}",
        file=sys.stderr,
    )
    raise SystemExit(exit_code(stop.signum))


def _run_job(cfg: DictConfig, out_dir: Path, interrupts: Interrupts, reached: Reached) -> dict[str, Any]:
    if cfg.get("study") is not None:  # a grid of interventions: its own job (surgery/app/study_job.py)
        from surgery.app.study_job import run_study_job
        from surgery.circuit.config import METHODS

        if isinstance(cfg.study, DictConfig) and cfg.study.get("method") in METHODS:  # edges between components
            from surgery.app.circuit_job import run_circuit_job

            reached.mode = "circuit"
            return run_circuit_job(cfg, out_dir)

        reached.mode = "study"
        return run_study_job(cfg, out_dir)
    job = prepare(cfg)
    if job is None:
        return {}
    job.interrupts, job.reached = interrupts, reached
    reached.mode, reached.batches = job.settings.mode, job.batches
    say(job.plan)
    if job.settings.mode == "plan" and any(uses_sites(a) for a in load_actions(cfg.get("actions")).values()):
        say(site_map_text(job.model))  # site -> real module names (SPEC §16)
    if job.settings.verbose:
        from surgery.app.report import every_match

        say(every_match(job.plan.to_dict()))
    report: dict[str, Any] = {
        "mode": job.settings.mode,
        "seed": job.settings.seed,
        "complete": True,
        "plan": job.plan.to_dict(),
        "warnings": job.plan.warnings,
    }
    if job.vectors:  # computed before the plan: written first, so every mode keeps them
        report["vectors"] = write_vectors(out_dir, job.vectors)
    prints = {
        "config": fingerprint(OmegaConf.to_container(cfg, resolve=True)),
        "matched_modules": fingerprint(report["plan"]),
    }
    if job.settings.mode == "generate":
        from surgery.app.generation import generate_run

        reached.report = report
        return generate_run(job, out_dir, report)
    if job.settings.mode == "plan":
        report["fingerprints"] = prints
        write_json(out_dir / "report.json", report)
        write_report_html(report, out_dir)
        reached.report = report
        return report
    body, captures, saved, output = surgered_run(job, out_dir, prints)
    report.update(body)
    report["lens"] = lens_report(load_actions(job.cfg.get("actions")), captures, job.data.tokenizer) or None
    if captures:
        write_tensors(out_dir / "captures.safetensors", captures)
    if saved is not None:
        write_tensors(out_dir / "model.safetensors", saved)
    outputs = output_tensors(output)  # for replay: how much another machine's output differs, not only that
    fits = 0 < sum(t.numel() * t.element_size() for t in outputs.values()) <= OUTPUT_FILE_MAX_BYTES
    if fits:
        write_tensors(out_dir / "output.safetensors", outputs)
    report["output_file"] = "output.safetensors" if fits else None
    write_json(out_dir / "report.json", report)
    reached.report = report
    write_report_md(report, out_dir, [out_dir / p for p in report["plots"]])
    text = job.data.text
    write_report_html(report, out_dir, tokenizer=job.data.tokenizer, input_ids=text.input_ids if text else None,
                      captures=captures)  # fmt: skip
    say(summary_line(report, out_dir))
    return report


def write_vectors(out_dir: Path, vectors: dict[str, Vector]) -> list[dict[str, Any]]:
    """``vectors.safetensors`` (each vector under its name) in the run directory; report.json's list of them."""
    write_tensors(out_dir / "vectors.safetensors", {name: v.tensor for name, v in vectors.items()}, "vectors")
    return summaries(vectors)


def surgered_run(
    job: Job, out_dir: Path, prints: dict[str, str]
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor] | None, Any]:
    """Run the original, apply, run every batch, remove, check the restore.

    Returns the report's body, the in-memory captures, (with ``save_model``) the surgered state
    and batch 0's output.
    """
    model, settings = job.model, job.settings
    state_before = fingerprint(model.state_dict())
    modules_before, params_before = _counts(model)
    original = unmodified_forward(job) if settings.compare else None
    original_loss = job.losses.pop() if job.losses else None  # the unmodified model's, batch 0
    model.zero_grad(set_to_none=True)
    text = job.data.text is not None
    scoring = Scoring(job.metrics, model, job.plan, text, settings.compare) if job.metrics else None  # a copy, if any

    clock = time.perf_counter()
    surgery = apply_plan(model, job.plan, verify=True)
    job.timings["apply_s"] = time.perf_counter() - clock
    try:
        if job.load_late:
            load_checkpoint(surgery.model, str(job.cfg.model.checkpoint), load=surgery.load_state_dict)  # ties too
        if job.source is not None:  # the clean run: captures record it, then become what from: capture reads
            with surgery.source_pass(), torch.no_grad():
                model(*job.source.first.args, **job.source.first.kwargs)
        modules_after, params_after = _counts(model)
        state_after = fingerprint(model.state_dict())  # now: the dict holds live tensors
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()} if settings.save_model else None
        output, output_print, done = run_batches(job, surgery, out_dir, scoring)
        memory = {a: r for a, r in surgery.captures.items() if a not in streamed_actions(job.plan)}
        captures = flatten_captures(memory)
        images = _plot(surgery, out_dir, _first_tokens(job.data))
        hooks = dict(surgery.hook_count)
    finally:
        surgery.remove(verify=False)  # checked below, not while an error may be on its way out
        model.zero_grad(set_to_none=True)
    surgery.remove(verify=True)  # the engine's check: every hook attribute, module, tensor slot and flag
    restored = fingerprint(model.state_dict()) == state_before  # and every value, bit for bit
    if not restored:
        raise RuntimeError("the model was not restored exactly after remove(); this is a bug in surgery")
    if job.splice_metrics:  # the model as it was: splice_metrics applies the plan's splices itself
        from surgery.app.splice_metrics import splice_report

        splice_found = splice_report(model, job.plan, job.remake, job.splice_metrics, text)
    plan = [{**step, "hooks": hooks.get(step["action"], 0)} for step in job.plan.to_dict()]
    shards = [
        name for name in listing(out_dir / "captures", "captures", missing_ok=True) if name.endswith(".safetensors")
    ]
    body = {
        "plan": plan,
        "model": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "modules_before": modules_before,
            "modules_after": modules_after,
            "parameters_before": params_before,
            "parameters_after": params_after,
        },
        "metrics": scoring.result() if scoring is not None else None,
        **({"splice_metrics": splice_found} if job.splice_metrics else {}),
        "data": {
            "source": job.data.source,
            "examples": scoring.examples if scoring else job.data.examples,
            **({"prompts": list(job.data.text.prompts)} if job.data.text is not None else {}),
            **({"source_prompts": list(job.source.text.prompts)} if job.source and job.source.text else {}),
        },
        "batches": job.batches,
        "batches_done": done,
        "complete": done == job.batches,
        "input": [stats(x) for x in job.inputs],
        "output": stats(first_tensor(output)),
        "backward": backward_record(job, original_loss) if settings.backward else None,
        "original_output": stats(first_tensor(original)) if settings.compare else None,
        "difference": difference(first_tensor(output), first_tensor(original)) if settings.compare else None,
        "captures": {"file": "captures.safetensors" if captures else None, "count": len(captures), "shards": shards},
        "plots": [str(p.relative_to(out_dir)) for p in images],
        "timings": job.timings,
        "environment": environment(str(job.inputs[0].device)),
        "restored": restored,
        "fingerprints": {
            **prints,
            "input": fingerprint(job.inputs),
            "state_dict_before": state_before,
            "state_dict_after": state_after,
            "output": output_print,
        },
    }
    return body, captures, saved, output


def backward_record(job: Job, original: float | None) -> dict[str, Any]:
    """What the backward pass started from: the loss, its value on batch 0 (and the unmodified model's), the mean."""
    losses = job.losses
    mean = sum(losses) / len(losses) if losses else None
    return {"loss": job.settings.loss, "value": losses[0] if losses else None, "original": original, "mean": mean}


def _plot(surgery: Surgery, out_dir: Path, tokens: list[str] | None = None) -> list[Path]:
    if not surgery.plotted:
        return []
    from surgery.app.plots import plot_records  # matplotlib only when plotting

    return plot_records(surgery.captures, surgery.plotted, out_dir, tokens)


def _first_tokens(data: Batches) -> list[str] | None:
    """The first prompt's tokens as text (padding included), to label a plotted attention pattern's axes."""
    if data.text is None or data.tokenizer is None:
        return None
    return [str(data.tokenizer.decode([int(t)])) for t in data.text.input_ids[0]]


def summary_line(report: dict[str, Any], out_dir: Path) -> str:
    """One line for people: the headline metric before → after, output shape, change, hooks, where files went."""
    parts = [summary(report["metrics"])] if report.get("metrics") else []
    parts.append(f"output {report['output'].get('shape')}")
    diff = report.get("difference") or {}
    if diff.get("comparable"):
        parts.append(f"max |change| vs original {diff['max_abs']:.4g} (mean {diff['mean_abs']:.4g})")
    hooks = sum(step.get("hooks", 0) for step in report["plan"])
    parts.append(f"{hooks} hook(s), restored exactly")
    if report["captures"]["count"]:
        parts.append(f"{report['captures']['count']} captured tensor(s)")
    if report["captures"]["shards"]:
        parts.append(f"{len(report['captures']['shards'])} capture shard(s)")
    return "; ".join(parts) + f"; wrote {out_dir}"


def _counts(model: nn.Module) -> tuple[int, int]:
    return sum(1 for _ in model.modules()), sum(p.numel() for p in model.parameters())
