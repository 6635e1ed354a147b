"""One job on every rank torchrun started, written into one run directory.

``torchrun --nproc_per_node=N -m surgery ... distributed.wrap=ddp|fsdp|none``: every rank joins the
process group, builds the same model (same seed), wraps it, plans and applies the recipe by bare names
and runs its share of the input (a ``dataset`` input through a ``DistributedSampler``; other inputs are
the same on every rank). Each rank runs the ordinary job into a staging folder; then its files are
renamed into rank 0's run directory: ``captures.rank{R}.safetensors``, ``captures/rank{R}-batch-NNNNN``,
``output.rank{R}.safetensors``; and rank 0 writes ``report.json`` with ``world_size``, every rank's
fingerprints and metrics, and the metrics over all ranks (weighted by each rank's examples).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig

from surgery.dist.wrap import launched_by_torchrun, start_group, wrap_of
from surgery.errors import SurgeryError
from surgery.files.gate import listing, move, remove_tree, walk

_inside = False  # set while this process runs its rank's job: the job itself then runs as usual
_wrap = "none"
_device: Any = None


def wanted(cfg: DictConfig) -> bool:
    """Whether this job runs as one rank of several: under torchrun, or with ``distributed.wrap`` set."""
    return not _inside and (launched_by_torchrun() or wrap_of(cfg) != "none")


def wrapped(model: Any) -> Any:
    """The model wrapped as this rank's job asks (called by the job between building and planning)."""
    if not _inside:
        return model
    from surgery.dist.wrap import wrap_model

    return wrap_model(model, _wrap, _device)


def run_ranks(cfg: DictConfig, out_dir: Path, run_job: Callable[[DictConfig, Path], dict[str, Any]]) -> dict[str, Any]:
    """Run ``run_job`` on this rank into a staging folder, then gather every rank's files and report."""
    global _inside, _wrap, _device
    from surgery.core.schema import settings_of

    settings = settings_of(cfg)  # a bad setting is refused as in any run, before joining the group
    _device = start_group(settings.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    shared = [str(out_dir)]
    dist.broadcast_object_list(shared, src=0)  # rank 0's run directory is everyone's
    run_dir = Path(shared[0])
    if run_dir != out_dir:
        _drop_own_dir(out_dir)
    staging = run_dir / f".rank{rank}"
    _inside, _wrap = True, wrap_of(cfg)
    found: tuple[dict[str, Any] | None, str | None]
    error: Exception | None
    try:
        with contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext():  # rank 0 speaks
            found = (run_job(cfg, staging), None)
    except Exception as e:  # noqa: BLE001 - told to every rank (so none waits forever), raised here below
        found, error = (None, str(e) if isinstance(e, SurgeryError) else f"{type(e).__name__}: {e}"), e
    else:
        error = None
    finally:
        _inside = False
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, found)
    failed = [(r, message) for r, (_, message) in enumerate(everyone) if message is not None]
    if failed:
        remove_tree(staging)
        if error is not None:
            raise error
        raise SurgeryError(f"rank {failed[0][0]}: {failed[0][1]}")
    reports = [report for report, _ in everyone]
    _move_files(staging, run_dir, rank)
    dist.barrier()
    report = reports[0] or {}
    if rank == 0 and report:
        report = merged(reports, _wrap)
        from surgery.files.write import write_json

        write_json(run_dir / "report.json", report)
        print(f"distributed: {world} ranks (wrap {_wrap}), one run directory: {run_dir}")
    dist.barrier()
    dist.destroy_process_group()
    return report


def _drop_own_dir(out_dir: Path) -> None:
    """Remove the run directory Hydra made for this rank when rank 0's differs (only its config and log)."""
    if os.path.isdir(out_dir) and not os.path.islink(out_dir):
        names = listing(out_dir, "hydra.run.dir")
        if all(name == ".hydra" or name.endswith(".log") for name in names):
            remove_tree(out_dir)


RENAMED = {"captures.safetensors": "captures.rank{r}.safetensors", "output.safetensors": "output.rank{r}.safetensors"}
RANK0_ONLY = ("report.md", "report.html", "model.safetensors", "plots", "study.safetensors", "study.csv")


def _move_files(staging: Path, run_dir: Path, rank: int) -> None:
    """This rank's files into the run directory under rank-qualified names; the staging folder removed.

    Each file is renamed whole (it was written whole), so a kill leaves it in the staging folder or in place, and
    a rerun after a kill moves its files over those (a folder such as ``plots/`` is merged, not refused).
    """
    if not os.path.isdir(staging) or os.path.islink(staging):
        return
    moves = [(staging / name, run_dir / pattern.format(r=rank)) for name, pattern in RENAMED.items()]
    shards = [(shard, run_dir / "captures" / f"rank{rank}-{shard.name}")
              for shard in walk(staging / "captures", "captures", suffix=".safetensors")]  # fmt: skip
    moves += shards
    if rank == 0:
        moves += [(staging / name, run_dir / name) for name in RANK0_ONLY]
    for source, target in moves:
        if os.path.isdir(source) and not os.path.islink(source):  # plots/: file by file, onto what a killed run moved
            for path in walk(source, "hydra.run.dir"):
                move(path, target / path.relative_to(source), "hydra.run.dir")
        elif os.path.lexists(source):
            move(source, target, "hydra.run.dir")
    remove_tree(staging)


def merged(reports: list[dict[str, Any]], wrap: str) -> dict[str, Any]:
    """Rank 0's report with ``world_size``, every rank's fingerprints, files and metrics, and metrics over all."""
    report = dict(reports[0])
    report["world_size"] = len(reports)
    report["distributed"] = {"wrap": wrap}
    report["ranks"] = [
        {
            "rank": r,
            "fingerprints": one.get("fingerprints"),
            "metrics": one.get("metrics"),
            "examples": (one.get("data") or {}).get("examples"),
            "batches_done": one.get("batches_done"),
        }
        for r, one in enumerate(reports)
    ]
    if isinstance(report.get("data"), dict) and report.get("mode") != "study":  # every rank's share together
        # (a study's ranks split the cells, not the examples: each saw every example)
        report["data"] = {**report["data"], "examples": sum(r["examples"] or 0 for r in report["ranks"])}
    if "captures" in report:
        report["captures"] = {
            "files": [
                RENAMED["captures.safetensors"].format(r=r)
                for r, one in enumerate(reports)
                if (one.get("captures") or {}).get("file")
            ],  # fmt: skip
            "count": sum((one.get("captures") or {}).get("count", 0) for one in reports),
            "shards": [
                f"rank{r}-{s}" for r, one in enumerate(reports) for s in (one.get("captures") or {}).get("shards", [])
            ],
        }
    if report.get("output_file"):
        report["output_file"] = RENAMED["output.safetensors"].format(r=0)
    if report.get("metrics"):
        report["metrics"] = _weighted(report["ranks"])
    return report


def _weighted(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's mean over all ranks, weighted by how many examples each scored; deltas recomputed."""
    total = sum(r["examples"] or 0 for r in ranks) or 1
    out: dict[str, Any] = {}
    for side in ("surgered", "unmodified"):
        names = (ranks[0]["metrics"] or {}).get(side) or {}
        out[side] = {
            name: sum((r["metrics"][side][name] or 0.0) * (r["examples"] or 0) for r in ranks) / total for name in names
        }
    if out.get("surgered"):
        out["delta"] = {k: out["surgered"][k] - out["unmodified"][k] for k in out["surgered"]}
    else:
        out.pop("surgered", None)
    return out
