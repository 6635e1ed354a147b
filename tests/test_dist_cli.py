"""``torchrun --nproc_per_node=2 -m surgery ... distributed.wrap=ddp``: one run directory for both ranks (SPEC §10).

One torchrun launch for the module (gloo, CPU); the tests read what it wrote. Each rank's captures are
compared with the same forward hooks in plain PyTorch on that rank's share of the digits (the indices a
``DistributedSampler`` gives rank R of 2, in order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DistributedSampler

from surgery.data.loader import dataset_input, open_dataset
from surgery.dist.run import merged
from surgery.models.cnn import digits_cnn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of one two-rank CLI run: 40 digits, batches of 8, a memory and a disk capture, DDP."""
    out = tmp_path_factory.mktemp("dist") / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "surgery",
        "+model=cnn", "input.limit=40", "input.batch_size=8", "+actions.c={kind:capture,select:block3.conv}",
        "+actions.d={kind:capture,select:block2.conv,to:disk}", "distributed.wrap=ddp", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def by_hand(rank: int) -> dict[str, list[torch.Tensor]]:
    """block3.conv's and block2.conv's output on each batch of rank ``rank``'s share, by plain forward hooks."""
    dataset = open_dataset(
        dataset_input({"kind": "dataset", "source": "digits", "split": "test", "limit": 40, "shape": [2, 1, 28, 28]})
    )
    indices = list(DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False))
    model = digits_cnn().eval()
    seen: dict[str, list[torch.Tensor]] = {"block3.conv": [], "block2.conv": []}
    for name, found in seen.items():
        model.get_submodule(name).register_forward_hook(lambda m, a, out, found=found: found.append(out.detach()))
    with torch.no_grad():
        for start in range(0, len(indices), 8):
            batch = torch.stack([dataset[i][0] for i in indices[start : start + 8]])
            model(batch)
    return seen


def test_one_run_directory_with_every_ranks_files(run_dir: Path) -> None:
    names = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("."))
    assert names == ["captures", "captures.rank0.safetensors", "captures.rank1.safetensors", "output.rank0.safetensors",
                     "output.rank1.safetensors", "report.html", "report.json", "report.md", "surgery.log"]  # fmt: skip
    shards = sorted(p.name for p in (run_dir / "captures").iterdir())
    assert shards == [f"rank{r}-batch-{b:05d}.safetensors" for r in (0, 1) for b in range(3)]
    assert not any(run_dir.glob(".rank*"))  # the staging folders are gone


def test_report_has_world_size_and_each_ranks_fingerprints(run_dir: Path) -> None:
    report = json.loads((run_dir / "report.json").read_text())
    assert report["world_size"] == 2 and report["distributed"] == {"wrap": "ddp"}
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    prints = [r["fingerprints"] for r in report["ranks"]]
    assert prints[0]["config"] == prints[1]["config"] and prints[0]["input"] != prints[1]["input"]  # own shares
    assert report["data"]["examples"] == 40 and [r["examples"] for r in report["ranks"]] == [20, 20]
    accuracy = [r["metrics"]["surgered"]["accuracy"] for r in report["ranks"]]
    assert report["metrics"]["surgered"]["accuracy"] == pytest.approx(sum(accuracy) / 2)
    assert report["captures"]["files"] == ["captures.rank0.safetensors", "captures.rank1.safetensors"]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_captured_its_share(run_dir: Path, rank: int) -> None:
    expected = by_hand(rank)
    memory = load_file(run_dir / f"captures.rank{rank}.safetensors")
    assert sorted(memory) == [f"c/block3.conv/output/{i}" for i in range(3)]
    for i, want in enumerate(expected["block3.conv"]):
        assert torch.equal(memory[f"c/block3.conv/output/{i}"], want)
    for i, want in enumerate(expected["block2.conv"]):
        shard = load_file(run_dir / "captures" / f"rank{rank}-batch-{i:05d}.safetensors")
        assert torch.equal(shard["d/block2.conv/output"], want)


def test_merged_metrics_are_weighted_by_examples() -> None:
    def one(examples: int, accuracy: float) -> dict[str, Any]:
        metrics = {"surgered": {"accuracy": accuracy}, "unmodified": {"accuracy": 1.0}, "delta": {}}
        return {"fingerprints": {"output": str(examples)}, "metrics": metrics, "data": {"examples": examples}}

    report = merged([one(30, 0.5), one(10, 1.0)], "none")
    assert report["metrics"]["surgered"] == {"accuracy": 0.625}
    assert report["metrics"]["delta"] == {"accuracy": -0.375}
    assert report["data"]["examples"] == 40 and report["world_size"] == 2
