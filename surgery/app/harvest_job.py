"""``python -m surgery ... +input=text_dataset mode=harvest``: a corpus into ``activations/`` of the run directory.

Builds the model, applies the recipe (``+actions=...``: a steered or spliced model is harvested as such),
and runs :func:`surgery.harvest.harvest_corpus`. Rerun the same command in the same ``hydra.run.dir`` to
resume: finished shards are kept. SIGINT/SIGTERM stops after the current batch (the shard in progress
is not written), leaving a resumable harvest; a second signal stops at once. Under torchrun every
rank writes its share of the shards into rank 0's run directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from surgery.app.batches import input_spec
from surgery.app.build import build_model, resolve_device, seed_everything, settings_of
from surgery.app.interrupt import Interrupted, Interrupts, exit_code, remove_temporary_files
from surgery.core.compiler import load_actions
from surgery.core.schema import validate
from surgery.dist.wrap import launched_by_torchrun, wrap_of
from surgery.errors import ConfigError
from surgery.files.gate import listing, remove_tree
from surgery.files.write import write_json
from surgery.harvest.config import HarvestSettings, TextDatasetInput
from surgery.report import write_report_html

FOLDER = "activations"
SHARED_INPUT_KEYS = ("shape", "shapes", "target")  # a model's input defaults another kind keeps: not a corpus's


def run_harvest_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Check everything, harvest into ``out_dir/activations``; returns report.json's dict."""
    import torch

    from surgery.harvest import harvest_corpus
    from surgery.harvest.run import say_done
    from surgery.lm.text import load_tokenizer

    settings = settings_of(cfg)
    options = validate(HarvestSettings, _plain(settings.harvest or {}), "harvest")
    if wrap_of(cfg) != "none":
        raise ConfigError("distributed.wrap: a harvest runs the whole model on every rank; leave distributed.wrap=none")
    spec = input_spec(_plain(cfg.model.get("input") or {}), _plain(cfg.get("input") or {}))
    if spec.get("kind") != "text_dataset":
        raise ConfigError(
            f"input.kind: mode=harvest reads a text corpus, not kind {spec.get('kind') or 'random'};"
            " add +input=text_dataset input.path=CORPUS"
        )
    corpus = validate(TextDatasetInput, {k: v for k, v in spec.items() if k not in SHARED_INPUT_KEYS}, "input")
    ranks, out_dir = _ranks(settings.device, out_dir)
    device = _device(settings.device, ranks)
    seed_everything(settings.seed)
    actions = load_actions(cfg.get("actions"))
    model = build_model(cfg.model, settings, device)
    model_path = cfg.model.get("path") or getattr(model, "name_or_path", None) or None
    tokenizer = load_tokenizer(corpus.tokenizer, model_path=model_path)
    directory = out_dir / FOLDER
    with Interrupts() as interrupts:
        try:
            with interrupts.deferring():
                outcome = harvest_corpus(
                    model, tokenizer, corpus.path, directory, options.sites, column=corpus.column,
                    split=corpus.split, context=corpus.context, limit_tokens=corpus.limit_tokens,
                    batch_size=corpus.batch_size, exclude=options.exclude, dtype=options.dtype or settings.dtype,
                    shard_mb=options.shard_mb, actions=actions, seed=settings.seed, strict=settings.strict,
                    safe=settings.safe, ranks=ranks, stop_requested=lambda: interrupts.requested,
                )  # fmt: skip
        except Interrupted as stop:
            remove_temporary_files(directory)
            print(f"interrupted by {stop.args[0]}: stopped at once; rerun the same command with"
                  f" hydra.run.dir={out_dir} to resume", file=sys.stderr)  # fmt: skip
            raise SystemExit(exit_code(stop.signum)) from None
    manifest = outcome.manifest
    report = {
        "mode": "harvest",
        "complete": outcome.complete,
        "harvest": {k: manifest.get(k) for k in ("rows", "tokens", "kept_tokens", "context", "sites", "dtype")},
        "files": f"{FOLDER}/",
        "shards": len(manifest.get("shards", [])),
        "computed": outcome.computed,
        "seconds": outcome.seconds,
        "fingerprints": manifest["fingerprints"],
        "device": str(device),
        "torch": torch.__version__,
    }
    if ranks[0] == 0:
        write_json(out_dir / "report.json", report)
        write_report_html(report, out_dir)
    _leave_group()
    if interrupts.requested:
        print(
            f"interrupted by {interrupts.name}: stopped after a batch, {outcome.computed} shard(s) written now;"
            f" rerun the same command with hydra.run.dir={out_dir} to resume",
            file=sys.stderr,
        )
        raise SystemExit(exit_code(interrupts.signal or 0))
    if ranks[0] == 0:
        say_done(outcome, directory)
    return report


def _ranks(device: str, out_dir: Path) -> tuple[tuple[int, int], Path]:
    """(rank, world size) and the run directory every rank writes into: rank 0's under torchrun."""
    if not launched_by_torchrun():
        return (0, 1), out_dir
    import torch.distributed as dist

    from surgery.dist.wrap import start_group

    start_group(device)
    shared = [str(out_dir)]
    dist.broadcast_object_list(shared, src=0)
    run_dir = Path(shared[0])
    if run_dir != out_dir and out_dir.is_dir():  # this rank's own Hydra directory holds only its config and log
        if all(name == ".hydra" or name.endswith(".log") for name in listing(out_dir, "hydra.run.dir")):
            remove_tree(out_dir)
    return (dist.get_rank(), dist.get_world_size()), run_dir


def _device(device: str, ranks: tuple[int, int]) -> Any:
    import os

    import torch

    resolved = resolve_device(device)
    if ranks[1] > 1 and resolved.type == "cuda":  # one GPU per local rank
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return resolved


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)  # type: ignore[return-value]
