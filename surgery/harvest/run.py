"""The harvest loop: packed rows through the (surgered) model, every site's output kept, shards written.

The sites become one ``capture`` action appended to the recipe and planned with it, so a site is
resolved as every selector is, and its hook runs after the recipe's own (a steered model is
harvested as steered). Rows are cut into shards of ``rows_per_shard`` rows (a multiple of the
batch size, sized so one module's shard is at most ``shard_mb``); each shard's activations are
copied into buffers of the stored dtype (pinned on a GPU), then written by a background thread while
the next shard runs. Memory is two shards of buffers whatever the corpus's size.

Resuming: a shard whose files exist is not computed again; its stored token ids are compared with the
ids the corpus gives now, so a changed corpus is refused instead of mixed. Under torchrun rank ``r``
of ``n`` computes shards ``r, r + n, ...``; every rank reads the whole corpus (tokenizing is cheap next
to the forward) and rank 0 writes the manifest.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from surgery.core.compiler import Plan, compile_plan
from surgery.core.engine import Surgery, apply_plan
from surgery.core.limits import check_memory, written
from surgery.core.output import say
from surgery.errors import ConfigError
from surgery.files.write import expect_disk, write_json, write_tensors
from surgery.harvest.feed import example_of, forward_kwargs, run_forward, site_tensor
from surgery.harvest.shards import (
    FORMAT,
    MANIFEST,
    TOKENS,
    check_resumable,
    finished,
    shard_path,
    stored_ids,
    token_file,
)
from surgery.harvest.sites import site_labels
from surgery.harvest.stream import chained, in_shards, prefetched
from surgery.safe.costs import check_harvest_disk, harvest_bytes

ACTION = "harvest"  # mode=harvest adds a capture action harvest_I to the recipe for selector I of harvest.sites
MiB = 2**20


@dataclass
class HarvestRun:
    """Everything one harvest needs, as plain values (the CLI and the Python API both fill it)."""

    model: nn.Module
    rows: Iterable[torch.Tensor]  # int64 [context] each, in corpus order
    directory: Path  # the dataset's folder (a run's ``activations/``)
    sites: list[str]
    context: int
    actions: dict[str, Any] = field(default_factory=dict)  # the recipe applied while harvesting
    excluded: list[int] = field(default_factory=list)  # token ids the by-token view skips
    dtype: torch.dtype | None = None  # stored dtype; None: the model's
    shard_mb: float = 128
    batch_size: int = 8
    limit_rows: int | None = None  # how many rows the corpus gives at most (for the bar, ETA and disk check)
    prints: dict[str, str] = field(default_factory=dict)  # model, corpus, config: an earlier harvest must match
    about: dict[str, Any] = field(default_factory=dict)  # more for the manifest (corpus, tokenizer, exclude names)
    seed: int = 0
    strict: bool = True
    safe: bool = False
    ranks: tuple[int, int] = (0, 1)  # (rank, world size)
    stop_requested: Any = None  # a callable: True when a signal asked to stop (checked after every batch)
    progress: bool = True  # a bar with tokens/s and ETA on a terminal
    estimate: Any = None  # without limit_rows: a callable, tokens so far -> the corpus's tokens (about), for the ETA


@dataclass
class Outcome:
    """What a harvest did: the manifest it wrote, and whether it stopped early."""

    manifest: dict[str, Any]
    complete: bool
    computed: int  # shards this process computed (the rest were there already, or another rank's)
    seconds: float


def harvest(run: HarvestRun) -> Outcome:
    """Harvest ``run.sites`` over every row into ``run.directory``; resumes what an earlier run left."""
    clock = time.perf_counter()
    rank, world = run.ranks
    rows = iter(run.rows)
    first = next(rows, None)  # a corpus without one row is refused here, before anything is written
    if first is None:
        raise ConfigError("input.path: the corpus gives no row of tokens")
    device = _device_of(run.model)
    kwargs = forward_kwargs(run.model)
    plan, names = plan_sites(run, first.unsqueeze(0).to(device), kwargs)
    dtype = run.dtype or _dtype_of(run.model)
    surgery = apply_plan(run.model, plan, verify=True)
    try:
        shapes = _probe(surgery, run.model, first.unsqueeze(0).to(device), kwargs, names)
        row_bytes = {n: math.prod(s) * run.context * dtype.itemsize for n, s in shapes.items()}
        per_shard = rows_per_shard(max(row_bytes.values()), run.shard_mb, run.batch_size)
        _check_costs(run, row_bytes, per_shard)
        manifest = _start(run, names, shapes, dtype, per_shard)
        with ThreadPoolExecutor(1, thread_name_prefix="harvest-writer") as writer:
            state = _Loop(run, surgery, names, shapes, dtype, per_shard, writer, kwargs, device, manifest)
            state.run(chained(first, rows))
        manifest = _finish(run, manifest, state, time.perf_counter() - clock)
    finally:
        surgery.remove()
    return Outcome(manifest, manifest["complete"], state.computed, time.perf_counter() - clock)


class Site(NamedTuple):
    """Where one harvested site is recorded: the capture action and the module it records."""

    action: str
    module: str


def plan_sites(run: HarvestRun, example: torch.Tensor, kwargs: dict[str, Any]) -> tuple[Plan, dict[str, Site]]:
    """The recipe plus one capture per selector of ``harvest.sites``, planned together.

    Returns the plan and, per stored name, the capture action and module. An ``@`` site is stored under its
    site name (``resid_pre.1``, the module in the manifest), a glob under the module's name. A selector per
    action lets one harvest mix globs and kinds of ``@`` site; a module matched twice is refused.
    """
    captures = {f"{ACTION}_{i}": selector for i, selector in enumerate(run.sites)}
    taken = sorted(set(captures) & set(run.actions))
    if taken:
        raise ConfigError(f"actions.{taken[0]}: mode=harvest adds its own capture under this name; rename the action")
    recipe = {**run.actions, **{name: {"kind": "capture", "select": selector} for name, selector in captures.items()}}
    try:
        plan = compile_plan(run.model, recipe, seed=run.seed, strict=run.strict, safe=run.safe,
                            **example_of(example, kwargs))  # fmt: skip
    except ConfigError as e:
        text = str(e)
        ours = next((name for name in captures if text.startswith(f"actions.{name}.")), None)
        if ours is None:
            raise
        rest = text.partition(": ")[2].replace(" Set allow_empty: true if that is expected.", "")
        raise ConfigError(f"harvest.sites: {rest}") from None
    names: dict[str, Site] = {}
    for step in plan.steps:
        if step.name not in captures:
            continue
        if not step.targets:
            raise ConfigError(
                f"harvest.sites: {captures[step.name]!r} matched no module; see the names with mode=modules"
            )
        labels = site_labels(run.model, captures[step.name], [t.name for t in step.targets])
        for target in step.targets:
            label = labels[target.name]  # one name, one site: @resid_pre.1 and @resid_post.1 share a module
            if label in names:
                first = captures[names[label].action]
                raise ConfigError(
                    f"harvest.sites: {label} is matched by both {first!r} and {captures[step.name]!r}; each"
                    " site is stored once, so give it once"
                )
            names[label] = Site(step.name, target.name)
    if TOKENS in names:
        raise ConfigError(f"harvest.sites: a module named {TOKENS!r} would share the folder of the token ids")
    return plan, names


def rows_per_shard(row_bytes: int, shard_mb: float, batch_size: int) -> int:
    """Rows per shard: as many whole batches as fit ``shard_mb`` MiB for the widest site (at least one batch)."""
    fit = int(shard_mb * MiB // max(row_bytes, 1))
    return max(batch_size, fit // batch_size * batch_size)


def _probe(
    surgery: Surgery, model: nn.Module, row: torch.Tensor, kwargs: dict[str, Any], names: dict[str, Site]
) -> dict[str, list[int]]:
    """Each site's per-token shape, from one row through the surgered model."""
    run_forward(model, row, kwargs)
    return {n: list(site_tensor(surgery, *site, 1, row.shape[1]).shape[2:]) for n, site in names.items()}


