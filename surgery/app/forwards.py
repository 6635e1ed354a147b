"""The forward passes of a run: one batch (with its backward), the unmodified batch 0, every surgered batch.

``run_batches`` scores each batch, streams ``to: disk`` captures into a shard after it, checks the disk
budget on the first shard and stops cleanly between batches when a signal asked to.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.app.batches import Batch, Batches
from surgery.app.inputs import loss_of
from surgery.app.prepare import Job
from surgery.app.report import fingerprint, first_tensor
from surgery.app.scoring import Scoring
from surgery.core.compiler import Plan
from surgery.core.engine import Surgery
from surgery.core.schema import RunSettings
from surgery.errors import ActionError, ConfigError, SurgeryError
from surgery.files.write import expect_disk, write_tensors


def forward(
    model: nn.Module,
    batch: Batch,
    settings: RunSettings,
    target: Any,
    losses: list[float] | None = None,
    loss_metric: Any = None,
) -> Any:
    """Run the model on one batch; with ``backward`` also the loss's backward pass (its value kept in ``losses``)."""
    if not settings.backward:
        with torch.no_grad():
            return model(*batch.args, **batch.kwargs)
    args = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in batch.args)  # token ids stay ints
    output = model(*args, **batch.kwargs)
    if loss_metric is not None:  # loss: {logit_diff: ...}, a per-example metric averaged over the examples
        loss = loss_metric(first_tensor(output), batch.labels).mean()
    else:
        loss = loss_of(first_tensor(output), settings.loss, target)
    if losses is not None:
        losses.append(float(loss.detach()))
    loss.backward()
    return output


def unmodified_forward(job: Job) -> Any:
    """The model before surgery on batch 0; failing here is the input's fault, not the surgery's."""
    try:
        return forward(job.model, job.data.first, job.settings, target_of(job, job.data.first), job.losses,
                       job.loss_metric)  # fmt: skip
    except SurgeryError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"input: the model fails on this input before any surgery: {type(e).__name__}: {e}") from e


def target_of(job: Job, batch: Batch) -> Any:
    """What the loss compares with: a data set's labels, else ``input.target`` (text labels are token ids)."""
    if batch.labels is not None and job.data.text is None:
        return batch.labels
    return job.input_spec.get("target")


def surgered_forward(job: Job, batch: Batch) -> Any:
    """The surgered model on one batch; failing outside our hooks means the surgery broke it: bad config."""
    try:
        return forward(job.model, batch, job.settings, target_of(job, batch), job.losses, job.loss_metric)
    except SurgeryError:
        raise
    except Exception as e:  # noqa: BLE001
        changes = [
            f"{s.name} on {', '.join(t.name for t in s.targets[:3])}{' …' if len(s.targets) > 3 else ''}"
            for s in job.plan.steps
            if s.enabled and not s.traits.observes
        ]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ActionError(
            f"the model fails after the surgery ({'; '.join(changes) or 'no changing action'}):"
            f" {type(e).__name__}: {first}"
        ) from e


def run_batches(job: Job, surgery: Surgery, out_dir: Path, scoring: Scoring | None = None) -> tuple[Any, str, int]:
    """Every batch through the surgered model, scoring it and streaming disk captures after each.

    Returns batch 0's output, the output fingerprint and how many batches ran: fewer than
    ``job.batches`` when a signal asked to stop (checked after each batch, shard written).
    """
    clock = time.perf_counter()
    first: Any = None
    prints = []
    shards = 0
    with job.interrupts.deferring(), progress(job.data) as bar:
        for batch, data in enumerate(job.data):
            surgery.reset_calls()  # calls: counts per module within a batch
            output = surgered_forward(job, data)
            if scoring is not None:
                scoring.update(surgery, data, output)
            bar.update(scoring.last_examples if scoring is not None else _examples(data))
            first = output if batch == 0 else first
            prints.append(fingerprint(output))
            shards += write_shard(surgery, out_dir / "captures", shards)
            if batch == 0 and shards:  # as many shards as batches: a run that would pass limits.disk_gb stops now
                size = os.path.getsize(out_dir / "captures" / "batch-00000.safetensors")
                expect_disk((job.batches - 1) * size, f"actions.{min(streamed_actions(job.plan))}.to")
            job.reached.done = batch + 1
            if job.interrupts.requested:
                break
    job.timings["forward_s"] = time.perf_counter() - clock
    return first, prints[0] if job.batches == 1 else fingerprint(prints), job.reached.done


def write_shard(surgery: Surgery, directory: Path, number: int) -> int:
    """Write the ``to: disk`` calls since the last shard to ``directory/batch-NNNNN.safetensors``; 1 if written."""
    flat = surgery.take_streamed()
    if not flat:
        return 0
    key = f"actions.{next(iter(flat)).split('/')[0]}.to"  # a refusal past limits.disk_gb names a capture to disk
    write_tensors(directory / f"batch-{number:05d}.safetensors", flat, key)
    return 1


def streamed_actions(plan: Plan) -> set[str]:
    """The names of the actions whose captures stream to disk (``to: disk``)."""
    return {s.name for s in plan.steps if s.enabled and s.streams}


def progress(data: Batches) -> Any:
    """A progress bar over the examples (with examples/s) on a terminal, for more than one batch; else silent."""
    from tqdm import tqdm

    shown = data.count > 1 and sys.stderr.isatty()
    return tqdm(total=data.examples, unit="ex", desc="examples", file=sys.stderr, disable=not shown, leave=False)


def _examples(batch: Batch) -> int:
    first = (*batch.args, *batch.kwargs.values())
    return int(first[0].shape[0]) if first and first[0].dim() else 1
