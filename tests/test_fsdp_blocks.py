"""``distributed.wrap=fsdp`` shards each repeated block, then the root (issue 25: ``torchrun -m surgery +model=mlp
distributed.wrap=fsdp`` was exit 1, ``fully_shard`` refusing the ``ModuleList``): built-in models and Hugging Face
ones (``_no_split_modules``), in process on a one-rank gloo group, and one two-rank torchrun launch of the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery.dist.wrap import fsdp_blocks, wrap_model
from surgery.models.cnn import digits_cnn
from surgery.models.mlp import MLP

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
ROOT = Path(__file__).resolve().parent.parent


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))  # a list inside a block stays the block's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(h(x) for h in self.heads)


def names_of(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    name = {id(m): n for n, m in model.named_modules()}
    return [name[id(b)] for b in blocks]


def gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    from surgery.models.hf import gpt2_tiny

    return gpt2_tiny()


@pytest.mark.parametrize(
    ("build", "blocks"),
    [
        (lambda: MLP(depth=3), ["layers.0", "layers.1", "layers.2"]),  # a ModuleList's children, not the list
        (lambda: nn.Sequential(Block(), Block(), Block()), ["0", "1", "2"]),
        (digits_cnn, ["block1", "block2", "block3", "classifier"]),  # nothing repeats: each child with parameters
        (gpt2, ["transformer.h.0", "transformer.h.1"]),  # GPT2LMHeadModel._no_split_modules: GPT2Block
    ],
    ids=["mlp", "repeated-sequential", "cnn", "gpt2"],
)
def test_the_blocks_sharded_before_the_root(build, blocks: list[str]) -> None:  # noqa: ANN001
    model = build()
    assert names_of(model, fsdp_blocks(model)) == blocks


@pytest.mark.parametrize("build", [lambda: MLP(depth=3), gpt2], ids=["mlp", "gpt2"])
def test_fully_shard_takes_every_model_and_a_surgery_on_it_equals_the_unsharded_one(build, gloo_group: None) -> None:  # noqa: ANN001
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    plain, sharded = build().eval(), None
    sharded = build().eval()
    sharded.load_state_dict(plain.state_dict())
    sharded = wrap_model(sharded, "fsdp", torch.device("cpu"))
    shards = [n for n, m in sharded.named_modules() if isinstance(m, FSDPModule)]
    assert shards == ["", *names_of(sharded, fsdp_blocks(sharded))]
    is_lm = hasattr(plain, "transformer")
    x = torch.randint(0, 100, (2, 5)) if is_lm else torch.randn(3, 16)
    site = "transformer.h.1.mlp" if is_lm else "layers.1"
    actions = {
        "s": {"kind": "modify_output", "select": site, "op": "mul", "value": 0.5},
        "c": {"kind": "capture", "select": site},
    }
    outputs = []
    for model in (plain, sharded):
        with torch.no_grad(), surgery.apply(model, actions) as s:
            out = model(x)
            outputs.append(((out.logits if is_lm else out), s.captures["c"][site].output))
    assert torch.allclose(outputs[0][0], outputs[1][0], atol=1e-6) and torch.equal(outputs[0][1], outputs[1][1])


def test_torchrun_cli_shards_the_mlp(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "surgery",
        "+model=mlp", "+actions.c={kind:capture,select:layers.1}", "distributed.wrap=fsdp", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["distributed"] == {"wrap": "fsdp"}
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