def _check_costs(run: HarvestRun, row_bytes: dict[str, int], per_shard: int) -> None:
    """Refuse now (nothing written) a harvest past ``limits.memory_gb`` (two shards of buffers) or, with
    ``limit_tokens``, ``disk_gb``: every site's rows × width × stored dtype over the rows it allows. Without a
    limit the corpus's tokens are not known (documents are read in batches: an estimate this early is far off),
    so the first shard is checked before it is written and every later write is charged as it goes."""
    shard = per_shard * (sum(row_bytes.values()) + run.context * 4)
    check_memory(2 * shard, "harvest.shard_mb", f"two shards of {len(row_bytes)} site(s) in memory")
    if run.limit_rows is not None:
        total = harvest_bytes(run.limit_rows, row_bytes.values(), run.context)
        check_harvest_disk(total, written(), "input.limit_tokens")


def _start(
    run: HarvestRun, names: dict[str, Site], shapes: dict[str, list[int]], dtype: torch.dtype, per_shard: int
) -> dict[str, Any]:
    """The manifest of this harvest so far; an earlier one in the directory must be the same harvest."""
    import torch.distributed as dist

    check_resumable(run.directory, run.prints)
    manifest = {
        "format": FORMAT,
        "complete": False,
        "context": run.context,
        "rows_per_shard": per_shard,
        "batch_size": run.batch_size,
        "sites": {n: {"shape": shapes[n], "module": site.module} for n, site in names.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "excluded_ids": list(run.excluded),
        **run.about,
        "fingerprints": dict(run.prints),
        "surgery_version": _version(),
    }
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank checked the directory before anyone writes into it
    return manifest


class _Loop:
    """The rows cut into shards; this rank's unfinished ones computed, written in the background."""

    def __init__(
        self, run: HarvestRun, surgery: Surgery, names: dict[str, Site], shapes: dict[str, list[int]],
        dtype: torch.dtype, per_shard: int, writer: ThreadPoolExecutor, kwargs: dict[str, Any], device: torch.device,
        manifest: dict[str, Any],
    ) -> None:  # fmt: skip
        self.job, self.surgery, self.names, self.shapes, self.dtype = run, surgery, names, shapes, dtype
        self.per_shard, self.writer, self.kwargs, self.device = per_shard, writer, kwargs, device
        self.pinned = device.type == "cuda"
        self.manifest = manifest  # written (unfinished) before the first shard: a refused harvest leaves nothing
        self.pending: Future[None] | None = None
        self.corpus = hashlib.sha256()
        self.rows = 0
        self.kept: list[int] = []  # kept tokens per shard, every shard
        self.shard_rows: list[int] = []
        self.computed = 0
        self.stopped = False

    def run(self, rows: Iterator[torch.Tensor]) -> None:
        rank, world = self.job.ranks
        total = None if self.job.limit_rows is None else self.job.limit_rows * self.job.context
        with _bar(total, self.job.progress and rank == 0) as bar:
            for number, ids in enumerate(prefetched(in_shards(rows, self.per_shard))):
                tokens = token_file(ids, self.job.excluded)
                self.corpus.update(tokens["input_ids"].numpy().tobytes())
                self.rows += ids.shape[0]
                self.shard_rows.append(ids.shape[0])
                self.kept.append(int(tokens["kept"].numel()))
                if total is None and self.job.estimate is not None:  # the ETA from how far through the corpus
                    bar.total = max(self.job.estimate(self.rows * self.job.context), bar.n)
                if number % world != rank:
                    continue
                if self.job.stop_requested is not None and self.job.stop_requested():
                    self.stopped = True  # before a shard: every shard so far is written whole
                    break
                done = finished(self.job.directory, self.names, number)
                stored = stored_ids(self.job.directory, number) if done else None
                if stored is not None:
                    shared = min(stored.shape[0], ids.shape[0])  # a last shard may get more rows (larger limit)
                    if not torch.equal(stored[:shared], ids[:shared]):
                        raise ConfigError(
                            f"input.path: the corpus gives other tokens than the harvest in {self.job.directory}"
                            f" read ({shard_path(self.job.directory, TOKENS, number).name}); rerun with the same"
                            " corpus, or choose another hydra.run.dir"
                        )
                    if stored.shape == ids.shape:
                        bar.update(ids.numel())
                        continue
                if not self._shard(number, ids, tokens, bar):
                    self.stopped = True
                    break
            self._wait()

    def _shard(self, number: int, ids: torch.Tensor, tokens: dict[str, torch.Tensor], bar: Any) -> bool:
        """Compute and hand shard ``number`` to the writer; False when a signal stopped it (nothing written)."""
        n, context, batch = ids.shape[0], self.job.context, self.job.batch_size
        buffers = {
            name: torch.empty((n, context, *self.shapes[name]), dtype=self.dtype, pin_memory=self.pinned)
            for name in self.names
        }
        stop = self.job.stop_requested
        source = ids.pin_memory() if self.pinned else ids  # from page-locked memory the copy to the GPU is async
        for start in range(0, n, batch):
            part = source[start : start + batch].to(self.device, non_blocking=self.pinned)
            run_forward(self.job.model, part, self.kwargs)
            for name, site in self.names.items():
                found = site_tensor(self.surgery, *site, part.shape[0], context)
                found = found.to(self.dtype)  # converted where it was computed: a GPU copies the smaller tensor
                buffers[name][start : start + part.shape[0]].copy_(found, non_blocking=self.pinned)
            bar.update(part.numel())
            if stop is not None and start + batch < n and stop():  # after the last batch: written, then stopped
                return False
        copied = None
        if self.pinned:  # the writer waits for the copies into the pinned buffers; the GPU goes on with the next shard
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
        self._wait()  # one shard writing while the next computes: memory stays two shards
        if self.computed == 0:
            self._first_write(tokens, buffers)
        context_now = contextvars.copy_context()  # the writer charges the run's disk budget (a context variable)
        self.pending = self.writer.submit(context_now.run, self._write, number, tokens, buffers, copied)
        self.computed += 1
        return True

    def _first_write(self, tokens: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """Before anything is written: the first shard's size against ``limits.disk_gb``, then the manifest."""
        size = sum(t.numel() * t.element_size() for t in (*tokens.values(), *buffers.values()))
        expect_disk(size, "harvest.shard_mb")
        path = self.job.directory / MANIFEST
        if self.job.ranks[0] == 0 and not path.is_file():
            write_json(path, self.manifest)

    def _write(
        self, number: int, tokens: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], copied: Any = None
    ) -> None:
        if copied is not None:
            copied.synchronize()  # the device-to-host copies of this shard have landed
        directory = self.job.directory
        for name, buffer in buffers.items():
            write_tensors(shard_path(directory, name, number), {"activations": buffer}, "harvest.shard_mb")
        write_tensors(shard_path(directory, TOKENS, number), tokens, "harvest.shard_mb")  # last: the shard is done

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()


def _finish(run: HarvestRun, manifest: dict[str, Any], loop: _Loop, seconds: float) -> dict[str, Any]:
    """The manifest over every rank's shards (rank 0 writes it), complete when every shard is on disk."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's shards are written
    shards = len(loop.shard_rows)
    complete = not loop.stopped and all(finished(run.directory, loop.names, k) for k in range(shards))
    manifest = {
        **manifest,
        "complete": complete,
        "rows": loop.rows,
        "tokens": loop.rows * run.context,
        "kept_tokens": sum(loop.kept),
        "shards": [{"rows": r, "kept": k} for r, k in zip(loop.shard_rows, loop.kept, strict=True)],
        "world_size": run.ranks[1],
        "seconds": seconds,
    }
    manifest["fingerprints"] = {**manifest["fingerprints"], "tokens": loop.corpus.hexdigest()}
    if run.ranks[0] == 0:
        write_json(run.directory / MANIFEST, manifest)
    return manifest


def _bar(total: int | None, shown: bool) -> Any:
    """A progress bar over tokens with tokens/s and (with a known total) the ETA; silent off a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, desc="harvest", file=sys.stderr,
                disable=not (shown and sys.stderr.isatty()), leave=False)  # fmt: skip


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _dtype_of(model: nn.Module) -> torch.dtype:
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    return first.dtype if first is not None else torch.float32


def _version() -> str:
    from surgery import __version__

    return __version__


def say_done(outcome: Outcome, directory: Path) -> None:
    """One line for people: tokens, sites, shards, speed, where."""
    m = outcome.manifest
    rate = m["tokens"] / outcome.seconds if outcome.seconds > 0 else float("nan")
    say(
        f"harvest: {m['tokens']:,} tokens ({m['kept_tokens']:,} kept) × {len(m['sites'])} site(s) in"
        f" {len(m['shards'])} shard(s), {outcome.computed} computed now, {rate:,.0f} tokens/s; wrote {directory}"
    )
